"""`kvroute stats`: the dashboard's figures as terminal tables, from a proxy's /stats.

A proxy with API keys answers /stats only to an operator key (`--api-key KEY:operator`
on the proxy); `KVROUTE_API_KEY` names the key this command sends."""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request
from datetime import datetime

import orjson
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from kvroute.core.sizes import format_bytes


def fetch(url: str, api_key: str | None = None, timeout: float = 5.0) -> dict:
    req = urllib.request.Request(url.rstrip("/") + "/stats")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return orjson.loads(r.read())


def percent(ratio: float | None) -> str:
    return "—" if ratio is None else f"{ratio * 100:.1f}%"


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v:.0f}"


def render(stats: dict, decisions: int = 10) -> Group:
    t = stats["totals"]
    head = Table(title=f"kvroute — {datetime.fromtimestamp(stats['now']):%H:%M:%S}, "
                 f"up {stats['uptime_s']:.0f}s")
    for col in ("hit ratio", "prompt tokens", "cached tokens", "prefill s saved", "requests", "errors"):
        head.add_column(col, justify="right")
    head.add_row(percent(t["hit_ratio"]), f"{t['prompt_tokens']:,}", f"{t['cached_tokens']:,}",
                 f"{t['seconds_saved']:.1f}", f"{t['requests']:,}", f"{t['errors']:,}")

    models = Table(title="models")
    for col in ("model", "hit ratio", "requests", "s saved", "TTFT cached p50/p95 ms",
                "TTFT cold p50/p95 ms"):
        models.add_column(col, justify="right" if col != "model" else "left")
    for name, m in sorted(stats["models"].items()):
        c, k = m["ttft_ms"]["cached"], m["ttft_ms"]["cold"]
        models.add_row(name, percent(m["hit_ratio"]), f"{m['requests']:,}", f"{m['seconds_saved']:.1f}",
                       f"{_ms(c['p50'])} / {_ms(c['p95'])}", f"{_ms(k['p50'])} / {_ms(k['p95'])}")

    backends = Table(title="backends")
    for col in ("backend", "models", "hit ratio", "cache", "disk", "hits ram/disk", "restore tok/s",
                "queue", "inflight", "prefill tok/s"):
        backends.add_column(col, justify="left" if col in ("backend", "models") else "right")
    for b in stats["backends"]:
        name = b["id"] + (" (suspect)" if b["suspect"] else "") + (
            f" ({b['mismatch']} mismatch)" if b.get("mismatch") else "")
        backends.add_row(name, ", ".join(b["models"]), percent(b["hit_ratio"]),
                         f"{format_bytes(b['cache_bytes'])} / {format_bytes(b['cache_budget'])}",
                         _disk(b), f"{b.get('ram_hits', 0)} / {b.get('disk_hits', 0)}",
                         f"{b.get('restore_tps', 0):.0f}" if b.get("restore_tps") else "—",
                         str(b["queue_depth"]), str(b["inflight"]), f"{b['prefill_tps']:.0f}")

    recent = Table(title="latest routing decisions")
    for col in ("time", "model", "backend", "reason", "blocks", "predicted", "cached", "TTFT ms", "status"):
        recent.add_column(col)
    for d in stats["decisions"][:decisions]:
        recent.add_row(f"{datetime.fromtimestamp(d['t']):%H:%M:%S}", d["model"], d["backend"],
                       d["reason"], str(d["prefix_blocks"]), str(d["predicted_tokens"]),
                       "—" if d["cached_tokens"] is None else str(d["cached_tokens"]),
                       _ms(d["ttft_ms"]), str(d["status"]))
    return Group(head, models, *model_states(stats), backends, recent)


def model_states(stats: dict) -> list[Table]:
    """Configured models of `kvroute serve` deployments: loaded or not, and their history."""
    rows = stats.get("model_states") or []
    if not rows:
        return []
    table = Table(title="model states")
    for col in ("model", "state", "machine", "memory", "last use", "loads", "unloads", "load s"):
        table.add_column(col, justify="left" if col in ("model", "state", "machine") else "right")
    for m in rows:
        state = m["state"] + (" (pinned)" if m["pinned"] else "")
        used = f"{datetime.fromtimestamp(m['last_used']):%H:%M:%S}" if m["last_used"] else "—"
        table.add_row(m["model"], state, m["machine"], format_bytes(m["memory_bytes"]), used,
                      str(m["loads"]), str(m["unloads"]), f"{m['load_seconds']:.1f}")
    return [table]


def _disk(b: dict) -> str:
    if not b.get("disk_budget"):
        return "off"
    return f"{format_bytes(b['disk_bytes'])} / {format_bytes(b['disk_budget'])}"


def run(url: str, watch: bool, api_key: str | None = None, period: float = 2.0) -> int:
    api_key = api_key or os.environ.get("KVROUTE_API_KEY") or None
    console = Console()
    try:
        if not watch:
            console.print(render(fetch(url, api_key)))
            return 0
        with Live(render(fetch(url, api_key)), console=console, refresh_per_second=2) as live:
            while True:
                time.sleep(period)
                live.update(render(fetch(url, api_key)))
    except KeyboardInterrupt:
        return 0
    except urllib.error.HTTPError as exc:
        hint = ("; set KVROUTE_API_KEY to an operator key (`--api-key KEY:operator` on the "
                "proxy)" if exc.code in (401, 403) else "")
        console.print(f"[red]kvroute stats: cannot read {url}/stats: {exc}{hint}[/]",
                      highlight=False, soft_wrap=True)
        return 1
    except OSError as exc:
        console.print(f"[red]kvroute stats: cannot read {url}/stats: {exc}[/]")
        return 1

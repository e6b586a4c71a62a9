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
from rich.text import Text

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


NAME_WIDTH = 22  # a name column keeps up to this many characters on one line


def _name(table: Table, header: str, values: list[str] | tuple = (), keep: bool = False) -> None:
    """A column of names (backends, models, teams, reasons): wrapped where the terminal
    is too narrow, never cut, so two backends named alike stay apart. `keep`: as wide as
    its longest name (up to NAME_WIDTH), the columns beside it wrap first."""
    width = min(NAME_WIDTH, max([len(header), *map(len, values)])) if keep else None
    table.add_column(header, overflow="fold", justify="left", min_width=width)


def _numbers(table: Table, *headers: str) -> None:
    for header in headers:
        table.add_column(header, justify="right", no_wrap=True)


def render(stats: dict, decisions: int = 10) -> Group:
    t = stats["totals"]
    head = Table(title=f"kvroute — {datetime.fromtimestamp(stats['now']):%H:%M:%S}, "
                 f"up {stats['uptime_s']:.0f}s")
    # Two-line headers: at 80 columns (a pipe, a small terminal) every column still shows.
    _numbers(head, "hit\nratio", "prompt\ntok", "cached\ntok", "prefill s\nsaved", "s lost",
             "requests")
    head.add_column("non-2xx", justify="right")
    lost = sum(r["seconds_lost"] for r in stats.get("reasons", {}).values())
    head.add_row(percent(t["hit_ratio"]), f"{t['prompt_tokens']:,}", f"{t['cached_tokens']:,}",
                 f"{t['seconds_saved']:.1f}", f"{lost:.1f}", f"{t['requests']:,}",
                 non_2xx(stats.get("statuses", {})))

    models = Table(title="models")
    _name(models, "model", list(stats["models"]), keep=True)
    _numbers(models, "hit\nratio", "requests", "s saved", "TTFT cached\np50/p95 ms",
             "TTFT cold\np50/p95 ms")
    for name, m in sorted(stats["models"].items()):
        c, k = m["ttft_ms"]["cached"], m["ttft_ms"]["cold"]
        models.add_row(name, percent(m["hit_ratio"]), f"{m['requests']:,}", f"{m['seconds_saved']:.1f}",
                       f"{_ms(c['p50'])} / {_ms(c['p95'])}", f"{_ms(k['p50'])} / {_ms(k['p95'])}")

    # Two lines a row (a backend over its models, its cache over its disk tier; a
    # decision's model over its team, route over cache reason, cached tokens over TTFT):
    # 100 columns hold them with long backend names whole.
    backends = Table(title="backends")
    rows = [(b["id"] + (" (suspect)" if b["suspect"] else "")
             + (f" ({b['mismatch']} mismatch)" if b.get("mismatch") else ""), b)
            for b in stats["backends"]]
    _name(backends, "backend\nmodels", [r[0] for r in rows], keep=True)
    _numbers(backends, "hit", "cache\ndisk", "hits\nram/disk", "queue\ninflight",
             "prefill\ntok/s")
    for name, b in rows:
        backends.add_row(f"{name}\n{', '.join(b['models'])}", percent(b["hit_ratio"]),
                         f"{format_bytes(b['cache_bytes'])}/{format_bytes(b['cache_budget'])}"
                         f"{_shared(b)}\n"
                         f"{_disk(b)}", f"{b.get('ram_hits', 0)}/{b.get('disk_hits', 0)}",
                         f"{b['queue_depth']}/{b['inflight']}", f"{b['prefill_tps']:.0f}")

    recent = Table(title="latest routing decisions")
    shown = stats["decisions"][:decisions]
    who = [f"{d['model']}\n{d.get('team') or ''}" for d in shown]
    why = [f"{d['reason']}\n{d.get('cache_reason') or '—'}"
           + (f" @{d['diverged_at']}" if d.get("diverged_at") is not None else "") for d in shown]
    recent.add_column("time", no_wrap=True)
    _name(recent, "model\nteam", [line for w in who for line in w.split("\n")])
    _name(recent, "backend", [d["backend"] for d in shown], keep=True)
    _name(recent, "route\ncache", [line for w in why for line in w.split("\n")], keep=True)
    _numbers(recent, "cached\nTTFT", "status")
    for d, model_team, route_cache in zip(shown, who, why):
        cached = "—" if d["cached_tokens"] is None else f"{d['cached_tokens']:,}"
        recent.add_row(f"{datetime.fromtimestamp(d['t']):%H:%M:%S}", model_team, d["backend"],
                       route_cache, f"{cached}\n{_ms(d['ttft_ms'])} ms", str(d["status"]))
    return Group(head, *reasons(stats), models, *teams(stats), *model_states(stats), backends,
                 recent)


def _shared(b: dict) -> str:
    """How many times over the backend's shared blocks serve (x1 is nothing shared)."""
    held, unshared = b.get("cache_bytes", 0), b.get("cache_bytes_unshared", 0)
    return f" x{unshared / held:.1f}" if held and unshared > held else ""


def non_2xx(statuses: dict) -> str:
    """Every request to the APIs that did not succeed, by status class."""
    bad = {k: n for k, n in sorted(statuses.items()) if k != "2xx" and n}
    if not bad:
        return "0"
    return f"{sum(bad.values()):,} (" + ", ".join(f"{k} {n:,}" for k, n in bad.items()) + ")"


def reasons(stats: dict) -> list:
    """Answered requests by cache reason: hit, or why the prompt missed."""
    rows = sorted(((r, m) for r, m in stats.get("reasons", {}).items() if m["requests"]),
                  key=lambda x: -x[1]["requests"])
    if not rows:
        return []
    total = sum(m["requests"] for _, m in rows)
    table = Table(title="cache reasons")
    _name(table, "reason", [r for r, _ in rows], keep=True)
    _numbers(table, "requests", "share", "lost tokens", "prefill s lost")
    for reason, m in rows:
        table.add_row(reason, f"{m['requests']:,}", percent(m["requests"] / total),
                      f"{m['lost_tokens']:,}", f"{m['seconds_lost']:.2f}")
    out: list = [table]
    for model, d in sorted(stats.get("drift", {}).items()):
        out.append(Text(f"template drift on {model}: tokens left the cached prefix at token "
                        f"{d['position'] if d['position'] is not None else '?'} ({d['count']}x, "
                        f"last on {d['backend']})", style="yellow"))
    return out


def teams(stats: dict) -> list[Table]:
    rows = []
    for team, t in sorted(stats.get("teams", {}).items()):
        models = sorted(t["models"].items()) or ([("—", t)] if t.get("limited") else [])
        # The team's refusals once, on its first row.
        rows += [(team, model, m, t.get("limited") or {} if i == 0 else {})
                 for i, (model, m) in enumerate(models)]
    if not rows:
        return []
    table = Table(title="teams")
    _name(table, "team", [r[0] for r in rows], keep=True)
    _name(table, "model", [r[1] for r in rows], keep=True)
    _numbers(table, "req", "prompt", "cached", "gen.", "hit", "saved s", "lost s")
    table.add_column("limited", overflow="fold")
    for team, model, m, limited in rows:
        table.add_row(team, model, f"{m['requests']:,}", f"{m['prompt_tokens']:,}",
                      f"{m['cached_tokens']:,}", f"{m['generated_tokens']:,}",
                      percent(m["hit_ratio"]), f"{m['seconds_saved']:.1f}",
                      f"{m['seconds_lost']:.1f}",
                      ", ".join(f"{k.replace('_', ' ')} {n}" for k, n in limited.items()) or "—")
    return [table]


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
        return "disk off"
    return f"{format_bytes(b['disk_bytes'])}/{format_bytes(b['disk_budget'])}"


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

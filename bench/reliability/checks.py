"""What must hold after load and after each fault: no error in the log, every batch
slot free, memory back to its level, Redis advertising what the stores hold."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from bench.reliability.deployment import MODEL, Deployment, rss_bytes
from kvroute.core.redis_keys import model_tag  # (the one place key names live)
from tests.harness import wait_until

MiB = 1 << 20


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def check_log(dep: Deployment, mark: int, what: str) -> Check:
    """No ERROR line or traceback in the children's logs since `mark`."""
    bad = [line.strip() for line in dep.log_since(mark).splitlines()
           if " ERROR " in line or "Traceback" in line]
    detail = "none" if not bad else f"{len(bad)}, e.g. {bad[:2]}"
    return Check(f"no ERROR/traceback in the logs ({what})", not bad, detail)


def busy_slots(dep: Deployment) -> dict[str, Any]:
    """Non-zero engine phases of each backend and in-flight counts of the proxy."""
    busy: dict[str, Any] = {}
    for b in dep.backends():
        e = b["health"]["engine"]
        phases = {k: e[k] for k in ("queued", "prefilling", "decoding") if e[k]}
        if phases:
            busy[b["id"]] = phases
        if b["inflight"]:
            busy[f"proxy->{b['id']}"] = {"inflight": b["inflight"]}
    return busy


def check_slots_free(dep: Deployment, timeout: float = 30.0) -> Check:
    t0 = time.monotonic()
    last: dict = {}

    def free():
        nonlocal last
        last = busy_slots(dep)
        return not last

    try:
        wait_until(free, timeout, interval=0.2, what="every batch slot to be free")
    except TimeoutError:
        return Check("batch slots free", False, f"still busy after {timeout:.0f}s: {last}")
    return Check("batch slots free", True,
                 f"all 0 (queued/prefilling/decoding, proxy in-flight) after {time.monotonic() - t0:.1f}s")


def measure_rss(dep: Deployment) -> dict[str, tuple[int, int]]:
    """name -> (pid, RSS bytes)."""
    return {name: (pid, rss_bytes(pid)) for name, pid in dep.pids().items()}


def rss_margin(warm: int) -> int:
    return max(int(warm * 0.10), 50 * MiB)


def check_rss(dep: Deployment, warm: dict[str, tuple[int, int]], timeout: float = 20.0) -> Check:
    last: dict[str, int] = {}

    def within():
        for name, (pid, base) in warm.items():
            last[name] = rss_bytes(pid)
        return all(last[n] <= base + rss_margin(base) for n, (_, base) in warm.items())

    try:
        wait_until(within, timeout, interval=0.5, what="RSS back near its warm level")
        ok = True
    except (TimeoutError, FileNotFoundError) as exc:
        ok = False
        if isinstance(exc, FileNotFoundError):
            return Check("RSS back to warm level", False, f"a process is gone: {exc}")
    detail = ", ".join(f"{n} {base / MiB:.0f}→{last[n] / MiB:.0f} MiB" for n, (_, base) in warm.items())
    return Check("RSS back to warm level", ok, detail + " (margin max(10%, 50 MiB))")


def registry_view(dep: Deployment) -> dict[str, dict]:
    """For each backend: the prefix keys its store's entries hold, and the keys Redis
    advertises for its current instance. The stores are read before and after Redis,
    so that a workload still running cannot make a consistent registry look wrong:
    a key counts as missing only if both reads hold it, as stale only if neither does."""
    import redis as redis_py

    def stores() -> dict[str, tuple[str, set[str], int, int]]:
        out = {}
        for b in dep.backends():
            h = b["health"]
            entries = dep.cache_entries(b["url"], h["pid"])
            out[b["id"]] = (f"{b['id']}|{h['instance_id']}", {k for e in entries for k in e["chain"]},
                            len(entries), h["cache"]["evictions"])
        return out

    tag = model_tag(MODEL)
    before = stores()
    r = redis_py.Redis.from_url(dep.redis.url, socket_timeout=5)
    try:
        names = [k.decode() for k in r.scan_iter(match=tag.replace("[", "\\[") + "k:*", count=1000)]
        pipe = r.pipeline(transaction=False)
        for name in names:
            pipe.smembers(name)
        members = dict(zip(names, pipe.execute()))
    finally:
        r.close()
    after = stores()
    out = {}
    for bid, (member, held, n_entries, evictions) in after.items():
        prev_member, prev_held = before.get(bid, ("", set(), 0, 0))[:2]
        held_before = prev_held if prev_member == member else held  # restarted in between
        advertised = {name[len(tag) + 2:] for name, m in members.items() if member.encode() in m}
        out[bid] = {"entries": n_entries, "held": held, "advertised": advertised,
                    "missing": (held & held_before) - advertised,
                    "stale": advertised - (held | held_before), "evictions": evictions}
    return out


def check_registry(dep: Deployment, timeout: float = 20.0) -> Check:
    last: dict = {}

    def consistent():
        nonlocal last
        last = registry_view(dep)
        return all(not v["missing"] and not v["stale"] for v in last.values())

    t0 = time.monotonic()
    try:
        wait_until(consistent, timeout, interval=0.5, what="Redis to match the backends' stores")
        ok = True
    except TimeoutError:
        ok = False
    parts = []
    for bid, v in sorted(last.items()):
        part = f"{bid}: {v['entries']} entries, {len(v['held'])} keys, {v['evictions']} evictions so far"
        if v["missing"] or v["stale"]:
            part += f" (missing in Redis {len(v['missing'])}, stale in Redis {len(v['stale'])})"
        parts.append(part)
    suffix = f" — equal after {time.monotonic() - t0:.1f}s" if ok else f" — differ after {timeout:.0f}s"
    return Check("Redis matches stores", ok, "; ".join(parts) + suffix)

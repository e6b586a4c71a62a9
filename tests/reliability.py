"""Reliability under load and faults, on the whole system as `kvroute serve` runs it.

Starts an external redis-server (so it can be restarted, stopped and paused) and
`kvroute serve` with a TOML config (2 replicas of the demo model), then:

1. Load: N concurrent streaming clients through the proxy (multi-turn chats and
   counting completions with modest max_tokens), one in five disconnecting at a
   random point (mostly mid-stream, some while still queued). A warm-up round of
   the same shape comes first. Afterwards it checks: no errors other than proper
   429s (OpenAI envelope + Retry-After; clients retry those), every batch slot free
   (each backend's engine and the proxy's in-flight counts back to 0), each
   process's RSS back within max(10%, 50 MiB) of its level after the warm-up, and
   the Redis advertisements equal to what each backend's store holds.
2. Faults, under a steady workload of multi-turn conversations at a fixed rate:
   SIGKILL of a backend (the launcher restarts it), SIGSTOP of a backend for longer
   than the heartbeat TTL then SIGCONT, Redis restarted empty, Redis unreachable
   (SIGSTOP) for a while. For each: requests, client-visible errors (apart: those
   in flight on the failed backend), the worst latency and the seconds until
   follow-up turns are routed as cache hits again.

The backends' /debug/cache needs the launcher's internal token: it is read from
the backend process's environment (KVROUTE_INTERNAL_TOKEN, read with psutil),
which the same user may read; nothing else is started outside `kvroute serve`.

    python -m bench.reliability [--quick | --soak SECONDS] [--markdown FILE]

This module lives in the test suite because tests/test_reliability.py runs its quick
variant with these same checks; bench/reliability.py is the command that runs it. It is
one long module because it is one procedure read top to bottom: the deployment, the
load, each fault, the checks after each, and the report of them all.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import platform
import random
import signal
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import psutil

from tests.harness import ServeProcess, get_json, request, wait_until

from kvroute.devtools.demo_model import DEMO_REPLY
from kvroute.serve.redis_server import RedisServer
from kvroute.core.redis_keys import model_tag  # (the one place key names live)

MODEL = "kvroute-demo"
SECRET = "reliability"
MiB = 1 << 20


# -- profiles ------------------------------------------------------------------------


@dataclass
class Profile:
    name: str
    clients: int = 200  # concurrent streaming clients of one load round
    warmup_clients: int = 200
    disconnect_share: float = 0.2
    load_rounds: int = 1
    soak_seconds: float = 0.0  # > 0: repeat load rounds until this much time has passed
    rate: float = 4.0  # requests/s of the steady workload
    conversations: int = 8
    baseline_s: float = 5.0  # steady workload before the first fault
    stop_s: float = 5.0  # SIGSTOP of a backend (> the 3 s heartbeat TTL)
    redis_pause_s: float = 10.0  # Redis unreachable
    recover_min_s: float = 8.0  # watch at least this long after a fault is lifted
    recover_max_s: float = 20.0  # ... and at most this long
    hits_to_recover: int = 8  # consecutive follow-up hits that count as "routing is back"
    long_streams: int = 2  # long counting streams in flight alongside the conversations
    # Small on purpose: the stores evict all the time, so withdrawals run under every fault.
    cache_bytes: str = "16MiB"


PROFILES = {
    "full": Profile("full", load_rounds=3, rate=6.0, conversations=12),
    # More clients than the two backends admit (2 x --max-queue 64), so 429s happen.
    "quick": Profile("quick", clients=160, warmup_clients=160, baseline_s=4.0, stop_s=5.0,
                     redis_pause_s=6.0, recover_min_s=3.0, recover_max_s=20.0, hits_to_recover=6),
}


def soak_profile(seconds: float) -> Profile:
    return Profile("soak", soak_seconds=seconds, load_rounds=3, rate=6.0, conversations=12,
                   stop_s=15.0, redis_pause_s=30.0, recover_max_s=40.0, hits_to_recover=12)


# -- the deployment ----------------------------------------------------------------------


class Deployment:
    """An external redis-server plus `kvroute serve` (2 demo backends and the proxy)."""

    def __init__(self, workdir: Path, cache_bytes: str = "64MiB", model_cache: str | None = None):
        self.workdir = Path(workdir)
        self.cache_bytes = cache_bytes
        self.model_cache = model_cache
        self.redis = RedisServer()
        self.serve: ServeProcess | None = None
        self._tokens: dict[int, str] = {}

    @property
    def url(self) -> str:
        return self.serve.url

    def start(self, timeout: float = 180.0) -> None:
        self.redis.start()
        env = {"PYTHONUNBUFFERED": "1"}
        if self.model_cache:
            env["KVROUTE_CACHE_DIR"] = str(self.model_cache)
        self.serve = ServeProcess(
            {"secret": SECRET, "redis": {"url": self.redis.url},
             "models": [{"path": "demo", "alias": MODEL, "replicas": 2,
                         "cache_bytes": self.cache_bytes}]},
            self.workdir, env=env)
        self.serve.wait_ready(
            lambda: len(get_json(self.url + "/health", timeout=2)["backends"]) == 2, timeout)

    def log_tail(self, n: int = 4000) -> str:
        return self.serve.log_tail(n) if self.serve else ""

    def log_mark(self) -> int:
        """A position in the serve log, for log_since()."""
        try:
            return self.serve.log_path.stat().st_size
        except OSError:
            return 0

    def log_since(self, mark: int) -> str:
        with open(self.serve.log_path, "rb") as f:
            f.seek(mark)
            return f.read().decode(errors="replace")

    def stop(self, timeout: float = 15.0) -> float | None:
        """SIGTERM to the launcher alone (its own shutdown is under test); returns how
        long it took to exit (None: it had to be killed)."""
        elapsed = self.serve.stop(timeout, group=False) if self.serve else None
        self.redis.close()
        return elapsed

    # -- what it runs ------------------------------------------------------------------

    def proxy_health(self) -> dict:
        return get_json(self.url + "/health", timeout=5)

    def backends(self) -> list[dict]:
        """[{id, url, ...}] as the proxy lists them, with each backend's own /health merged in."""
        out = []
        for b in self.proxy_health()["backends"]:
            out.append({**b, "health": get_json(b["url"] + "/health", timeout=5)})
        return out

    def backend_urls(self) -> dict[str, str]:
        return {b["id"]: b["url"] for b in self.proxy_health()["backends"]}

    def pids(self) -> dict[str, int]:
        pids = {b["id"]: b["health"]["pid"] for b in self.backends()}
        pids["proxy"] = self.proxy_health()["pid"]
        return pids

    def token(self, pid: int) -> str:
        """The launcher's internal token, from the backend's environment."""
        if pid not in self._tokens:
            token = psutil.Process(pid).environ().get("KVROUTE_INTERNAL_TOKEN")
            if not token:
                raise RuntimeError(f"no KVROUTE_INTERNAL_TOKEN in the environment of pid {pid}")
            self._tokens[pid] = token
        return self._tokens[pid]

    def cache_entries(self, url: str, pid: int) -> list[dict]:
        status, _, data = request(url + "/debug/cache", headers={"x-kvroute-token": self.token(pid)},
                                  timeout=10)
        if status != 200:
            raise RuntimeError(f"{url}/debug/cache answered {status}: {data[:200]!r}")
        return orjson.loads(data)["entries"]


def rss_bytes(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


# -- checks ---------------------------------------------------------------------------------


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


# -- load -----------------------------------------------------------------------------------


@dataclass
class LoadResult:
    clients: int = 0
    requests: int = 0
    ok: int = 0
    disconnects: int = 0  # intentional
    rejected_429: int = 0  # proper 429s (envelope + Retry-After), retried by the client
    gave_up_429: int = 0  # clients that got 429 on every attempt
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)  # x-kvroute-route-reason of answers

    def add_error(self, what: str) -> None:
        self.errors.append(what)


class _Disconnect(Exception):
    pass


async def _sse_events(resp: aiohttp.ClientResponse):
    async for line in resp.content:
        line = line.strip()
        if line.startswith(b"data: "):
            payload = line[6:]
            yield "[DONE]" if payload == b"[DONE]" else orjson.loads(payload)


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> aiohttp.ClientResponse:
    return await session.post(url, json=body)


async def _proper_429(resp: aiohttp.ClientResponse) -> float | None:
    """Retry-After seconds when `resp` is a proper 429, else None."""
    try:
        body = orjson.loads(await resp.read())
        ok = body["error"]["type"] == "rate_limit_error"
        retry = float(resp.headers["Retry-After"])
    except (KeyError, TypeError, ValueError, orjson.JSONDecodeError):
        return None
    return retry if ok and retry >= 1 else None


async def stream_once(session: aiohttp.ClientSession, url: str, body: dict, result: LoadResult,
                      disconnect_at: int | None, rng: random.Random, expect: str
                      ) -> tuple[str, dict | None]:
    """One streaming request, retried (at most 3 times) on a proper 429.

    disconnect_at: None to read to the end; -1 to give up before the response
    headers; k >= 0 to drop the connection after k events.
    Returns (outcome, summary) with outcome in ok, disconnect, 429, error.
    """
    for attempt in range(4):
        result.requests += 1
        t0 = time.perf_counter()
        if disconnect_at == -1:
            try:
                resp = await asyncio.wait_for(_post(session, url, body), rng.uniform(0.01, 0.3))
            except asyncio.TimeoutError:
                result.disconnects += 1
                return "disconnect", None
            resp.close()  # answered before we gave up: drop it anyway
            result.disconnects += 1
            return "disconnect", None
        try:
            async with session.post(url, json=body) as resp:
                if resp.status == 429:
                    retry = await _proper_429(resp)
                    if retry is None:
                        result.add_error(f"improper 429: {resp.headers.get('Retry-After')!r} "
                                         f"{(await resp.read())[:200]!r}")
                        return "error", None
                    result.rejected_429 += 1
                    await asyncio.sleep(min(retry, 2.0) * rng.uniform(0.3, 1.0))
                    continue
                if resp.status != 200:
                    result.add_error(f"status {resp.status}: {(await resp.read())[:200]!r}")
                    return "error", None
                reason = resp.headers.get("x-kvroute-route-reason", "?")
                result.reasons[reason] = result.reasons.get(reason, 0) + 1
                summary = {"text": "", "finish": None, "usage": None, "done": False,
                           "headers": dict(resp.headers)}
                n = 0
                async for event in _sse_events(resp):
                    if disconnect_at is not None and n >= disconnect_at:
                        resp.close()
                        raise _Disconnect
                    if event == "[DONE]":
                        summary["done"] = True
                        break
                    n += 1
                    if "error" in event:
                        result.add_error(f"error event: {event['error'].get('message')}")
                        return "error", None
                    if event.get("usage"):
                        summary["usage"] = event["usage"]
                    for c in event.get("choices") or []:
                        if n == 1:
                            result.ttft.append(time.perf_counter() - t0)
                        summary["text"] += (c.get("delta") or {}).get("content") or c.get("text") or ""
                        summary["finish"] = c.get("finish_reason") or summary["finish"]
                if disconnect_at is not None:  # the stream ended before the chosen point
                    result.disconnects += 1
                    return "disconnect", None
                problem = _validate(summary, expect)
                if problem:
                    result.add_error(problem)
                    return "error", None
                result.ok += 1
                return "ok", summary
        except _Disconnect:
            result.disconnects += 1
            return "disconnect", None
        except (aiohttp.ClientError, asyncio.TimeoutError, orjson.JSONDecodeError) as exc:
            result.add_error(f"{type(exc).__name__}: {exc}")
            return "error", None
    result.gave_up_429 += 1
    return "429", None


def _validate(s: dict, expect: str) -> str | None:
    if not s["done"]:
        return "stream ended without [DONE]"
    if expect == "chat":
        if s["text"] != DEMO_REPLY or s["finish"] != "stop":
            return f"wrong chat reply {s['text']!r} ({s['finish']})"
    elif not (s["text"].isdigit() and s["finish"] == "length"):
        return f"wrong completion {s['text'][:60]!r} ({s['finish']})"
    if s["usage"] is None:
        return "no usage chunk"
    return None


SYSTEM = "You are a careful assistant for a team of engineers; answer briefly. "


async def load_client(session: aiohttp.ClientSession, base: str, i: int, run: str,
                      result: LoadResult, rng: random.Random, disconnect: bool) -> None:
    await asyncio.sleep(rng.uniform(0, 0.5))
    turns = rng.randint(2, 3) if i % 2 == 0 else 1
    # Which request of the client drops, and where: mostly mid-stream, sometimes queued.
    drop_turn = rng.randrange(turns) if disconnect else None
    if i % 2 == 0:
        # Groups of clients share a system prompt (bursts on a new shared prefix).
        messages = [{"role": "system", "content": f"{run}-group{i % 8}: " + SYSTEM * 3},
                    {"role": "user", "content": f"Hello from client {i}."}]
        for turn in range(turns):
            point = None
            if turn == drop_turn:
                point = -1 if rng.random() < 0.25 else rng.randrange(0, 16)
            body = {"model": MODEL, "messages": messages, "stream": True, "max_tokens": 32,
                    "stream_options": {"include_usage": True}}
            outcome, summary = await stream_once(session, base + "/v1/chat/completions", body,
                                                 result, point, rng, "chat")
            if outcome != "ok":
                return
            messages = messages + [{"role": "assistant", "content": summary["text"]},
                                   {"role": "user", "content": f"And then ({turn})?"}]
    else:
        max_tokens = rng.randint(8, 48)
        point = None
        if disconnect:
            point = -1 if rng.random() < 0.25 else rng.randrange(0, max_tokens)
        body = {"model": MODEL, "prompt": f"{run} client {i} counts 1 2 3", "stream": True,
                "max_tokens": max_tokens, "stream_options": {"include_usage": True}}
        await stream_once(session, base + "/v1/completions", body, result, point, rng, "completion")


async def run_load_async(base: str, clients: int, disconnect_share: float = 0.2, seed: int = 0,
                         timeout: float = 180.0) -> LoadResult:
    rng = random.Random(seed)
    run = uuid.uuid4().hex[:8]
    result = LoadResult(clients=clients)
    droppers = set(rng.sample(range(clients), round(clients * disconnect_share)))
    t0 = time.perf_counter()
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
        tasks = [asyncio.create_task(load_client(s, base, i, run, result,
                                                 random.Random(rng.random()), i in droppers))
                 for i in range(clients)]
        done, pending = await asyncio.wait(tasks, timeout=timeout)
        for t in pending:
            t.cancel()
            result.add_error("client did not finish within the load deadline")
        for t in done:
            if t.exception() is not None:
                result.add_error(f"client crashed: {t.exception()!r}")
    result.seconds = time.perf_counter() - t0
    return result


def run_load(base: str, clients: int, disconnect_share: float = 0.2, seed: int = 0) -> LoadResult:
    return asyncio.run(run_load_async(base, clients, disconnect_share, seed))


def load_checks(result: LoadResult) -> list[Check]:
    errs = result.errors
    detail = (f"{result.ok} ok, {result.disconnects} intentional disconnects, "
              f"{result.rejected_429} proper 429s (retried), {result.gave_up_429} gave up after 429s")
    if errs:
        detail += f"; {len(errs)} errors, e.g. {errs[:3]}"
    return [Check(f"{result.clients} clients: errors other than 429", not errs, detail)]


# -- steady workload and faults -----------------------------------------------------------------


@dataclass
class Outcome:
    conv: int
    turn: int
    start: float  # time.monotonic()
    end: float = 0.0
    ok: bool = False
    error: str = ""
    backend: str = ""
    reason: str = ""
    prompt: int = 0
    cached: int = 0
    prev_prompt: int | None = None  # prompt tokens of the previous turn (follow-ups only)
    kind: str = "turn"  # a conversation's turn, or a "long" counting stream

    @property
    def follow_up(self) -> bool:
        return self.prev_prompt is not None

    @property
    def hit(self) -> bool:
        return (self.ok and self.reason == "cache-hit"
                and self.cached >= (self.prev_prompt or 0) - 3)


@dataclass
class _Conversation:
    id: int
    messages: list = field(default_factory=list)
    turn: int = 0
    prev_prompt: int | None = None
    busy: bool = False

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": f"{uuid.uuid4().hex} " + SYSTEM * 2},
                         {"role": "user", "content": "Hello there."}]
        self.turn, self.prev_prompt = 0, None


class SteadyWorkload:
    """Multi-turn conversations at a fixed request rate, plus a few long counting
    streams back to back (so that some stream is in flight on whichever backend a
    fault hits), in a thread of its own: blocking fault injection in the caller's
    thread never stalls it."""

    def __init__(self, base: str, rate: float = 4.0, conversations: int = 8, max_turns: int = 10,
                 long_streams: int = 2, long_tokens: int = 1500, timeout: float = 60.0):
        self.base = base
        self.rate = rate
        self.max_turns = max_turns
        self.long_streams = long_streams
        self.long_tokens = long_tokens
        self.timeout = timeout
        self.convs = [_Conversation(i) for i in range(conversations)]
        for c in self.convs:
            c.reset()
        self.outcomes: list[Outcome] = []
        self.skipped = 0  # ticks when every conversation was busy
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True,
                                        name="steady-workload")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.timeout + 10)

    def snapshot(self) -> list[Outcome]:
        return list(self.outcomes)

    async def _main(self) -> None:
        tasks: set[asyncio.Task] = set()
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as session:
            longs = [asyncio.create_task(self._long(session, i)) for i in range(self.long_streams)]
            next_at = time.monotonic()
            i = 0
            while not self._stop.is_set():
                idle = [c for c in self.convs if not c.busy]
                if idle:
                    conv = idle[i % len(idle)]
                    i += 1
                    conv.busy = True
                    t = asyncio.create_task(self._turn(session, conv))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
                else:
                    self.skipped += 1
                next_at += 1.0 / self.rate
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            await asyncio.wait([*tasks, *longs], timeout=self.timeout)

    async def _exchange(self, session: aiohttp.ClientSession, path: str, body: dict,
                        out: Outcome) -> tuple[str, dict | None, str | None]:
        """One streaming request; fills out.backend/reason/error/end. Returns (text, usage, finish)."""
        text, usage, finish, done = "", None, None, False

        async def exchange() -> None:
            nonlocal text, usage, finish, done
            async with session.post(self.base + path, json=body) as resp:
                out.backend = resp.headers.get("x-kvroute-backend", "")
                out.reason = resp.headers.get("x-kvroute-route-reason", "")
                if resp.status != 200:
                    out.error = f"status {resp.status}: {(await resp.read())[:200]!r}"
                    return
                async for event in _sse_events(resp):
                    if event == "[DONE]":
                        done = True
                        return
                    if "error" in event:
                        out.error = f"error event: {event['error'].get('message')}"
                        return
                    if event.get("usage"):
                        usage = event["usage"]
                    for c in event.get("choices") or []:
                        text += (c.get("delta") or {}).get("content") or c.get("text") or ""
                        finish = c.get("finish_reason") or finish

        try:
            await asyncio.wait_for(exchange(), self.timeout)
        except asyncio.TimeoutError:
            out.error = f"no complete answer within {self.timeout:.0f}s"
        except (aiohttp.ClientError, orjson.JSONDecodeError) as exc:
            out.error = f"{type(exc).__name__}: {exc}"
        out.end = time.monotonic()
        if not out.error and not (done and usage):
            out.error = f"incomplete answer: done={done} usage={usage is not None}"
        return text, usage, finish

    async def _turn(self, session: aiohttp.ClientSession, conv: _Conversation) -> None:
        out = Outcome(conv.id, conv.turn, time.monotonic(), prev_prompt=conv.prev_prompt)
        self.outcomes.append(out)
        body = {"model": MODEL, "messages": conv.messages, "stream": True, "max_tokens": 32,
                "stream_options": {"include_usage": True}}
        text, usage, _ = await self._exchange(session, "/v1/chat/completions", body, out)
        if not out.error and text != DEMO_REPLY:
            out.error = f"wrong reply {text[:40]!r}"
        if out.error:
            conv.reset()
        else:
            out.ok = True
            out.prompt = usage["prompt_tokens"]
            out.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            conv.turn += 1
            conv.prev_prompt = out.prompt
            conv.messages = conv.messages + [{"role": "assistant", "content": text},
                                             {"role": "user", "content": f"Tell me more ({conv.turn})."}]
            if conv.turn >= self.max_turns:
                conv.reset()
        conv.busy = False

    async def _long(self, session: aiohttp.ClientSession, slot: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            out = Outcome(-1 - slot, n, time.monotonic(), kind="long")
            self.outcomes.append(out)
            body = {"model": MODEL, "prompt": f"{uuid.uuid4().hex} long stream counts 1 2 3",
                    "stream": True, "max_tokens": self.long_tokens,
                    "stream_options": {"include_usage": True}}
            text, _, finish = await self._exchange(session, "/v1/completions", body, out)
            if not out.error and not (text.isdigit() and finish == "length"):
                out.error = f"wrong completion {text[:40]!r} ({finish})"
            out.ok = not out.error
            if out.error:
                await asyncio.sleep(0.2)


def recovery_point(outcomes: list[Outcome], since: float, k: int) -> float | None:
    """Start time of the first follow-up turn (started at or after `since`) from which
    every later follow-up turn is a cache hit, provided there are at least k of them."""
    follow = sorted((o for o in outcomes if o.follow_up and o.start >= since and o.end),
                    key=lambda o: o.start)
    streak = 0
    first = None
    for o in follow:
        if o.hit:
            streak += 1
            first = o.start if streak == 1 else first
        else:
            streak, first = 0, None
    return first if streak >= k else None


@dataclass
class FaultResult:
    name: str
    victim: str = ""
    window_s: float = 0.0  # how long the fault itself lasted
    requests: int = 0  # started from injection until recovery (or the watch's end)
    errors: list[str] = field(default_factory=list)  # requests that had not reached the failed backend
    victim_errors: int = 0  # requests in flight on the killed/stopped backend
    max_latency_s: float = 0.0
    recovery_s: float | None = None  # after the fault was lifted
    registry: Check | None = None  # Redis back in line with the stores afterwards
    note: str = ""
    reasons: dict[str, int] = field(default_factory=dict)  # route reasons of the window's answers
    t_inject: float = 0.0  # time.monotonic() of the injection and of the lift
    t_lift: float = 0.0


def _busiest_backend(outcomes: list[Outcome], since: float) -> str:
    counts: dict[str, int] = {}
    for o in outcomes:
        if o.ok and o.start >= since and o.follow_up:
            counts[o.backend] = counts.get(o.backend, 0) + 1
    return max(counts, key=counts.get) if counts else ""


def inject(name: str, dep: Deployment, wl: SteadyWorkload, profile: Profile) -> FaultResult:
    """Inject one fault under the running workload, watch the recovery, summarize."""
    res = FaultResult(name)
    before = wl.snapshot()
    urls = dep.backend_urls()
    victim = _busiest_backend(before, time.monotonic() - 5) or sorted(urls)[0]
    note = ""
    t_inject = time.monotonic()
    if name == "SIGKILL backend":
        res.victim = victim
        pid = get_json(urls[victim] + "/health", timeout=5)["pid"]
        t_inject = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        t_lift = time.monotonic()

        def restarted():
            h = get_json(urls[victim] + "/health", timeout=2)
            return h["pid"] != pid and victim in dep.backend_urls() and h

        wait_until(restarted, 60, interval=0.2, what="the launcher to restart the backend")
        note = f"restarted and listed again after {time.monotonic() - t_inject:.1f}s"
    elif name == "SIGSTOP backend":
        res.victim = victim
        pid = get_json(urls[victim] + "/health", timeout=5)["pid"]
        t_inject = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(profile.stop_s)
        finally:
            os.kill(pid, signal.SIGCONT)
        t_lift = time.monotonic()
        note = f"stopped {profile.stop_s:.0f}s (heartbeat TTL 3s)"
    elif name == "Redis restarted empty":
        t_inject = time.monotonic()
        dep.redis.restart()
        t_lift = time.monotonic()
    elif name == "Redis unreachable":
        t_inject = time.monotonic()
        dep.redis.pause()
        try:
            time.sleep(profile.redis_pause_s)
        finally:
            dep.redis.resume()
        t_lift = time.monotonic()
        note = f"SIGSTOP of redis-server for {profile.redis_pause_s:.0f}s"
    else:
        raise ValueError(name)
    res.window_s = t_lift - t_inject
    res.t_inject, res.t_lift = t_inject, t_lift

    # Watch until routing is back to cache hits (and stays so for k follow-ups).
    deadline = t_lift + profile.recover_max_s
    point = None
    while time.monotonic() < deadline:
        point = recovery_point(wl.snapshot(), t_lift, profile.hits_to_recover)
        if point is not None and time.monotonic() >= t_lift + profile.recover_min_s:
            break
        time.sleep(0.25)
    end = time.monotonic()
    # Let requests started in the window finish before judging them.
    wait_until(lambda: all(o.end for o in wl.snapshot() if o.start <= end), 70, interval=0.1,
               what="requests of the fault window to finish")
    window = [o for o in wl.snapshot() if t_inject - 0.001 <= o.start <= end
              or (o.start < t_inject and o.end >= t_inject)]
    res.requests = sum(1 for o in window if o.start >= t_inject)
    for o in window:
        if o.start >= t_inject and o.reason:
            res.reasons[o.reason] = res.reasons.get(o.reason, 0) + 1
    res.max_latency_s = max((o.end - o.start for o in window if o.kind == "turn"), default=0.0)
    for o in window:
        if o.ok:
            continue
        if res.victim and o.backend == res.victim and o.start <= t_lift:
            res.victim_errors += 1
        else:
            res.errors.append(f"turn {o.turn} via {o.backend or '?'} ({o.reason or '-'}): {o.error}")
    res.recovery_s = None if point is None else max(0.0, point - t_lift)
    res.note = note
    res.registry = check_registry(dep, timeout=10.0)
    return res


FAULTS = ("SIGKILL backend", "SIGSTOP backend", "Redis restarted empty", "Redis unreachable")


def run_faults(dep: Deployment, profile: Profile, log=print) -> tuple[list[FaultResult], SteadyWorkload]:
    wl = SteadyWorkload(dep.url, rate=profile.rate, conversations=profile.conversations,
                        long_streams=profile.long_streams)
    wl.start()
    results = []
    try:
        time.sleep(profile.baseline_s)
        for name in FAULTS:
            log(f"fault: {name} ...")
            res = inject(name, dep, wl, profile)
            log(f"  {res.requests} requests, {len(res.errors)} errors, "
                f"{res.victim_errors} on the failed backend, recovery {res.recovery_s}, "
                f"registry: {res.registry.detail}")
            results.append(res)
    finally:
        wl.stop()
    return results, wl


# -- the whole run ----------------------------------------------------------------------------


@dataclass
class Report:
    profile: Profile
    load: list[LoadResult] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    faults: list[FaultResult] = field(default_factory=list)
    workload_requests: int = 0
    workload_errors: int = 0
    shutdown_s: float | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return (all(c.ok for c in self.checks)
                and all(not f.errors and f.recovery_s is not None and f.registry.ok
                        for f in self.faults))


def load_phase(dep: Deployment, profile: Profile, report: Report, t0: float, log=print) -> None:
    """Warm-up, then load rounds, each followed by the checks."""
    log(f"warm-up: {profile.warmup_clients} clients ...")
    warm = run_load(dep.url, profile.warmup_clients, profile.disconnect_share, seed=1)
    if warm.errors:
        report.checks.append(Check("warm-up errors", False, str(warm.errors[:3])))
    slots = check_slots_free(dep)
    slots.name = "after the warm-up: " + slots.name
    report.checks.append(slots)
    warm_rss = measure_rss(dep)
    rounds = 0
    while True:
        rounds += 1
        log(f"load round {rounds}: {profile.clients} clients ...")
        mark = dep.log_mark()
        res = run_load(dep.url, profile.clients, profile.disconnect_share, seed=100 + rounds)
        report.load.append(res)
        round_checks = load_checks(res) + [check_slots_free(dep), check_rss(dep, warm_rss),
                                           check_registry(dep), check_log(dep, mark, "load")]
        for c in round_checks:
            c.name = f"round {rounds}: {c.name}"
            log(f"  {'ok ' if c.ok else 'FAIL'} {c.name}: {c.detail}")
        report.checks.extend(round_checks)
        if rounds >= profile.load_rounds and (time.monotonic() - t0 >= profile.soak_seconds
                                              or rounds >= 1000):
            return


def run(profile: Profile, workdir: Path | None = None, model_cache: str | None = None,
        log=print) -> Report:
    t0 = time.monotonic()
    report = Report(profile)
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvroute-rel-")))
        dep = Deployment(workdir, profile.cache_bytes, model_cache)
        try:
            log("starting kvroute serve ...")
            dep.start()
            if profile.clients:
                load_phase(dep, profile, report, t0, log)
            results, wl = run_faults(dep, profile, log)
            report.faults = results
            outs = wl.snapshot()
            with open(dep.workdir / "outcomes.jsonl", "wb") as f:
                for o in outs:
                    f.write(orjson.dumps(o) + b"\n")
                for r in results:
                    f.write(orjson.dumps({"fault": r.name, "t_inject": r.t_inject, "t_lift": r.t_lift})
                            + b"\n")
            report.workload_requests = len(outs)
            report.workload_errors = sum(1 for o in outs if not o.ok)
            after = [check_slots_free(dep), check_registry(dep)]
            for c in after:
                c.name = f"after the faults: {c.name}"
            report.checks.extend(after)
        finally:
            report.shutdown_s = dep.stop()
            if report.shutdown_s is None or report.shutdown_s >= 10:
                report.checks.append(Check("clean shutdown < 10 s", False,
                                           f"took {report.shutdown_s}\n{dep.log_tail(2000)}"))
            else:
                report.checks.append(Check("clean shutdown < 10 s", True, f"{report.shutdown_s:.1f}s"))
    report.seconds = time.monotonic() - t0
    return report


# -- output -------------------------------------------------------------------------------------


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def tables(report: Report) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) for the load checks, the load rounds and the faults."""
    out = []
    rows = []
    for r in report.load:
        rows.append([str(r.clients), str(r.requests), str(r.ok), str(r.disconnects),
                     str(r.rejected_429), str(len(r.errors)), f"{_pct(r.ttft, 0.5) * 1000:.0f}",
                     f"{_pct(r.ttft, 0.99) * 1000:.0f}", f"{r.seconds:.1f}",
                     ", ".join(f"{k} {v}" for k, v in sorted(r.reasons.items()))])
    out.append(("Load: streaming clients through one proxy to two backends",
                ["clients", "requests", "ok", "disconnects (1 in 5 clients)", "429 (retried)",
                 "errors", "TTFT p50 ms", "TTFT p99 ms", "seconds", "route reasons"], rows))
    out.append(("Checks", ["check", "result", "detail"],
                [[c.name, "ok" if c.ok else "FAIL", c.detail] for c in report.checks]))
    rows = []
    for f in report.faults:
        rows.append([f.name + (f" ({f.victim})" if f.victim else ""), f"{f.window_s:.1f}",
                     str(f.requests), str(len(f.errors)), str(f.victim_errors),
                     f"{f.max_latency_s:.1f}",
                     "not within the watch" if f.recovery_s is None else f"{f.recovery_s:.1f}",
                     ", ".join(f"{k} {v}" for k, v in sorted(f.reasons.items())),
                     _registry_cell(f.registry), f.note])
    p = report.profile
    out.append((f"Faults under a steady workload ({p.rate:g} req/s, {p.conversations} conversations, "
                f"streaming)",
                ["fault", "fault lasted s", "requests", "client errors", "errors in flight on failed backend",
                 "max turn latency s", "back to cache hits s", "route reasons", "Redis = stores",
                 "note"], rows))
    return out


def _registry_cell(check: Check | None) -> str:
    if check is None:
        return ""
    if check.ok:
        return "yes" + check.detail[check.detail.rindex(" after"):].replace(" after", ", after")
    return "NO: " + check.detail


def print_report(report: Report, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    for title, header, rows in tables(report):
        table = Table(title=title)
        for col in header:
            table.add_column(col)
        for row in rows:
            table.add_row(*row)
        console.print(table)
    console.print(f"total {report.seconds:.0f}s; verdict: {'PASS' if report.ok else 'FAIL'}")


def markdown(report: Report, command: str) -> str:
    lines = [f"```\n{command}\n```", "",
             f"Machine: {platform.machine()} {platform.system()}, {os.cpu_count()} cores, "
             f"Python {platform.python_version()}; profile `{report.profile.name}`, "
             f"{report.seconds:.0f} s in total; verdict **{'PASS' if report.ok else 'FAIL'}**.", ""]
    for title, header, rows in tables(report):
        lines += [f"**{title}**", "", "| " + " | ".join(header) + " |",
                  "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(cell.replace("|", "\\|").replace("\n", " ") for cell in row) + " |"
                  for row in rows]
        lines.append("")
    errors = [e for f in report.faults for e in f.errors]
    if errors:
        lines += ["Client errors:", ""] + [f"- {e}" for e in errors[:20]] + [""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="the CI variant (~60-90 s)")
    group.add_argument("--soak", type=float, metavar="SECONDS",
                       help="repeat load rounds for this long, with longer fault windows")
    ap.add_argument("--clients", type=int, help="clients per load round (default 200; --quick 60)")
    ap.add_argument("--markdown", metavar="FILE", help="also write the tables as markdown")
    ap.add_argument("--workdir", help="keep logs here (default: a temporary directory)")
    ap.add_argument("--faults-only", action="store_true", help="skip the load rounds (debugging)")
    args = ap.parse_args()
    profile = soak_profile(args.soak) if args.soak else PROFILES["quick" if args.quick else "full"]
    profile = dataclasses.replace(profile)  # a copy: the flags below change it
    if args.clients:
        profile.clients = profile.warmup_clients = args.clients
    if args.faults_only:
        profile.load_rounds = profile.clients = profile.warmup_clients = 0
    from rich.console import Console

    console = Console()
    workdir = Path(args.workdir) if args.workdir else None
    if workdir:
        workdir.mkdir(parents=True, exist_ok=True)
    report = run(profile, workdir, log=lambda m: console.print(m, highlight=False))
    print_report(report, console)
    if args.markdown:
        command = "python -m bench.reliability " + " ".join(sys.argv[1:])
        Path(args.markdown).write_text(markdown(report, command.strip()) + "\n")
    return 0 if report.ok else 1

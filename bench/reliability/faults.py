"""Faults under a steady workload of multi-turn conversations: what each does to the
requests in flight and how long routing takes to find the caches again."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field

import aiohttp
import orjson

from bench.reliability.checks import Check, check_registry
from bench.reliability.deployment import MODEL, Deployment
from bench.reliability.load import SYSTEM, sse_events
from bench.reliability.profiles import Profile
from kvroute.devtools.demo_model import DEMO_REPLY
from tests.harness import get_json, wait_until


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
                async for event in sse_events(resp):
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

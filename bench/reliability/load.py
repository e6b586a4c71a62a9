"""Load: concurrent streaming clients through the proxy, one in five disconnecting at a
random point; proper 429s retried."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import dataclass, field

import aiohttp
import orjson

from bench.reliability.checks import Check
from bench.reliability.deployment import MODEL
from kvroute.devtools.demo_model import DEMO_REPLY


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


async def sse_events(resp: aiohttp.ClientResponse):
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
                async for event in sse_events(resp):
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

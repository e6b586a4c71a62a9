"""Forwarding one routed request: the request as the routing built it (`RoutedRequest`),
the upstream call, the relay of its answer, and the errors that let the router fail
over to the next backend (`Retry`).

The body passes through unchanged and the answer's bytes are relayed as they arrive.
A client disconnect cancels the handler, which closes the upstream connection, which
makes the backend stop decoding (docs/DESIGN.md invariants 2 and 7).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass, field

import aiohttp
import orjson
from aiohttp import web

from kvroute.api.errors import APIError, overloaded
from kvroute.api.http import SSE_HEADERS
from kvroute.core.hits import is_cache_hit

from . import loading
from .agents.gateway import Relay
from .fleet import Backend, watch_of
from .policy.interface import Decision
from .state import State

log = logging.getLogger("kvroute.proxy")

RETRYABLE_STATUS = {502, 503, 504}


@dataclass
class RoutedRequest:
    """One request on its way to a backend: built once by the routing (routing.py) from
    the client's request, read by every step after it (chain, choice, forward, relay)."""

    request: web.Request  # the client's
    raw: bytes  # the body as forwarded: the client's own bytes, or the agent API's chat body
    body: dict  # the same, parsed
    model: str
    path: str  # the backend path it goes to
    scope: str | None  # the API key's cache scope (proxy/auth.py)
    t_start: float  # time.perf_counter() when it arrived: the proxy's overhead counts from it
    relay: Relay | None = None  # an agent API's translation of the answer; None: relayed as is
    keys: list[int] = field(default_factory=list)  # its prefix chain
    ends: list[int] = field(default_factory=list)  # byte offset where each chain block ends

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True

    @property
    def request_bytes(self) -> int:
        """Its size as the policy weighs it: the chain's canonical bytes."""
        return self.ends[-1] if self.ends else len(self.raw)

    def error_event(self, err: APIError) -> bytes:
        """How the client's API ends a stream that began before the error (while its
        model loaded): its own error event."""
        return self.relay.held_error(err) if self.relay is not None else chat_error_event(err)


def chat_error_event(err: APIError) -> bytes:
    """The end of a chat or completion stream that failed after its 200: the error
    envelope as a chunk, then [DONE]."""
    return b"data: " + orjson.dumps(err.body()) + b"\n\ndata: [DONE]\n\n"


class Retry(Exception):
    def __init__(self, error: APIError, failover: bool):
        self.error, self.failover = error, failover


def upstream_headers(state: State, scope: str | None) -> dict:
    headers = {"Content-Type": "application/json"}
    if state.config.internal_token:
        headers["x-kvroute-token"] = state.config.internal_token
    if scope:
        headers["x-kvroute-scope"] = scope
    return headers


def route_headers(decision: Decision) -> dict:
    return {
        "x-kvroute-backend": decision.candidate.backend_id,
        "x-kvroute-prefix-blocks": str(decision.candidate.depth),
        "x-kvroute-route-reason": decision.reason,
    }


async def forward(state: State, req: RoutedRequest, decision: Decision,
                  b: Backend) -> web.StreamResponse:
    """Send `req` to the chosen backend `b` and relay its answer; raises Retry when the
    router may try another backend (nothing reached the client yet)."""
    c = decision.candidate
    bid = c.backend_id
    prefill = decision.prefill_tokens
    b.inflight += 1
    b.unanswered_tokens += prefill
    state.metrics.child(state.metrics.inflight, bid).set(b.inflight)
    answered = False
    upstream = None
    # A stopped or hung backend keeps its connections open and says nothing: without
    # this watch a request would wait for --request-timeout. One watch per backend,
    # shared by all its requests: a task per request cost a third of peak throughput.
    watchdog = watch_of(state, b)
    abandon = None
    try:
        try:
            # A task, so the watch can cancel it; cancelling this handler (client gone)
            # cancels it too, as it is being awaited.
            post = asyncio.ensure_future(state.session.post(
                c.url + req.path, data=req.raw, headers=upstream_headers(state, req.scope)))
            stop_waiting = functools.partial(_stop_waiting, post=post)
            watchdog.add_done_callback(stop_waiting)
            try:
                upstream = await post
            except asyncio.CancelledError:
                if not (watchdog.done() and not watchdog.cancelled()):
                    raise
                raise Retry(APIError(502, f"Backend {bid} stopped answering (no heartbeat, "
                                      "no health).", "server_error", None, "backend_unresponsive"),
                             failover=True) from None
            finally:
                watchdog.remove_done_callback(stop_waiting)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
            raise Retry(APIError(502, f"Backend {bid} is unreachable: {exc or type(exc).__name__}.",
                                  "server_error", None, "backend_unreachable"), failover=True)
        # From here on the watch ends a silent upstream by closing it: a stream then
        # ends with an error event, a whole answer is retried elsewhere.
        abandon = functools.partial(_abandon, upstream=upstream, bid=bid)
        watchdog.add_done_callback(abandon)
        b.unanswered_tokens = max(0.0, b.unanswered_tokens - prefill)
        answered = True
        if upstream.status in RETRYABLE_STATUS:
            raise Retry(APIError(upstream.status, f"Backend {bid} answered {upstream.status}.",
                                  "server_error", None, "backend_unavailable"), failover=True)
        if upstream.status == 429:
            retry_after = float(upstream.headers.get("Retry-After", "1") or 1)
            raise Retry(overloaded("Every backend serving this model is at capacity.",
                                    retry_after), failover=False)
        record_decision(state, req.model, decision, upstream)
        record_stats(state, req.model, decision, b, upstream)
        headers = route_headers(decision)
        for name in ("x-kvroute-cached-tokens", "x-kvroute-prompt-tokens", "Retry-After"):
            if name in upstream.headers:
                headers[name] = upstream.headers[name]
        ctype = upstream.headers.get("Content-Type", "application/json")
        state.metrics.child(state.metrics.requests, req.model, bid, str(upstream.status)).inc()
        if ctype.startswith("text/event-stream"):
            if req.relay is not None:
                return await req.relay.stream(req.request, upstream, headers, bid)
            return await relay_stream(req.request, upstream, headers, bid)
        try:
            data = await upstream.read()
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
            # Nothing reached the client yet: retry it elsewhere.
            raise Retry(APIError(502, f"Backend {bid} failed while answering: {exc}.",
                                  "server_error", None, "backend_failed"), failover=True)
        if req.relay is not None:
            return await req.relay.whole(upstream.status, data, headers)
        return web.Response(body=data, status=upstream.status, headers=headers,
                            content_type=ctype.split(";")[0])
    finally:
        if abandon is not None:
            watchdog.remove_done_callback(abandon)
        if not answered:
            b.unanswered_tokens = max(0.0, b.unanswered_tokens - prefill)
        b.inflight = max(0, b.inflight - 1)
        state.metrics.child(state.metrics.inflight, bid).set(b.inflight)
        if upstream is not None:
            release(upstream)



def release(upstream: aiohttp.ClientResponse) -> None:
    """An answer read to its end leaves its connection clean: back to the pool (a new
    connection per request cost about a tenth of the proxy's CPU). Any other end
    closes it: on a client disconnect the backend must see its connection drop so
    that it stops decoding."""
    if upstream.content.at_eof() and not upstream.closed:
        upstream.release()
    else:
        upstream.close()


def _stop_waiting(watch: asyncio.Future, *, post: asyncio.Future) -> None:
    if not watch.cancelled():
        post.cancel()


def _abandon(watch: asyncio.Future, *, upstream, bid: str) -> None:
    if not watch.cancelled():
        log.warning("backend %s stopped answering (no heartbeat, no health); abandoning its answer", bid)
        upstream.close()


def record_decision(state: State, model: str, decision: Decision, upstream) -> None:
    m = state.metrics
    bid = decision.candidate.backend_id
    m.child(m.decisions, model, bid, decision.reason).inc()
    m.child(m.predicted_tokens, model, bid).inc(decision.predicted_tokens)
    cached = upstream.headers.get("x-kvroute-cached-tokens")
    prompt = upstream.headers.get("x-kvroute-prompt-tokens")
    if cached and cached.isdigit():
        m.child(m.actual_tokens, model, bid).inc(int(cached))
    if prompt and prompt.isdigit():
        m.child(m.prompt_tokens, model, bid).inc(int(prompt))


def _header_int(upstream, name: str) -> int | None:
    value = upstream.headers.get(name, "")
    return int(value) if value.isdigit() else None


def record_stats(state: State, model: str, decision: Decision, b: Backend, upstream) -> None:
    c = decision.candidate
    cached = _header_int(upstream, "x-kvroute-cached-tokens")
    try:
        ttft_ms = float(upstream.headers["x-kvroute-ttft-ms"])
    except (KeyError, ValueError):
        ttft_ms = None
    tps = b.record.prefill_tps or c.load.prefill_tps
    state.stats.record(
        model=model, backend=c.backend_id, reason=decision.reason, prefix_blocks=c.depth,
        predicted_tokens=decision.predicted_tokens, status=upstream.status,
        prompt_tokens=_header_int(upstream, "x-kvroute-prompt-tokens"), cached_tokens=cached,
        ttft_ms=ttft_ms, prefill_tps=tps,
    )
    m = state.metrics
    if cached and tps > 0:
        m.child(m.seconds_saved, model, c.backend_id).inc(cached / tps)
    if ttft_ms is not None and upstream.status < 400:
        hit = is_cache_hit(cached or 0, _header_int(upstream, "x-kvroute-prompt-tokens") or 0)
        m.child(m.ttft, model, "true" if hit else "false").observe(ttft_ms / 1000)


async def relay_stream(request: web.Request, upstream, headers: dict, bid: str) -> web.StreamResponse:
    # A request that waited for its model to load has its stream started already.
    resp = loading.held(request) or web.StreamResponse(status=upstream.status,
                                                       headers={**headers, **SSE_HEADERS})
    chunks = upstream.content.iter_any().__aiter__()
    try:
        await resp.prepare(request)
        while True:
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                break
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                # After the first byte there is no retry: end the stream with an error event.
                log.warning("backend %s failed mid-stream: %s", bid, exc)
                err = APIError(502, f"Backend {bid} failed mid-stream.", "server_error", None,
                               "backend_failed")
                await resp.write(chat_error_event(err))
                break
            await resp.write(chunk)
        await resp.write_eof()
    except ConnectionError:
        # Writing to the client failed: it went away (aiohttp's reset error is also a
        # ClientConnectionError, hence the separate try for upstream reads above). Not a
        # backend failure; closing upstream, in forward()'s finally, stops its decoding.
        log.debug("client of a stream from %s went away", bid)
    return resp


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
from kvroute.core import misses as reasons
from kvroute.core.hits import is_cache_hit
from kvroute.core.usage import USAGE_HEADER, StreamTail

from . import loading
from .agents.gateway import Relay
from .agents.reply import UpstreamFailed
from .fleet import Backend, watch_of
from .misses import Facts, Miss, client_reason, explain
from .observe.stats import TeamCounts
from .policy.interface import Decision
from .state import State
from .teams import team_of

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
    # What the routing knew, for the reason the prompt may miss its cache (proxy/misses.py):
    lookup: str = "ok"  # "late": past its deadline; "down": Redis did not answer (or empty)
    instances: dict[str, str] = field(default_factory=dict)  # candidate -> its instance id
    held: dict[str, float] = field(default_factory=dict)  # candidate -> tokens held or expected
    advertised: dict[str, float] = field(default_factory=dict)  # candidate -> tokens advertised
    suspects: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)  # backends that failed before answering it
    previous: tuple[str, float] | None = None  # its last backend "restarted"/"gone", tokens there
    outcome: Outcome | None = None  # what the backend answered, once it did

    @property
    def stream(self) -> bool:
        """Whether the client reads a stream (a model load it waits for is streamed)."""
        if self.relay is not None and self.relay.client_stream is not None:
            return self.relay.client_stream
        return self.body.get("stream") is True

    @property
    def request_bytes(self) -> int:
        """Its size as the policy weighs it: the chain's canonical bytes."""
        return self.ends[-1] if self.ends else len(self.raw)

    def error_event(self, err: APIError) -> bytes:
        """How the client's API ends a stream that began before the error (while its
        model loaded): its own error event."""
        return self.relay.held_error(err) if self.relay is not None else chat_error_event(err)


@dataclass
class Outcome:
    """One answered request, as its team's figures count it (observe/stats.py)."""

    status: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0  # known when the answer ended
    seconds_saved: float = 0.0
    seconds_lost: float = 0.0


def chat_error_event(err: APIError) -> bytes:
    """The end of a chat or completion stream that failed after its 200: the error
    envelope as a chunk, then [DONE]."""
    return b"data: " + orjson.dumps(err.body()) + b"\n\ndata: [DONE]\n\n"


class Retry(Exception):
    def __init__(self, error: APIError, failover: bool):
        self.error, self.failover = error, failover


def upstream_headers(state: State, scope: str | None, usage: bool = False) -> dict:
    headers = {"Content-Type": "application/json"}
    if state.config.internal_token:
        headers["x-kvroute-token"] = state.config.internal_token
    if scope:
        headers["x-kvroute-scope"] = scope
    if usage:  # a stream the client may not ask usage of: its team's tokens count anyway
        headers[USAGE_HEADER] = "1"
    return headers


def route_headers(decision: Decision, miss: Miss | None) -> dict:
    headers = {
        "x-kvroute-backend": decision.candidate.backend_id,
        "x-kvroute-prefix-blocks": str(decision.candidate.depth),
        "x-kvroute-route-reason": decision.reason,
    }
    if miss is not None:
        headers[reasons.REASON_HEADER] = client_reason(miss.reason)
        if miss.diverged_at is not None:
            headers[reasons.DIVERGED_HEADER] = str(miss.diverged_at)
    return headers


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
                c.url + req.path, data=req.raw,
                headers=upstream_headers(state, req.scope, req.stream and req.relay is None)))
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
        miss = record_answer(state, req, decision, b, upstream)
        headers = route_headers(decision, miss)
        for name in ("x-kvroute-cached-tokens", "x-kvroute-prompt-tokens", "Retry-After"):
            if name in upstream.headers:
                headers[name] = upstream.headers[name]
        ctype = upstream.headers.get("Content-Type", "application/json")
        state.metrics.child(state.metrics.requests, req.model, bid, str(upstream.status)).inc()
        if ctype.startswith("text/event-stream"):
            if req.relay is not None:
                return await _relay_stream(req, upstream, headers, bid)
            return await relay_stream(req.request, upstream, headers, bid, req.outcome)
        try:
            data = await upstream.read()
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
            # Nothing reached the client yet: retry it elsewhere.
            raise Retry(APIError(502, f"Backend {bid} failed while answering: {exc}.",
                                  "server_error", None, "backend_failed"), failover=True)
        if req.relay is not None:
            resp = await req.relay.whole(upstream.status, data, headers)
            req.outcome.generated_tokens = req.relay.completion_tokens
            return resp
        req.outcome.generated_tokens = completion_tokens(data) if upstream.status < 400 else 0
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



async def _relay_stream(req: RoutedRequest, upstream, headers: dict,
                        bid: str) -> web.StreamResponse:
    try:
        resp = await req.relay.stream(req.request, upstream, headers, bid)
    except UpstreamFailed as exc:
        # Only a relay that reads the stream into a whole answer raises it: nothing has
        # reached the client, so a stream that broke is retried elsewhere, as a whole
        # answer whose read fails is; an error the backend sent is the answer.
        if exc.broken:
            raise Retry(exc.error, failover=True) from None
        raise exc.error from None
    finally:
        req.outcome.generated_tokens = req.relay.completion_tokens
    return resp


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


def _header_int(upstream, name: str) -> int | None:
    value = upstream.headers.get(name, "")
    return int(value) if value.isdigit() else None


def record_answer(state: State, req: RoutedRequest, decision: Decision, b: Backend,
                  upstream) -> Miss | None:
    """Count an answer whose headers just arrived, in the metrics and /stats, with its
    cache reason (None for an error answer); its outcome goes into `req` for its team's
    figures, counted once the answer has ended."""
    m, c, model = state.metrics, decision.candidate, req.model
    bid = c.backend_id
    cached = _header_int(upstream, "x-kvroute-cached-tokens")
    prompt = _header_int(upstream, "x-kvroute-prompt-tokens")
    try:
        ttft_ms = float(upstream.headers["x-kvroute-ttft-ms"])
    except (KeyError, ValueError):
        ttft_ms = None
    tps = b.record.prefill_tps or c.load.prefill_tps
    m.child(m.decisions, model, bid, decision.reason).inc()
    m.child(m.predicted_tokens, model, bid).inc(decision.predicted_tokens)
    if cached is not None:
        m.child(m.actual_tokens, model, bid).inc(cached)
    if prompt is not None:
        m.child(m.prompt_tokens, model, bid).inc(prompt)
    saved = cached / tps if cached and tps > 0 else 0.0
    if saved:
        m.child(m.seconds_saved, model, bid).inc(saved)
    if ttft_ms is not None and upstream.status < 400:
        hit = is_cache_hit(cached or 0, prompt or 0)
        m.child(m.ttft, model, "true" if hit else "false").observe(ttft_ms / 1000)
    miss = explain(facts(req, decision, upstream, cached or 0)) if upstream.status < 400 else None
    lost = miss.lost / tps if miss is not None and tps > 0 else 0.0
    if miss is not None:
        m.child(m.cache_reasons, model, miss.reason).inc()
        if lost:
            m.child(m.seconds_lost, model, miss.reason).inc(lost)
    req.outcome = Outcome(upstream.status, prompt or 0, cached or 0, seconds_saved=saved,
                          seconds_lost=lost)
    state.stats.record(
        model=model, backend=bid, reason=decision.reason, prefix_blocks=c.depth,
        predicted_tokens=decision.predicted_tokens, status=upstream.status,
        prompt_tokens=prompt, cached_tokens=cached, ttft_ms=ttft_ms, prefill_tps=tps,
        team=team_of(req.scope), miss=miss, seconds_lost=lost)
    if miss is not None and miss.reason == reasons.TEMPLATE_DRIFT:
        _warn_drift(state, model, bid, miss, decision, cached or 0)
    return miss


def record_usage(state: State, req: RoutedRequest) -> None:
    """Count an ended answer for its team (its generated tokens are known now)."""
    o = req.outcome
    if o is None:
        return
    m, model, team = state.metrics, req.model, team_of(req.scope)
    m.child(m.team_requests, team, model).inc()
    for kind, n in (("prompt", o.prompt_tokens), ("cached", o.cached_tokens),
                    ("generated", o.generated_tokens)):
        if n:
            m.child(m.team_tokens, team, model, kind).inc(n)
    for kind, seconds in (("saved", o.seconds_saved), ("lost", o.seconds_lost)):
        if seconds:
            m.child(m.team_seconds, team, model, kind).inc(seconds)
    state.stats.count_team(team, model, TeamCounts(
        requests=1, errors=int(o.status >= 400), prompt_tokens=o.prompt_tokens,
        cached_tokens=o.cached_tokens, seconds_saved=o.seconds_saved,
        generated_tokens=o.generated_tokens, seconds_lost=o.seconds_lost))


def facts(req: RoutedRequest, decision: Decision, upstream, cached: int) -> Facts:
    """What the backend's answer headers and the routing (`req`) say about its cache."""
    bid = decision.candidate.backend_id
    lost = _header_int(upstream, reasons.LOST_HEADER) or 0
    elsewhere = max(((v, k) for k, v in req.held.items() if k != bid), default=(0.0, ""))
    previous, previous_tokens = req.previous or (None, 0.0)
    return Facts(
        cached=cached, backend_reason=upstream.headers.get(reasons.REASON_HEADER),
        backend_lost=lost, diverged_at=_header_int(upstream, reasons.DIVERGED_HEADER),
        predicted=0.0 if decision.candidate.expected_only else req.advertised.get(bid, 0.0),
        elsewhere=elsewhere[0], elsewhere_failed=elsewhere[1] in req.failed | req.suspects,
        lookup=req.lookup, previous=previous, previous_tokens=previous_tokens)


def _warn_drift(state: State, model: str, bid: str, miss: Miss, decision: Decision,
                cached: int) -> None:
    if state.stats.note_drift(model, bid, miss.diverged_at, decision.predicted_tokens, cached):
        log.warning("template drift on model %s: backend %s served %d cached tokens where its "
                    "advertised prefix promised about %d; the prompt's tokens left that prefix "
                    "at token %s. The chat template renders earlier turns differently from how "
                    "they were cached (docs/dashboard.md, template_drift)", model, bid, cached,
                    decision.predicted_tokens, miss.diverged_at)


def completion_tokens(data: bytes) -> int:
    """The generated tokens a whole chat or completion answer reports (0: none)."""
    try:
        return int(orjson.loads(data)["usage"]["completion_tokens"])
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return 0


async def relay_stream(request: web.Request, upstream, headers: dict, bid: str,
                       outcome: Outcome | None = None) -> web.StreamResponse:
    # A request that waited for its model to load has its stream started already.
    resp = loading.held(request) or web.StreamResponse(status=upstream.status,
                                                       headers={**headers, **SSE_HEADERS})
    chunks = upstream.content.iter_any().__aiter__()
    tail = StreamTail()  # cuts out the backend's usage comment (kvroute/core/usage.py)
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
                await resp.write(tail.flush() + chat_error_event(err))
                break
            out = tail.feed(chunk)
            if out:
                await resp.write(out)
        rest = tail.flush()
        if rest:
            await resp.write(rest)
        await resp.write_eof()
    except ConnectionError:
        # Writing to the client failed: it went away (aiohttp's reset error is also a
        # ClientConnectionError, hence the separate try for upstream reads above). Not a
        # backend failure; closing upstream, in forward()'s finally, stops its decoding.
        log.debug("client of a stream from %s went away", bid)
    if outcome is not None:
        outcome.generated_tokens = tail.completion_tokens or 0
    return resp


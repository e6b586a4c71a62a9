"""The front proxy: one OpenAI endpoint that routes each turn to where its prefix is cached.

Per request: read the body once, compute its prefix chain (no tokenizer), ask the
registry in one round trip how deep each live backend matches, let the policy
choose, mark the choice pending in Redis (so a burst sharing a new prefix lands
together), then pass the body through unchanged and relay the answer's bytes as
they arrive. A client disconnect cancels the handler, which closes the upstream
connection, which makes the backend stop decoding.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from kvroute import openapi, prefix
from kvroute.process import start_site, wait_for_stop
from kvroute.errors import APIError, bad_request, error_middleware, not_found, overloaded
from kvroute.hits import is_cache_hit
from kvroute.registry import BackendRecord, Registry, RegistryUnavailable
from kvroute.wire import parse_json

from . import apis, messages_api, responses_api
from .metrics import ProxyMetrics
from .policy import Candidate, Decision, Load, PolicyConfig, RouteContext, RoutingPolicy, make_policy
from .recent import RecentChoices
from .response_store import ResponseStore
from .stats import SERIES_PERIOD, Stats
from .translate import GATEWAY, Gateway, Relay

log = logging.getLogger("kvroute.proxy")

STATE_KEY = web.AppKey("state", object)
RETRYABLE_STATUS = {502, 503, 504}
CHAT_PATH = "/v1/chat/completions"
# Chains of bodies larger than this are computed off the event loop.
_INLINE_CHAIN_BYTES = 256 << 10


@dataclass(kw_only=True)
class ProxyConfig:
    """`kvroute proxy`'s settings (names, defaults, help: kvroute/config.py), then tunables."""

    redis_url: str
    host: str
    port: int
    secret: str
    policy: str
    api_keys: dict[str, str | None]  # key -> cache scope
    internal_token: str
    max_body_bytes: int
    request_timeout: float
    block_bytes: int
    lookup_timeout: float  # seconds (the flag is in ms)
    locality_slack: float
    connect_timeout: float = 2.0
    pending_ttl_ms: int = 3000
    suspect_seconds: float = 5.0
    refresh_period: float = 1.0
    forget_after: float = 10.0  # seconds a backend absent from the registry stays a fallback
    probe_timeout: float = 1.0  # /health deadline when checking a backend whose record lapsed
    response_ttl: float = 86400.0  # seconds a stored /v1/responses answer can be continued from


@dataclass
class Backends:
    """What this proxy knows of the fleet between registry answers."""

    records: dict[str, BackendRecord] = field(default_factory=dict)  # last known live backends
    seen: dict[str, float] = field(default_factory=dict)  # when each was last listed live
    # Since when each known backend has been missing from the registry's answers. Only
    # answers count: while Redis is unreachable nobody ages, so after an outage longer
    # than forget_after the fleet is still known when Redis answers again, empty.
    absent_since: dict[str, float] = field(default_factory=dict)
    refreshed: float = 0.0
    refreshed_at: float = 0.0  # time.monotonic() of the last registry answer
    probes: dict[str, tuple[float, asyncio.Future]] = field(default_factory=dict)
    watches: dict[str, asyncio.Future] = field(default_factory=dict)  # one per backend
    inflight: dict[str, int] = field(default_factory=dict)
    unanswered_tokens: dict[str, float] = field(default_factory=dict)  # prefill sent, no answer yet
    suspect_until: dict[str, float] = field(default_factory=dict)

    def update(self, records: list[BackendRecord], keep_for: float) -> None:
        # A backend missing from one answer (Redis restarted empty, heartbeat not yet
        # back) stays known for keep_for seconds; failover covers one that really died.
        now = time.monotonic()
        for r in records:
            self.records[r.backend_id] = r
            self.seen[r.backend_id] = now
            self.absent_since.pop(r.backend_id, None)
        for bid in self.seen:
            if self.seen[bid] != now:
                self.absent_since.setdefault(bid, now)
        for bid in [b for b, t in self.absent_since.items() if now - t > keep_for]:
            del self.seen[bid], self.absent_since[bid]
            self.records.pop(bid, None)
        self.refreshed = time.time()
        self.refreshed_at = now

    def lapsed(self, backend_id: str, max_age: float) -> bool:
        """The registry answered recently and no longer lists this backend: its heartbeat
        stopped, or Redis lost its record (restarted empty). Unknown (False) while the
        registry does not answer."""
        return (time.monotonic() - self.refreshed_at <= max_age
                and self.seen.get(backend_id, 0.0) < self.refreshed_at)

    def serving(self, model: str) -> list[BackendRecord]:
        return [r for r in self.records.values() if model in r.models]

    def models(self) -> list[str]:
        return sorted({m for r in self.records.values() for m in r.models})

    def is_suspect(self, backend_id: str) -> bool:
        return self.suspect_until.get(backend_id, 0.0) > time.monotonic()


@dataclass
class State:
    config: ProxyConfig
    registry: Registry
    policy: RoutingPolicy
    metrics: ProxyMetrics
    backends: Backends
    recent: RecentChoices = field(default_factory=RecentChoices)
    stats: Stats = field(default_factory=Stats)
    session: aiohttp.ClientSession | None = None
    tasks: list[asyncio.Task] = field(default_factory=list)
    background: set = field(default_factory=set)


def _state(request: web.Request) -> State:
    return request.app[STATE_KEY]


# -- authentication -------------------------------------------------------------


def check_api_key(keys: dict[str, str | None], header: str) -> tuple[bool, str | None]:
    """Constant-time: every configured key is compared, whatever matches first."""
    given = header[7:].strip() if header[:7].lower() == "bearer " else ""
    ok, scope = False, None
    for key, key_scope in keys.items():
        if hmac.compare_digest(given.encode(), key.encode()):
            ok, scope = True, key_scope
    return ok, scope


@web.middleware
async def auth_middleware(request: web.Request, handler):
    keys = _state(request).config.api_keys
    if keys and request.path.startswith("/v1/"):
        ok, scope = check_api_key(keys, request.headers.get("Authorization", ""))
        if not ok and "x-api-key" in request.headers:
            # Anthropic clients send the key this way (Claude Code's ANTHROPIC_API_KEY).
            ok, scope = check_api_key(keys, "Bearer " + request.headers["x-api-key"])
        if not ok:
            raise APIError(401, "Missing or invalid API key (send 'Authorization: Bearer <key>' "
                           "or 'x-api-key: <key>').", "authentication_error", None,
                           "invalid_api_key")
        request["scope"] = scope
    return await handler(request)


# -- routing ----------------------------------------------------------------------


def _chain(config: ProxyConfig, path: str, body: dict, model: str, scope: str | None):
    salt = prefix.make_salt(config.secret, scope)
    kw = {"model": model, "salt": salt, "block_bytes": config.block_bytes}
    try:
        if path.endswith("/chat/completions"):
            return prefix.chat_chain_with_sizes(body, **kw)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        return prefix.completion_chain_with_sizes(prompt, **kw)
    except ValueError as exc:
        # The backend would refuse it too; answer without a round trip.
        raise bad_request(f"Invalid request: {exc}.")


async def _candidates(state: State, model: str, keys: list[int]) -> tuple[list[Candidate], bool]:
    t0 = time.perf_counter()
    found = await state.registry.lookup(model, keys)
    state.metrics.lookup.observe(time.perf_counter() - t0)
    b = state.backends
    records = []
    if found is None:
        state.metrics.registry_unknown.inc()
    else:
        records = [(m.record, m.depth, m.marked_depth) for m in found.values()
                   if model in m.record.models]
    known = bool(records)
    if not records:
        # Redis down, or up but empty (just restarted): route by load among the
        # backends seen recently rather than refuse the request.
        records = [(r, 0, 0) for r in b.serving(model)]
    recent = state.recent.depths(model, keys)
    cands = [_candidate(b, r, depth, max(marked, recent.get(r.backend_id, 0)))
             for r, depth, marked in records]
    return cands, known


def _candidate(b: Backends, r: BackendRecord, advertised_depth: int = 0,
               expected_depth: int = 0) -> Candidate:
    bid = r.backend_id
    return Candidate(
        backend_id=bid,
        url=r.url,
        advertised_depth=advertised_depth,
        expected_depth=expected_depth,
        load=Load(unanswered_tokens=b.unanswered_tokens.get(bid, 0.0),
                  inflight=b.inflight.get(bid, 0), reported_queue=r.queue_depth,
                  prefill_tps=r.prefill_tps),
        suspect=b.is_suspect(bid),
    )


def _no_backend(state: State, model: str) -> APIError:
    if model in state.backends.models():
        return APIError(503, f"No backend serving '{model}' is reachable right now.",
                        "server_error", None, "no_backend")
    return not_found(f"The model '{model}' does not exist or no live backend serves it.",
                     param="model", code="model_not_found")


async def ask_backend(request: web.Request, model: str, path: str, body: dict) -> tuple[int, bytes]:
    """One question about a prompt (not a generation: a token count) to a live backend
    serving `model`, least loaded first, the next one if it cannot be reached. No cache
    routing: nothing is prefilled, so no pending mark, decision or stats either."""
    state = _state(request)
    b = state.backends
    records = sorted(b.serving(model), key=lambda r: (b.is_suspect(r.backend_id),
                                                      b.inflight.get(r.backend_id, 0)))
    if not records:
        raise _no_backend(state, model)
    headers = _upstream_headers(state, request.get("scope"))
    error = None
    for r in records[:2]:
        try:
            async with state.session.post(r.url + path, data=orjson.dumps(body),
                                          headers=headers) as up:
                return up.status, await up.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            error = APIError(502, f"Backend {r.backend_id} is unreachable: "
                             f"{exc or type(exc).__name__}.", "server_error", None,
                             "backend_unreachable")
    raise error


async def route_request(request: web.Request) -> web.StreamResponse:
    t_start = time.perf_counter()
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise APIError(413, f"Request body too large: {exc.reason}.", code="request_too_large")
    return await _route(request, raw, parse_json(raw), request.path, t_start)


async def route_chat(request: web.Request, body: dict, relay: Relay,
                     t_start: float) -> web.StreamResponse:
    """Route a chat-completions body that another API's handler built (Responses,
    Messages) exactly as /v1/chat/completions routes its own: the same prefix chain,
    lookup, choice, failover and forwarding, so a conversation hits the same cache
    whichever API carries it. `relay` turns the backend's chat answer into that API's."""
    return await _route(request, orjson.dumps(body), body, CHAT_PATH, t_start, relay)


async def _route(request: web.Request, raw: bytes, body: dict, path: str, t_start: float,
                 relay: Relay | None = None) -> web.StreamResponse:
    state = _state(request)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a string.", param="model",
                          code="missing_required_parameter")
    scope = request.get("scope")
    if len(raw) > _INLINE_CHAIN_BYTES:
        pairs = await asyncio.to_thread(_chain, state.config, path, body, model, scope)
    else:
        pairs = _chain(state.config, path, body, model, scope)
    keys = [k for k, _ in pairs]
    ends = [end for _, end in pairs]
    candidates, known = await _candidates(state, model, keys)
    if not candidates:
        raise _no_backend(state, model)
    return await _dispatch(request, state, raw, model, scope, keys, ends, candidates, known,
                           t_start, path=path, relay=relay)


async def _dispatch(request, state: State, raw: bytes, model: str, scope: str | None,
                    keys: list[int], ends: list[int], candidates: list[Candidate], known: bool,
                    t_start: float, path: str, relay: Relay | None) -> web.StreamResponse:
    request_bytes = ends[-1] if ends else len(raw)
    tried: set[str] = set()
    failovers = 0
    last_error: APIError | None = None
    widened = False
    while True:
        pool = [c for c in candidates if c.backend_id not in tried]
        if not pool and failovers and not widened:
            # The registry may list only part of the fleet (Redis restarted, some
            # heartbeats not back yet): a backend seen recently beats an error.
            widened = True
            pool = [_candidate(state.backends, r) for r in state.backends.serving(model)
                    if r.backend_id not in tried]
            candidates = candidates + pool
        if not pool:
            raise last_error or _no_backend(state, model)
        decision = state.policy.choose(RouteContext(pool, keys, ends, request_bytes, known))
        c = decision.candidate
        tried.add(c.backend_id)
        if decision.mark:
            state.recent.remember(model, keys, c.backend_id, state.config.pending_ttl_ms / 1000)
            if known:
                _spawn(state, state.registry.mark_pending(model, keys, c.backend_id,
                                                          state.config.pending_ttl_ms))
        state.metrics.overhead.observe(time.perf_counter() - t_start)
        try:
            return await _forward(request, state, raw, model, scope, decision, path, relay)
        except _Retry as retry:
            last_error = retry.error
            if retry.failover:
                # A backend that failed before its first byte: try the next best once.
                failovers += 1
                state.backends.suspect_until[c.backend_id] = (
                    time.monotonic() + state.config.suspect_seconds)
                state.metrics.failovers.labels(c.backend_id).inc()
                log.warning("backend %s failed before answering (%s); retrying elsewhere",
                            c.backend_id, retry.error.message)
                if failovers > 1:
                    raise retry.error


def _spawn(state: State, coro) -> None:
    # Keep a reference: the loop holds tasks weakly, and a collected task never runs.
    task = asyncio.ensure_future(coro)
    state.background.add(task)
    task.add_done_callback(state.background.discard)


class _Retry(Exception):
    def __init__(self, error: APIError, failover: bool):
        self.error, self.failover = error, failover


def _upstream_headers(state: State, scope: str | None) -> dict:
    headers = {"Content-Type": "application/json"}
    if state.config.internal_token:
        headers["x-kvroute-token"] = state.config.internal_token
    if scope:
        headers["x-kvroute-scope"] = scope
    return headers


def _route_headers(decision: Decision) -> dict:
    return {
        "x-kvroute-backend": decision.candidate.backend_id,
        "x-kvroute-prefix-blocks": str(decision.candidate.depth),
        "x-kvroute-route-reason": decision.reason,
    }


async def _forward(request: web.Request, state: State, raw: bytes, model: str, scope: str | None,
                   decision: Decision, path: str, relay: Relay | None) -> web.StreamResponse:
    c = decision.candidate
    b = state.backends
    bid = c.backend_id
    prefill = decision.prefill_tokens
    b.inflight[bid] = b.inflight.get(bid, 0) + 1
    b.unanswered_tokens[bid] = b.unanswered_tokens.get(bid, 0.0) + prefill
    state.metrics.inflight.labels(bid).set(b.inflight[bid])
    answered = False
    upstream = None
    # A stopped or hung backend keeps its connections open and says nothing: without
    # this watch a request would wait for --request-timeout. One watch per backend,
    # shared by all its requests: a task per request cost a third of peak throughput.
    watchdog = _watch_of(state, bid, c.url)
    abandon = None
    try:
        try:
            # A task, so the watch can cancel it; cancelling this handler (client gone)
            # cancels it too, as it is being awaited.
            post = asyncio.ensure_future(state.session.post(
                c.url + path, data=raw, headers=_upstream_headers(state, scope)))
            stop_waiting = functools.partial(_stop_waiting, post=post)
            watchdog.add_done_callback(stop_waiting)
            try:
                upstream = await post
            except asyncio.CancelledError:
                if not (watchdog.done() and not watchdog.cancelled()):
                    raise
                raise _Retry(APIError(502, f"Backend {bid} stopped answering (no heartbeat, "
                                      "no health).", "server_error", None, "backend_unresponsive"),
                             failover=True) from None
            finally:
                watchdog.remove_done_callback(stop_waiting)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
            raise _Retry(APIError(502, f"Backend {bid} is unreachable: {exc or type(exc).__name__}.",
                                  "server_error", None, "backend_unreachable"), failover=True)
        # From here on the watch ends a silent upstream by closing it: a stream then
        # ends with an error event, a whole answer is retried elsewhere.
        abandon = functools.partial(_abandon, upstream=upstream, bid=bid)
        watchdog.add_done_callback(abandon)
        b.unanswered_tokens[bid] = max(0.0, b.unanswered_tokens.get(bid, 0.0) - prefill)
        answered = True
        if upstream.status in RETRYABLE_STATUS:
            raise _Retry(APIError(upstream.status, f"Backend {bid} answered {upstream.status}.",
                                  "server_error", None, "backend_unavailable"), failover=True)
        if upstream.status == 429:
            retry_after = float(upstream.headers.get("Retry-After", "1") or 1)
            raise _Retry(overloaded("Every backend serving this model is at capacity.",
                                    retry_after), failover=False)
        _record_decision(state, model, decision, upstream)
        _record_stats(state, model, decision, upstream)
        headers = _route_headers(decision)
        for name in ("x-kvroute-cached-tokens", "x-kvroute-prompt-tokens", "Retry-After"):
            if name in upstream.headers:
                headers[name] = upstream.headers[name]
        ctype = upstream.headers.get("Content-Type", "application/json")
        state.metrics.requests.labels(model, bid, str(upstream.status)).inc()
        if ctype.startswith("text/event-stream"):
            if relay is not None:
                return await relay.stream(request, upstream, headers, bid)
            return await _relay_stream(request, upstream, headers, bid)
        try:
            data = await upstream.read()
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
            # Nothing reached the client yet: retry it elsewhere.
            raise _Retry(APIError(502, f"Backend {bid} failed while answering: {exc}.",
                                  "server_error", None, "backend_failed"), failover=True)
        if relay is not None:
            return await relay.whole(upstream.status, data, headers)
        return web.Response(body=data, status=upstream.status, headers=headers,
                            content_type=ctype.split(";")[0])
    finally:
        if abandon is not None:
            watchdog.remove_done_callback(abandon)
        if not answered:
            b.unanswered_tokens[bid] = max(0.0, b.unanswered_tokens.get(bid, 0.0) - prefill)
        b.inflight[bid] = max(0, b.inflight.get(bid, 0) - 1)
        state.metrics.inflight.labels(bid).set(b.inflight[bid])
        if upstream is not None:
            # close(), not release(): on a client disconnect the backend must see
            # its connection drop so that it stops decoding.
            upstream.close()


def _watch_of(state: State, bid: str, url: str) -> asyncio.Future:
    """The shared watch of backend `bid`; a new one once the last has fired."""
    watches = state.backends.watches
    watch = watches.get(bid)
    if watch is None or watch.done():
        watch = watches[bid] = asyncio.ensure_future(_watch(state, bid, url))
    return watch


async def _watch(state: State, bid: str, url: str) -> None:
    """Returns once backend `bid` looks gone: the registry no longer lists it (its
    heartbeat lapsed) *and* its /health does not answer. Redis trouble alone never
    trips it: while the registry does not answer nothing counts as lapsed, and after
    Redis restarted empty the probe still finds the backend alive."""
    period = state.config.refresh_period
    lapsed = state.backends.lapsed
    while True:
        await asyncio.sleep(period)
        # Asked again after the probe: a backend that just resumed may answer its
        # probe late but is listed again as soon as its next heartbeat lands.
        if lapsed(bid, 3 * period) and not await _answers(state, bid, url) and lapsed(bid, 3 * period):
            return


async def _answers(state: State, bid: str, url: str) -> bool:
    """Whether `url`/health answers; one probe per backend at a time, its result
    shared by every request waiting on that backend for a refresh period."""
    b = state.backends
    now = time.monotonic()
    probe = b.probes.get(bid)
    if probe is None or (probe[1].done() and now - probe[0] > state.config.refresh_period):
        probe = b.probes[bid] = (now, asyncio.ensure_future(_probe(state, url)))
    return await asyncio.shield(probe[1])


async def _probe(state: State, url: str) -> bool:
    try:
        timeout = aiohttp.ClientTimeout(total=state.config.probe_timeout)
        async with state.session.get(url + "/health", timeout=timeout) as r:
            return r.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False


def _stop_waiting(watch: asyncio.Future, *, post: asyncio.Future) -> None:
    if not watch.cancelled():
        post.cancel()


def _abandon(watch: asyncio.Future, *, upstream, bid: str) -> None:
    if not watch.cancelled():
        log.warning("backend %s stopped answering (no heartbeat, no health); abandoning its answer", bid)
        upstream.close()


def _record_decision(state: State, model: str, decision: Decision, upstream) -> None:
    m = state.metrics
    bid = decision.candidate.backend_id
    m.decisions.labels(model, bid, decision.reason).inc()
    m.predicted_tokens.labels(model, bid).inc(decision.predicted_tokens)
    cached = upstream.headers.get("x-kvroute-cached-tokens")
    prompt = upstream.headers.get("x-kvroute-prompt-tokens")
    if cached and cached.isdigit():
        m.actual_tokens.labels(model, bid).inc(int(cached))
    if prompt and prompt.isdigit():
        m.prompt_tokens.labels(model, bid).inc(int(prompt))


def _header_int(upstream, name: str) -> int | None:
    value = upstream.headers.get(name, "")
    return int(value) if value.isdigit() else None


def _record_stats(state: State, model: str, decision: Decision, upstream) -> None:
    c = decision.candidate
    cached = _header_int(upstream, "x-kvroute-cached-tokens")
    try:
        ttft_ms = float(upstream.headers["x-kvroute-ttft-ms"])
    except (KeyError, ValueError):
        ttft_ms = None
    record = state.backends.records.get(c.backend_id)
    tps = (record.prefill_tps if record else 0.0) or c.load.prefill_tps
    state.stats.record(
        model=model, backend=c.backend_id, reason=decision.reason, prefix_blocks=c.depth,
        predicted_tokens=decision.predicted_tokens, status=upstream.status,
        prompt_tokens=_header_int(upstream, "x-kvroute-prompt-tokens"), cached_tokens=cached,
        ttft_ms=ttft_ms, prefill_tps=tps,
    )
    m = state.metrics
    if cached and tps > 0:
        m.seconds_saved.labels(model, c.backend_id).inc(cached / tps)
    if ttft_ms is not None and upstream.status < 400:
        hit = is_cache_hit(cached or 0, _header_int(upstream, "x-kvroute-prompt-tokens") or 0)
        m.ttft.labels(model, "true" if hit else "false").observe(ttft_ms / 1000)


async def _relay_stream(request: web.Request, upstream, headers: dict, bid: str) -> web.StreamResponse:
    resp = web.StreamResponse(status=upstream.status, headers={
        **headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
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
                await resp.write(b"data: " + orjson.dumps(err.body()) + b"\n\ndata: [DONE]\n\n")
                break
            await resp.write(chunk)
        await resp.write_eof()
    except ConnectionError:
        # Writing to the client failed: it went away (aiohttp's reset error is also a
        # ClientConnectionError, hence the separate try for upstream reads above). Not a
        # backend failure; closing upstream, in _forward's finally, stops its decoding.
        log.debug("client of a stream from %s went away", bid)
    return resp


# -- fleet view -------------------------------------------------------------------


async def refresh_backends(state: State) -> None:
    """Keep the last known live backends: the fallback when Redis does not answer."""
    while True:
        try:
            records = await state.registry.live_backends()
            state.backends.update(records, keep_for=state.config.forget_after)
        except RegistryUnavailable as exc:
            log.debug("live backends unavailable: %s", exc)
        except Exception:
            log.exception("refreshing live backends failed")
        await asyncio.sleep(state.config.refresh_period)


# -- other endpoints --------------------------------------------------------------


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


async def models(request: web.Request) -> web.Response:
    state = _state(request)
    data = [{"id": m, "object": "model", "created": 0, "owned_by": "kvroute"}
            for m in state.backends.models()]
    return _json({"object": "list", "data": data})


def fleet(state: State) -> list[dict]:
    b = state.backends
    return [
        {"id": r.backend_id, "url": r.url, "models": r.models, "queue_depth": r.queue_depth,
         "inflight": b.inflight.get(r.backend_id, 0), "suspect": b.is_suspect(r.backend_id),
         "prefill_tps": r.prefill_tps, "cache_bytes": r.cache_bytes, "cache_budget": r.cache_budget}
        for r in sorted(b.records.values(), key=lambda r: r.backend_id)
    ]


async def health(request: web.Request) -> web.Response:
    state = _state(request)
    b = state.backends
    return _json({
        "status": "ok",
        "pid": os.getpid(),
        "policy": state.policy.name,
        "backends": fleet(state),
        "registry_age_s": round(time.time() - b.refreshed, 2) if b.refreshed else None,
    })


async def stats(request: web.Request) -> web.Response:
    state = _state(request)
    return _json(state.stats.snapshot(fleet(state)))


_DASHBOARD = Path(__file__).with_name("dashboard.html")


async def dashboard(request: web.Request) -> web.Response:
    # Read per request: one small file, and edits show without a restart.
    return web.Response(body=_DASHBOARD.read_bytes(), content_type="text/html", charset="utf-8")


async def sample_stats(state: State) -> None:
    m = state.metrics
    while True:
        backends = fleet(state)
        state.stats.sample(backends)
        for b in backends:
            m.backend_cache_bytes.labels(b["id"]).set(b["cache_bytes"])
            m.backend_queue_depth.labels(b["id"]).set(b["queue_depth"])
        await asyncio.sleep(SERIES_PERIOD)


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=_state(request).metrics.render(), content_type="text/plain",
                        charset="utf-8")


_OPENAPI = orjson.dumps(openapi.spec("proxy"))


async def openapi_json(request: web.Request) -> web.Response:
    return web.Response(body=_OPENAPI, content_type="application/json")


def create_app(config: ProxyConfig) -> web.Application:
    registry = Registry(config.redis_url, lookup_timeout=config.lookup_timeout)
    policy = make_policy(PolicyConfig(name=config.policy, locality_slack=config.locality_slack))
    state = State(config, registry, policy, ProxyMetrics(), Backends())
    # Outermost first: the per-API count sees final statuses, after Messages errors took
    # Anthropic's envelope.
    app = web.Application(middlewares=[apis.count_middleware(state.metrics, state.stats),
                                       messages_api.error_envelope_middleware,
                                       error_middleware, auth_middleware],
                          client_max_size=config.max_body_bytes)
    app[STATE_KEY] = state
    app[GATEWAY] = Gateway(route_chat, ask_backend,
                           ResponseStore(registry, config.secret, config.response_ttl))
    app.router.add_post(CHAT_PATH, route_request)
    app.router.add_post("/v1/completions", route_request)
    responses_api.add_routes(app)
    messages_api.add_routes(app)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi_json)
    app.router.add_get("/stats", stats)
    app.router.add_get("/dashboard", dashboard)
    app.on_startup.append(_startup)
    app.on_cleanup.append(_cleanup)
    return app


async def _startup(app: web.Application) -> None:
    state = app[STATE_KEY]
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=state.config.connect_timeout,
                                    sock_read=state.config.request_timeout)
    # No connection cap: backends apply their own queue limits (and answer 429).
    state.session = aiohttp.ClientSession(timeout=timeout,
                                          connector=aiohttp.TCPConnector(limit=0),
                                          auto_decompress=False)
    state.tasks.append(asyncio.create_task(refresh_backends(state)))
    state.tasks.append(asyncio.create_task(sample_stats(state)))


async def _cleanup(app: web.Application) -> None:
    state = app[STATE_KEY]
    tasks = state.tasks + list(state.backends.watches.values())
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if state.session is not None:
        await state.session.close()
    await state.registry.close()


async def serve(config: ProxyConfig) -> None:
    runner = await start_site(create_app(config), config.host, config.port)
    log.info("proxy on http://%s:%d (policy %s, registry %s)", config.host, config.port,
             config.policy, config.redis_url)
    await wait_for_stop()
    await runner.cleanup()

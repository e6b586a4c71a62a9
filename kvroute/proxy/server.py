"""The front proxy's routes and app: one OpenAI endpoint that routes each turn to where
its prefix is cached.

Per request: read the body once, compute its prefix chain (no tokenizer), ask the
registry in one round trip how deep each live backend matches, let the policy
(proxy/policy.py) choose, leave a routing mark in Redis when the policy asks for one
(so a burst sharing a new prefix lands together), then forward (proxy/forward.py),
failing over once to the next best backend. The fleet view lives in proxy/fleet.py,
the state and settings in proxy/state.py, API keys in proxy/auth.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from kvroute.api import openapi
from kvroute.core import prefix
from kvroute.api.process import start_site, wait_for_stop
from kvroute.api.errors import APIError, bad_request, error_middleware, not_found
from kvroute.core.models_state import ModelsState
from kvroute.core.registry import BackendRecord, Registry, RegistryUnavailable
from kvroute.api.wire import parse_json

from . import apis, loading, messages_api, responses_api
from .auth import auth_middleware
from .fleet import Backends, check_fingerprint, describe, refresh_backends
from .forward import Retry, forward, upstream_headers
from .metrics import ProxyMetrics
from .policy import Candidate, Decision, Load, PolicyConfig, RouteContext, make_policy
from .response_store import ResponseStore
from .state import STATE_KEY, ProxyConfig, State, spawn, state_of
from .stats import SERIES_PERIOD
from .translate import GATEWAY, Gateway, Relay

log = logging.getLogger("kvroute.proxy")

CHAT_PATH = "/v1/chat/completions"
# Chains of bodies larger than this are computed off the event loop.
_INLINE_CHAIN_BYTES = 256 << 10


# -- routing ----------------------------------------------------------------------


def _chain(config: ProxyConfig, path: str, body: dict, model: str, scope: str | None,
           layout: prefix.Layout):
    # From the body alone, no tokenizer (docs/DESIGN.md invariant 6), with the same
    # function the backend advertises with, in the layout of the model's chat template
    # as its backends publish it (proxy/fleet.py).
    salt = prefix.make_salt(config.secret, scope)
    try:
        return prefix.request_chain(prefix.request_kind(path), body, model=model, salt=salt,
                                    block_bytes=config.block_bytes, layout=layout)
    except ValueError as exc:
        # The backend would refuse it too; answer without a round trip.
        raise bad_request(f"Invalid request: {exc}.")


async def _candidates(state: State, model: str, keys: list[int]) -> tuple[list[Candidate], bool]:
    t0 = time.perf_counter()
    late = state.registry.late
    found = await state.registry.lookup(model, keys)
    state.metrics.lookup.observe(time.perf_counter() - t0)
    b = state.backends
    records = []
    if found is None:
        state.metrics.registry_unknown.inc()
        if state.registry.late > late:
            state.metrics.registry_late.inc()
    else:
        records = [(m.record, m.depth, m.marked_depth, m.disk_depth) for m in found.values()
                   if model in m.record.models]
    known = bool(records)
    if not records:
        # Redis down, or up but empty (just restarted): route by load among the
        # backends seen recently rather than refuse the request.
        records = [(r, 0, 0, 0) for r in b.serving(model)]
    recent = state.recent.depths(model, keys)
    cands = []
    for r, depth, marked, disk in records:
        if check_fingerprint(state, r) is None:
            cands.append(_candidate(b, r, depth, max(marked, recent.get(r.backend_id, 0)), disk))
        else:  # its keys are not ours: whatever it "matches" is a coincidence
            cands.append(_candidate(b, r))
    return cands, known


def _candidate(b: Backends, r: BackendRecord, advertised_depth: int = 0,
               expected_depth: int = 0, disk_depth: int = 0) -> Candidate:
    bid = r.backend_id
    return Candidate(
        backend_id=bid,
        url=r.url,
        advertised_depth=advertised_depth,
        expected_depth=expected_depth,
        load=Load(unanswered_tokens=b.unanswered_tokens.get(bid, 0.0),
                  inflight=b.inflight.get(bid, 0), waiting=r.waiting, running=r.running,
                  prefill_tps=r.prefill_tps, bytes_per_token=r.bytes_per_token,
                  decoding=r.decoding, max_batch=r.max_batch,
                  decode_steps_per_s=r.decode_steps_per_s, reply_tokens=r.reply_tokens,
                  free_share=(max(0, r.cache_budget - r.cache_bytes) / r.cache_budget
                              if r.cache_budget > 0 else 0.0)),
        suspect=b.is_suspect(bid),
        disk_depth=disk_depth,
        restore_tps=r.restore_tps,
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
    routing: nothing is prefilled, so no routing mark, decision or stats either."""
    state = state_of(request)
    b = state.backends
    if state.models.needs_load(model, bool(b.serving(model))):
        await state.models.wait_loaded(model, functools.partial(_serving_now, state, model))
    records = sorted(b.serving(model), key=lambda r: (b.is_suspect(r.backend_id),
                                                      b.inflight.get(r.backend_id, 0)))
    if not records:
        raise _no_backend(state, model)
    headers = upstream_headers(state, request.get("scope"))
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
    state = state_of(request)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a string.", param="model",
                          code="missing_required_parameter")
    scope = request.get("scope")
    layout = state.backends.layout(model)
    if len(raw) > _INLINE_CHAIN_BYTES:
        pairs = await asyncio.to_thread(_chain, state.config, path, body, model, scope, layout)
    else:
        pairs = _chain(state.config, path, body, model, scope, layout)
    state.models.touch(model)
    if state.models.needs_load(model, bool(state.backends.serving(model))):
        # A valid request for a configured model that is not loaded: wait for its load.
        done = await loading.hold(request, state.models, model, loading.wants_stream(body),
                                  functools.partial(_serving_now, state, model))
        if done is not None:
            return done
        if state.backends.layout(model) != layout:  # its backends' template decides
            pairs = await asyncio.to_thread(_chain, state.config, path, body, model, scope,
                                            state.backends.layout(model))
    keys = [k for k, _ in pairs]
    ends = [end for _, end in pairs]
    route = functools.partial(_route_to, request, state, raw, model, scope, keys, ends, path,
                              t_start, relay)
    if loading.held(request) is None:
        return await route()
    try:  # the client's stream has started: errors and answers go into it
        resp = await route()
    except APIError as err:
        return await loading.write_error(request, err)
    return await loading.finish(request, resp)


async def _serving_now(state: State, model: str) -> bool:
    """Whether a live backend serves `model`, asking the registry now (a load just ended)."""
    try:
        state.backends.update(await state.registry.live_backends(),
                              keep_for=state.config.forget_after)
    except RegistryUnavailable:
        pass
    return bool(state.backends.serving(model))


async def _route_to(request: web.Request, state: State, raw: bytes, model: str,
                    scope: str | None, keys: list[int], ends: list[int], path: str,
                    t_start: float, relay: Relay | None) -> web.StreamResponse:
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
        ctx = RouteContext(pool, keys, ends, request_bytes, known)
        decision = (None if known else _live_route(state, ctx)) or state.policy.choose(ctx)
        c = decision.candidate
        tried.add(c.backend_id)
        state.live.remember(keys, c.backend_id)
        if decision.mark:
            state.recent.remember(model, keys, c.backend_id, state.config.mark_ttl_ms / 1000)
            if known:
                spawn(state, state.registry.mark_route(model, keys, c.backend_id,
                                                          state.config.mark_ttl_ms))
        state.metrics.overhead.observe(time.perf_counter() - t_start)
        try:
            return await forward(request, state, raw, model, scope, decision, path, relay)
        except Retry as retry:
            last_error = retry.error
            if retry.failover:
                # A backend that failed before its first byte: try the next best once.
                failovers += 1
                state.backends.suspect_until[c.backend_id] = (
                    time.monotonic() + state.config.suspect_seconds)
                state.metrics.failovers.labels(c.backend_id).inc()
                log.warning("backend %s failed before answering (%s); retrying elsewhere",
                            c.backend_id, retry.error.message)
                # One more backend after a failure, and any number past backends that
                # could not be reached (they never saw the request; a dead machine
                # takes several with it until their records lapse).
                if failovers > 1 and retry.error.code != "backend_unreachable":
                    raise retry.error


def _live_route(state: State, ctx: RouteContext) -> Decision | None:
    """With the registry unable to say (lookup past its deadline, Redis down), a turn
    of a conversation this proxy routed before goes where its prefix is: the backend
    it last sent the conversation to, if that one is live (a candidate) and not suspect.
    Only for cache-aware: the other policies are baselines that ignore the cache."""
    if state.policy.name != "cache-aware":
        return None
    found = state.live.find(ctx.chain)
    if found is None:
        return None
    backend_id, depth = found
    c = next((c for c in ctx.candidates if c.backend_id == backend_id and not c.suspect), None)
    if c is None:
        return None
    c = dataclasses.replace(c, expected_depth=max(c.expected_depth, depth))
    bpt = c.load.bytes_per_token or state.policy.config.bytes_per_token
    matched = ctx.matched_bytes(c)
    return Decision(c, "live-route", max(0, ctx.request_bytes - matched) / bpt,
                    predicted_tokens=int(matched / bpt), mark=True)


# -- other endpoints --------------------------------------------------------------


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


async def models(request: web.Request) -> web.Response:
    state = state_of(request)
    return _json({"object": "list", "data": state.models.listing(state.backends.models())})


async def model_info(request: web.Request) -> web.Response:
    """GET /v1/models/{model}: one model object of the /v1/models listing."""
    state = state_of(request)
    model = request.match_info["model"]
    entry = state.models.entry(model, state.backends.models())
    if entry is None:
        raise not_found(f"The model '{model[:200]}' does not exist.", param="model",
                        code="model_not_found")
    return _json(entry)


async def health(request: web.Request) -> web.Response:
    state = state_of(request)
    b = state.backends
    return _json({
        "status": "ok",
        "pid": os.getpid(),
        "policy": state.policy.name,
        "backends": describe(state),
        "registry_age_s": round(time.time() - b.refreshed, 2) if b.refreshed else None,
    })


async def stats(request: web.Request) -> web.Response:
    state = state_of(request)
    return _json({**state.stats.snapshot(describe(state)), "model_states": state.models.stats()})


_DASHBOARD = Path(__file__).with_name("dashboard.html")


async def dashboard(request: web.Request) -> web.Response:
    # Read per request: one small file, and edits show without a restart.
    return web.Response(body=_DASHBOARD.read_bytes(), content_type="text/html", charset="utf-8")


async def sample_stats(state: State) -> None:
    m = state.metrics
    while True:
        backends = describe(state)
        state.stats.sample(backends)
        for b in backends:
            m.backend_cache_bytes.labels(b["id"]).set(b["cache_bytes"])
            m.backend_queue_depth.labels(b["id"]).set(b["queue_depth"])
        await asyncio.sleep(SERIES_PERIOD)


async def metrics(request: web.Request) -> web.Response:
    state = state_of(request)
    state.metrics.set_models(state.models.stats())  # as fresh as the proxy's view
    return web.Response(body=state.metrics.render(), content_type="text/plain", charset="utf-8")


_OPENAPI = orjson.dumps(openapi.spec("proxy"))


async def openapi_json(request: web.Request) -> web.Response:
    return web.Response(body=_OPENAPI, content_type="application/json")


def create_app(config: ProxyConfig) -> web.Application:
    registry = Registry(config.redis_url, lookup_timeout=config.lookup_timeout)
    policy = make_policy(PolicyConfig(name=config.policy, locality_slack=config.locality_slack))
    on_demand = loading.Models(ModelsState(config.redis_url), config.load_timeout)
    state = State(config, registry, policy, ProxyMetrics(), Backends(), on_demand,
                  fingerprint=prefix.fingerprint(config.secret, config.block_bytes))
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
    app.router.add_get("/v1/models/{model:.+}", model_info)
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
    state.tasks.append(asyncio.create_task(state.models.refresh_loop()))


async def _cleanup(app: web.Application) -> None:
    state = app[STATE_KEY]
    tasks = state.tasks + list(state.backends.watches.values())
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if state.session is not None:
        await state.session.close()
    await state.registry.close()
    await state.models.states.close()


async def serve(config: ProxyConfig) -> None:
    runner = await start_site(create_app(config), config.host, config.port)
    log.info("proxy on http://%s:%d (policy %s, registry %s)", config.host, config.port,
             config.policy, config.redis_url)
    await wait_for_stop()
    await runner.cleanup()


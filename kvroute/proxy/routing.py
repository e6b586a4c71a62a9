"""Routing: each chat or completion request (and each agent API's, through the
gateway) to the backend where its prefix is cached.

Per request: read the body once, compute its prefix chain (no tokenizer), ask the
registry in one round trip how deep each live backend matches, let the policy
(proxy/policy/) choose, leave a routing mark in Redis when the policy asks for one
(so a burst sharing a new prefix lands together), then forward (proxy/forward.py),
failing over once to the next best backend. The fleet view lives in proxy/fleet.py,
the state and settings in proxy/state.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time

import aiohttp
import orjson
from aiohttp import web

from kvroute.api.chat import ChatCompletionBody, CompletionBody
from kvroute.api.errors import APIError, bad_request, not_found
from kvroute.api.http import off_loop_if_large, read_json
from kvroute.api.routes import CHAT_PATH
from kvroute.api.validation import validate
from kvroute.core import prefix
from kvroute.core.images import ImageError
from kvroute.core.model_loads import LOADED
from kvroute.core.registry import RegistryUnavailable

from . import loading
from .agents.gateway import Relay
from .fleet import Backend, check_fingerprint
from .forward import Retry, RoutedRequest, forward, record_usage, upstream_headers
from .policy.cost import fleet_median
from .policy.interface import Candidate, Decision, RouteContext
from .state import ProxyConfig, State, spawn, state_of

log = logging.getLogger("kvroute.proxy")


async def route_request(request: web.Request) -> web.StreamResponse:
    """/v1/chat/completions and /v1/completions: the client's body passes through."""
    t_start = time.perf_counter()
    raw, body = await read_json(request)
    return await _route(_routed(request, raw, body, request.path, t_start))


async def route_chat(request: web.Request, body: dict, relay: Relay,
                     t_start: float) -> web.StreamResponse:
    """Route a chat-completions body that another API's handler built (Responses,
    Messages) exactly as /v1/chat/completions routes its own: the same prefix chain,
    lookup, choice, failover and forwarding, so a conversation hits the same cache
    whichever API carries it. `relay` turns the backend's chat answer into that API's."""
    return await _route(_routed(request, orjson.dumps(body), body, CHAT_PATH, t_start, relay))


def _routed(request: web.Request, raw: bytes, body: dict, path: str, t_start: float,
            relay: Relay | None = None) -> RoutedRequest:
    """The request as every step after this one reads it; a 400 without a model."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a string.", param="model",
                          code="missing_required_parameter")
    return RoutedRequest(request, raw, body, model, path, request.get("scope"), t_start, relay)


async def _route(req: RoutedRequest) -> web.StreamResponse:
    """Its prefix chain, its model loaded when it is not, then a backend for it; once
    answered, its team's figures."""
    state = state_of(req.request)
    admission = await state.limits.admit(req.request, req.model)
    try:
        return await _route_to_backend(state, req)
    finally:
        record_usage(state, req)
        o = req.outcome
        state.limits.end(admission, o.prompt_tokens + o.generated_tokens if o else 0)


async def _route_to_backend(state: State, req: RoutedRequest) -> web.StreamResponse:
    model = req.model
    layout = state.fleet.layout(model)
    await _inline_images(state, req)
    await _chain(state.config, req, layout)
    state.models.touch(model)
    if await state.models.must_wait(model, bool(state.fleet.serving(model))):
        # A valid request for a configured model that is not loaded: wait for its load.
        done = await loading.hold(req.request, state.models, model, req.stream,
                                  functools.partial(_serving_now, state, model), req.error_event)
        if done is not None:
            return done
        if state.fleet.layout(model) != layout:  # its backends' template decides
            await _chain(state.config, req, state.fleet.layout(model))
    try:
        resp = await _dispatch_through_restarts(state, req)
    except APIError as err:
        if loading.held(req.request) is None:
            raise
        # The client's stream has started (a wait for a load or a restart): errors and
        # answers go into it.
        return await loading.write_error(req.request, err, req.error_event)
    if loading.held(req.request) is None:
        return resp
    return await loading.finish(req.request, resp, req.error_event)


async def _inline_images(state: State, req: RoutedRequest) -> None:
    """Image URLs fetched and inlined as data: URLs (proxy/image_fetch.py), before the
    chain: from here on the request is the one its client could have sent inline."""
    if b"image_url" not in req.raw:  # no image part: nothing to walk
        return
    t0 = time.perf_counter()
    try:
        fetched = await state.images.inline(req.body)
    except APIError as err:  # in the words of the API the client called
        state.metrics.image_refusals.inc()
        raise req.relay.refusal(err) if req.relay is not None else err
    if not fetched:
        return
    took = time.perf_counter() - t0
    state.metrics.images_fetched.inc(fetched)
    state.metrics.image_fetch.observe(took)
    req.t_start += took  # the proxy's overhead is its own work, not a remote server's
    req.raw = await off_loop_if_large(len(req.raw), orjson.dumps, req.body)
    limit = state.config.max_body_bytes
    if len(req.raw) > limit:
        # Held to the limit an inline image has: the backend's body limit is the same.
        raise APIError(413, f"Request body too large: with its fetched images inline it is "
                       f"{len(req.raw)} bytes, over the limit of {limit} (max_body_bytes).",
                       param="messages", code="request_too_large")


async def _chain(config: ProxyConfig, req: RoutedRequest, layout: prefix.Layout) -> None:
    """The request's prefix chain, into `req.keys` and `req.ends`: from the body alone,
    no tokenizer (docs/DESIGN.md invariant 6), with the same function the backend
    advertises with, in the layout of the model's chat template as its backends
    publish it (proxy/fleet.py). A large body's chain is computed off the event loop."""
    try:
        pairs = await off_loop_if_large(len(req.raw), _chain_pairs, config, req, layout)
    except APIError as err:  # in the words of the API the client called
        raise req.relay.refusal(err) if req.relay is not None else err
    req.keys = [k for k, _ in pairs]
    req.ends = [end for _, end in pairs]


def _chain_pairs(config: ProxyConfig, req: RoutedRequest,
                 layout: prefix.Layout) -> list[tuple[int, int]]:
    salt = prefix.make_salt(config.secret, req.scope)
    try:
        return prefix.request_chain(prefix.request_kind(req.path), req.body, model=req.model,
                                    salt=salt, block_bytes=config.block_bytes, layout=layout)
    except ImageError as exc:  # the backend would refuse it too
        raise bad_request(f"Invalid image: {exc}.", param="messages", code="invalid_image")
    except ValueError as exc:
        # The backend would refuse it too; answer without a round trip.
        raise _refusal(req, exc) from None


def _refusal(req: RoutedRequest, exc: ValueError) -> APIError:
    """The 400 of a body the chain cannot read, as the backend words it: validated by
    the API's model, it names the parameter and a code. Only here, on the way out: the
    proxy does not validate every body (the backend does), to keep its overhead low."""
    if req.relay is None:  # an agent API's chat body is the gateway's, not the client's
        model = ChatCompletionBody if prefix.request_kind(req.path) == "chat" else CompletionBody
        try:
            validate(model, req.body)
        except APIError as err:
            return err
    return bad_request(f"Invalid request: {exc}.", code="invalid_value")


async def _serving_now(state: State, model: str) -> bool:
    """Whether a live backend serves `model`, asking the registry now (a load just ended)."""
    try:
        state.fleet.update(await state.registry.live_backends(),
                           keep_for=state.config.forget_after)
    except RegistryUnavailable:
        pass
    return bool(state.fleet.serving(model))


async def _dispatch_through_restarts(state: State, req: RoutedRequest) -> web.StreamResponse:
    """`_dispatch`; when every backend of a loaded model failed unreached (killed,
    crashed), its `kvroute serve` restarts them: the request waits for one, as for a
    load (a streaming client's stream starts), and goes again, until `load_timeout`.
    A wait that fails on a started stream returns that stream, ended with the error."""
    deadline = time.monotonic() + state.models.load_timeout
    while True:
        try:
            return await _dispatch(state, req)
        except APIError as err:
            if not _restart_expected(state, req, err) or time.monotonic() > deadline:
                raise
        log.warning("no backend of %s could be reached; its requests wait for one to come "
                    "back (up to %.0fs)", req.model, state.models.load_timeout)
        gone = {b.id: b.record.instance_id for b in state.fleet.serving(req.model)
                if b.id in req.failed}
        done = await loading.hold(req.request, state.models, req.model, req.stream,
                                  functools.partial(_serving_again, state, req.model, gone,
                                                    time.time()), req.error_event)
        if done is not None:
            return done


def _restart_expected(state: State, req: RoutedRequest, err: APIError) -> bool:
    """Whether no backend could be reached for a model its `kvroute serve` has loaded
    (and so restarts): nothing ran the request, and no stream has started."""
    s = state.models.summaries.get(req.model)
    return (err.code in ("backend_unreachable", "no_backend") and s is not None
            and s.state == LOADED and not req.outcome)


async def _serving_again(state: State, model: str, gone: dict[str, str], since: float) -> bool:
    """Whether a backend serves `model` that was not found unreachable, was restarted
    (a new instance), or has written a heartbeat since the failure (it lives: the
    failure was the way to it, a blip; a heartbeat it wrote before dying, read late,
    is older)."""
    await _serving_now(state, model)
    return any(b.id not in gone or b.record.instance_id != gone[b.id]
               or b.record.updated_at > since for b in state.fleet.serving(model))


async def _dispatch(state: State, req: RoutedRequest) -> web.StreamResponse:
    """Choose among the candidates and forward; a backend that fails before its first
    byte is tried once more elsewhere."""
    model = req.model
    found, known = await _candidates(state, req)
    if not found:
        raise _no_backend(state, model)
    backends = {b.id: b for b, _ in found}
    candidates = [c for _, c in found]
    # Where this proxy sent the conversation before: asked before this route replaces it.
    previous = state.live.find(req.keys)
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
            seen = [b for b in state.fleet.serving(model) if b.id not in tried]
            backends.update((b.id, b) for b in seen)
            pool = [b.candidate() for b in seen]
            candidates = candidates + pool
        if not pool:
            raise last_error or _no_backend(state, model)
        ctx = RouteContext(pool, req.keys, req.ends, req.request_bytes, known)
        if not tried:
            _note_holdings(state, req, ctx, previous)
        decision = (None if known else _live_route(state, ctx)) or state.policy.choose(ctx)
        c = decision.candidate
        tried.add(c.backend_id)
        state.live.remember(req.keys, c.backend_id, req.instances.get(c.backend_id, ""))
        if decision.mark:
            state.recent.remember(model, req.keys, c.backend_id, state.config.mark_ttl_ms / 1000)
            if known:
                spawn(state, state.registry.mark_route(model, req.keys, c.backend_id,
                                                       state.config.mark_ttl_ms))
        state.metrics.overhead.observe(time.perf_counter() - req.t_start)
        try:
            return await forward(state, req, decision, backends[c.backend_id])
        except Retry as retry:
            last_error = retry.error
            if retry.failover:
                # A backend that failed before its first byte: try the next best once.
                failovers += 1
                req.failed.add(c.backend_id)
                backends[c.backend_id].suspect_until = (
                    time.monotonic() + state.config.suspect_seconds)
                state.metrics.failovers.labels(c.backend_id).inc()
                log.warning("backend %s failed before answering (%s); retrying elsewhere",
                            c.backend_id, retry.error.message)
                # One more backend after a failure, and any number past backends that
                # could not be reached (they never saw the request; a dead machine
                # takes several with it until their records lapse).
                if failovers > 1 and retry.error.code != "backend_unreachable":
                    raise retry.error


async def _candidates(state: State,
                      req: RoutedRequest) -> tuple[list[tuple[Backend, Candidate]], bool]:
    """Each live backend serving the model, as the fleet knows it and as a candidate of
    this request (how deep it holds the prefix, by the registry and this proxy's recent
    choices); and whether the registry answered."""
    model, keys = req.model, req.keys
    t0 = time.perf_counter()
    late = state.registry.late
    found = await state.registry.lookup(model, keys)
    state.metrics.lookup.observe(time.perf_counter() - t0)
    fleet = state.fleet
    records = []
    if found is None:
        state.metrics.registry_unknown.inc()
        if state.registry.late > late:
            state.metrics.registry_late.inc()
            req.lookup = "late"
    else:
        records = [(m.record, m.depth, m.marked_depth, m.disk_depth) for m in found.values()
                   if model in m.record.models]
    known = bool(records)
    if not records:
        # Redis down, or up but empty (just restarted): route by load among the
        # backends seen recently rather than refuse the request.
        req.lookup = "late" if req.lookup == "late" else "down"
        records = [(b.record, 0, 0, 0) for b in fleet.serving(model)]
    req.instances = {r.backend_id: r.instance_id for r, *_ in records}
    recent = state.recent.depths(model, keys)
    out = []
    for r, depth, marked, disk in records:
        b = fleet.view(r)
        if check_fingerprint(state, b, r) is None:
            expected = max(marked, recent.get(r.backend_id, 0))
            out.append((b, b.candidate(r, depth, expected, disk)))
        else:  # its keys are not ours: whatever it "matches" is a coincidence
            out.append((b, b.candidate(r)))
    return out, known


def _note_holdings(state: State, req: RoutedRequest, ctx: RouteContext,
                   previous: tuple[str, str, int] | None) -> None:
    """What the first choice knew of where the prompt is cached, in tokens, for the
    reason it may miss (proxy/misses.py): how much each candidate holds or is expected
    to, how much the chosen one's advertised keys promise, and whether the backend this
    proxy last sent the conversation to restarted or went since."""
    bpt = (fleet_median([c.load.bytes_per_token for c in ctx.candidates])
           or state.policy.config.bytes_per_token)
    for c in ctx.candidates:
        matched = ctx.matched_bytes(c)
        req.held[c.backend_id] = (matched + ctx.restore_bytes(c, matched)) / bpt
        req.advertised[c.backend_id] = ctx.covered(c.advertised_depth) / bpt
        if c.suspect:
            req.suspects.add(c.backend_id)
    if previous is not None:
        bid, instance, depth = previous
        now = req.instances.get(bid)
        if now is None or (instance and now != instance):
            req.previous = ("gone" if now is None else "restarted", ctx.covered(depth) / bpt)


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
    backend_id, _, depth = found
    c = next((c for c in ctx.candidates if c.backend_id == backend_id and not c.suspect), None)
    if c is None:
        return None
    c = dataclasses.replace(c, expected_depth=max(c.expected_depth, depth))
    bpt = c.load.bytes_per_token or state.policy.config.bytes_per_token
    matched = ctx.matched_bytes(c)
    return Decision(c, "live-route", max(0, ctx.request_bytes - matched) / bpt,
                    predicted_tokens=int(matched / bpt), mark=True)


def _no_backend(state: State, model: str) -> APIError:
    if model in state.fleet.models():
        return APIError(503, f"No backend serving '{model}' is reachable right now.",
                        "server_error", None, "no_backend")
    return not_found(f"The model '{model}' does not exist or no live backend serves it.",
                     param="model", code="model_not_found")


async def ask_backend(request: web.Request, model: str, path: str,
                      body: dict) -> tuple[int, bytes]:
    """One question about a prompt (not a generation: a token count) to a live backend
    serving `model`, least loaded first, the next one if it cannot be reached. No cache
    routing: nothing is prefilled, so no routing mark, decision or stats either."""
    state = state_of(request)
    state.limits.check_model(request, model)
    await state.images.inline(body)  # a token count of a URL image counts its bytes
    if await state.models.must_wait(model, bool(state.fleet.serving(model))):
        await state.models.wait_loaded(model, functools.partial(_serving_now, state, model))
    backends = sorted(state.fleet.serving(model), key=lambda b: (b.is_suspect(), b.inflight))
    if not backends:
        raise _no_backend(state, model)
    headers = upstream_headers(state, request.get("scope"))
    error = None
    for b in backends[:2]:
        try:
            async with state.session.post(b.url + path, data=orjson.dumps(body),
                                          headers=headers) as up:
                return up.status, await up.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            error = APIError(502, f"Backend {b.id} is unreachable: "
                             f"{exc or type(exc).__name__}.", "server_error", None,
                             "backend_unreachable")
    raise error

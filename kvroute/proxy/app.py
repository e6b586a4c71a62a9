"""The proxy's app: its routes, the endpoints that are not routed to a backend
(models, health, stats, metrics, the dashboard, /openapi.json), start-up and clean-up.

A request for a model goes through routing.py (chat and completions, and the agent
APIs of agents/ through the `Gateway` built here); the fleet view lives in fleet.py,
the state and settings in state.py, API keys in auth.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from kvroute.api import openapi
from kvroute.api.errors import embeddings, error_middleware, not_found
from kvroute.api.lifecycle import start_site, wait_for_stop
from kvroute.api.routes import (CHAT_PATH, COMPLETIONS_PATH, EMBEDDINGS_PATH, HEALTH_PATH,
                                MODELS_PATH)
from kvroute.core import prefix
from kvroute.core.model_loads import ModelLoads
from kvroute.core.registry import Registry

from . import loading
from .agents import messages, responses
from .agents.gateway import GATEWAY, Gateway
from .agents.store import ResponseStore
from .auth import auth_middleware
from .fleet import Fleet, refresh_backends
from .image_fetch import FetchSettings, ImageFetcher
from .limits import LIMITS, Limits
from .observe import apis
from .observe.metrics import ProxyMetrics
from .observe.stats import DASHBOARD, SERIES_PERIOD, Stats
from .policy.interface import PolicyConfig
from .policy.policies import make_policy
from .routing import ask_backend, route_chat, route_request
from .state import STATE_KEY, ProxyConfig, State, state_of
from .teams import teams

log = logging.getLogger("kvroute.proxy")


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


async def models(request: web.Request) -> web.Response:
    state = state_of(request)
    listing = state.models.listing(state.fleet.loaded_at(), state.fleet.image_models())
    return _json({"object": "list",
                  "data": [m for m in listing if state.limits.allows(request, m["id"])]})


async def model_info(request: web.Request) -> web.Response:
    """GET /v1/models/{model}: one model object of the /v1/models listing."""
    state = state_of(request)
    model = request.match_info["model"]
    entry = state.models.entry(model, state.fleet.loaded_at(), state.fleet.image_models())
    if entry is None or not state.limits.allows(request, model):
        raise not_found(f"The model '{model[:200]}' does not exist.", param="model",
                        code="model_not_found")
    return _json(entry)


async def health(request: web.Request) -> web.Response:
    state = state_of(request)
    fleet = state.fleet
    return _json({
        "status": "ok",
        "pid": os.getpid(),
        "policy": state.policy.name,
        "backends": fleet.describe(),
        "registry_age_s": round(time.time() - fleet.refreshed, 2) if fleet.refreshed else None,
    })


async def stats(request: web.Request) -> web.Response:
    state = state_of(request)
    return _json({**state.stats.snapshot(state.fleet.describe()),
                  "model_states": state.models.stats()})


async def dashboard(request: web.Request) -> web.Response:
    # Read per request: one small file, and edits show without a restart.
    return web.Response(body=DASHBOARD.read_bytes(), content_type="text/html", charset="utf-8")


async def sample_stats(state: State) -> None:
    m = state.metrics
    while True:
        backends = state.fleet.describe()
        state.stats.sample(backends)
        for b in backends:
            m.backend_cache_bytes.labels(b["id"]).set(b["cache_bytes"])
            m.backend_cache_unshared.labels(b["id"]).set(b.get("cache_bytes_unshared", 0))
            m.backend_queue_depth.labels(b["id"]).set(b["queue_depth"])
        await asyncio.sleep(SERIES_PERIOD)


async def metrics(request: web.Request) -> web.Response:
    state = state_of(request)
    state.metrics.set_models(state.models.stats())  # as fresh as the proxy's view
    return web.Response(body=state.metrics.render(), content_type="text/plain", charset="utf-8")


_OPENAPI = orjson.dumps(openapi.spec("proxy"))


async def openapi_json(request: web.Request) -> web.Response:
    return web.Response(body=_OPENAPI, content_type="application/json")


def fetch_settings(config: ProxyConfig) -> FetchSettings:
    return FetchSettings(enabled=config.fetch_images, allow=tuple(config.fetch_images_allow),
                         timeout=config.fetch_images_timeout,
                         max_bytes=config.fetch_images_max_bytes)


def create_app(config: ProxyConfig) -> web.Application:
    registry = Registry(config.redis_url, lookup_timeout=config.lookup_timeout)
    policy = make_policy(PolicyConfig(name=config.policy, locality_slack=config.locality_slack))
    on_demand = loading.OnDemand(ModelLoads(config.redis_url), config.load_timeout)
    counters, stats_ = ProxyMetrics(), Stats(teams(config.api_keys))
    counters.know_teams(teams(config.api_keys), LIMITS)
    state = State(config, registry, policy, counters, Fleet(), on_demand, stats=stats_,
                  limits=Limits(config, counters, stats_),
                  fingerprint=prefix.fingerprint(config.secret, config.block_bytes),
                  images=ImageFetcher(fetch_settings(config)))
    # Outermost first: the per-API count sees final statuses, after Messages errors took
    # Anthropic's envelope.
    app = web.Application(middlewares=[apis.count_middleware(state.metrics, state.stats),
                                       messages.error_envelope_middleware,
                                       error_middleware, auth_middleware],
                          client_max_size=config.max_body_bytes)
    app[STATE_KEY] = state
    app[GATEWAY] = Gateway(route_chat, ask_backend,
                           ResponseStore(registry, config.secret, config.response_ttl))
    app.router.add_post(CHAT_PATH, route_request)
    app.router.add_post(COMPLETIONS_PATH, route_request)
    responses.add_routes(app)
    messages.add_routes(app)
    app.router.add_get(MODELS_PATH, models)
    app.router.add_get(MODELS_PATH + "/{model:.+}", model_info)
    app.router.add_get(HEALTH_PATH, health)
    app.router.add_post(EMBEDDINGS_PATH, embeddings)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi_json)
    app.router.add_get("/stats", stats)
    app.router.add_get("/dashboard", dashboard)
    app.on_startup.append(_startup)
    app.on_shutdown.append(_shutdown)
    app.on_cleanup.append(_cleanup)
    return app


async def _shutdown(app: web.Application) -> None:
    # Before aiohttp waits for the handlers: a request held for a load or a restart
    # is answered now (503, or its stream's error event), not cut when the wait ends.
    app[STATE_KEY].models.closing = True


async def _startup(app: web.Application) -> None:
    state = app[STATE_KEY]
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=state.config.connect_timeout,
                                    sock_read=state.config.request_timeout)
    # No connection cap: backends apply their own queue limits (and answer 429).
    state.session = aiohttp.ClientSession(timeout=timeout,
                                          connector=aiohttp.TCPConnector(limit=0),
                                          auto_decompress=False)
    await state.images.start()
    state.tasks.append(asyncio.create_task(refresh_backends(state)))
    state.tasks.append(asyncio.create_task(sample_stats(state)))
    state.tasks.append(asyncio.create_task(state.models.refresh_loop()))
    if state.limits.counters is not None:
        state.tasks.append(asyncio.create_task(state.limits.renew_loop()))


async def _cleanup(app: web.Application) -> None:
    state = app[STATE_KEY]
    tasks = state.tasks + [b.watch for b in state.fleet.backends.values() if b.watch]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if state.session is not None:
        await state.session.close()
    await state.images.close()
    await state.registry.close()
    await state.models.states.close()
    await state.limits.close()


async def serve(config: ProxyConfig, socks: list | None = None) -> None:
    """Serve until stopped, on `socks` (bound by the caller before the event loop runs,
    so a port that cannot be had fails before any background task exists) or on
    config's host and port."""
    runner = await start_site(create_app(config), config.host, config.port, socks)
    log.info("proxy on http://%s:%d (policy %s, registry %s)", config.host, config.port,
             config.policy, config.redis_url)
    await wait_for_stop()
    await runner.cleanup()


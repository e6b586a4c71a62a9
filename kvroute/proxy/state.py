"""The proxy's configuration and its per-process state, shared by every request handler."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from kvroute.core.images import MAX_IMAGE_BYTES
from kvroute.core.registry import Registry

from .fleet import Fleet
from .image_fetch import FetchSettings, ImageFetcher
from .limits import Limits
from .loading import OnDemand
from .observe.metrics import ProxyMetrics
from .policy.interface import RoutingPolicy
from .policy.recent import LiveRoutes, RecentChoices
from .observe.stats import Stats

STATE_KEY = web.AppKey("state", object)


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
    mark_ttl_ms: int = 3000
    suspect_seconds: float = 5.0
    refresh_period: float = 1.0
    forget_after: float = 10.0  # seconds a backend absent from the registry stays a fallback
    probe_timeout: float = 1.0  # /health deadline when checking a backend whose record lapsed
    response_ttl: float = 86400.0  # seconds a stored /v1/responses answer can be continued from
    load_timeout: float = 300.0  # seconds a request waits while its model loads on demand
    # Usage limits (proxy/limits.py): (target, value) pairs, as kvroute/config.py parses them.
    requests_per_minute: list = field(default_factory=list)
    tokens_per_minute: list = field(default_factory=list)
    tokens_per_day: list = field(default_factory=list)
    concurrent_requests: list = field(default_factory=list)
    allowed_models: list = field(default_factory=list)
    limit_timeout_ms: float = 250.0  # a limit check waits this long for Redis, then decides alone
    # Images by URL (proxy/image_fetch.py): off unless the operator turns it on.
    fetch_images: bool = False
    fetch_images_allow: list = field(default_factory=list)  # hosts and networks, else public only
    fetch_images_timeout: float = 10.0  # seconds per image, redirects included
    fetch_images_max_bytes: int = MAX_IMAGE_BYTES



@dataclass
class State:
    config: ProxyConfig
    registry: Registry
    policy: RoutingPolicy
    metrics: ProxyMetrics
    fleet: Fleet  # what this proxy knows of each backend
    models: OnDemand  # configured models of `kvroute serve` deployments, loaded on demand
    recent: RecentChoices = field(default_factory=RecentChoices)
    live: LiveRoutes = field(default_factory=LiveRoutes)  # conversations' last backends
    stats: Stats = field(default_factory=Stats)
    limits: Limits | None = None  # usage limits per API key or scope (None: no rule set)
    session: aiohttp.ClientSession | None = None
    # Fetches image URLs when the operator enabled it; refuses them otherwise.
    images: ImageFetcher = field(default_factory=lambda: ImageFetcher(FetchSettings()))
    tasks: list[asyncio.Task] = field(default_factory=list)
    background: set = field(default_factory=set)
    fingerprint: dict = field(default_factory=dict)  # this proxy's (kvroute.core.prefix.fingerprint)


def state_of(request: web.Request) -> State:
    return request.app[STATE_KEY]



def spawn(state: State, coro) -> None:
    # Keep a reference: the loop holds tasks weakly, and a collected task never runs.
    task = asyncio.ensure_future(coro)
    state.background.add(task)
    task.add_done_callback(state.background.discard)


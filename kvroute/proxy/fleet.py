"""The fleet view: what this proxy knows of the live backends between registry answers,
and the watches and /health probes that tell a stopped backend from a slow one."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from kvroute.api.wire import HEALTH_PATH
from kvroute.core.prefix import DEFAULT_LAYOUT, PREFIX_SCHEME, Layout
from kvroute.core.registry import BackendRecord, Registry, RegistryUnavailable

from .observe.metrics import ProxyMetrics

log = logging.getLogger("kvroute.proxy")


class FleetState(Protocol):
    """What the fleet's functions read of the proxy's state (proxy/state.py's State):
    named here so that this module need not import the one that imports it."""

    registry: Registry
    backends: "Backends"
    config: Any  # ProxyConfig: forget_after, refresh_period, probe_timeout
    metrics: ProxyMetrics
    session: aiohttp.ClientSession
    fingerprint: dict


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
    # backend id -> (instance id, mismatched fingerprint field or None), as last checked
    mismatch: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)
    # model -> its chat template's layout, as its backends last published it. Kept when
    # they are forgotten: a model loaded again comes back with the same template.
    layouts: dict[str, Layout] = field(default_factory=dict)

    def update(self, records: list[BackendRecord], keep_for: float) -> None:
        # A backend missing from one answer (Redis restarted empty, heartbeat not yet
        # back) stays known for keep_for seconds; failover covers one that really died.
        now = time.monotonic()
        for r in records:
            self.records[r.backend_id] = r
            self.seen[r.backend_id] = now
            self.absent_since.pop(r.backend_id, None)
            self._learn_layout(r)
        for bid in self.seen:
            if self.seen[bid] != now:
                self.absent_since.setdefault(bid, now)
        for bid in [b for b, t in self.absent_since.items() if now - t > keep_for]:
            del self.seen[bid], self.absent_since[bid]
            self.records.pop(bid, None)
        self.refreshed = time.time()
        self.refreshed_at = now

    def _learn_layout(self, r: BackendRecord) -> None:
        if r.prefix_scheme != PREFIX_SCHEME:
            return  # its keys can never match ours, whatever the layout
        try:
            layout = Layout(r.tools_at, r.system_at, r.tools_mark)
        except ValueError:  # not one this proxy knows: a newer scheme, refused above
            return
        for model in r.models:
            self.layouts[model] = layout

    def layout(self, model: str) -> Layout:
        """Where `model`'s chat template renders tools and system prompt: what the
        request's chain must follow to meet the keys its backends advertise; tools
        first until one of them is known."""
        return self.layouts.get(model, DEFAULT_LAYOUT)

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



async def refresh_backends(state: FleetState) -> None:
    """Keep the last known live backends: the fallback when Redis does not answer."""
    while True:
        try:
            records = await state.registry.live_backends()
            state.backends.update(records, keep_for=state.config.forget_after)
            for r in records:
                check_fingerprint(state, r)
        except RegistryUnavailable as exc:
            log.debug("live backends unavailable: %s", exc)
        except Exception:
            log.exception("refreshing live backends failed")
        await asyncio.sleep(state.config.refresh_period)



# -- fingerprints: can a backend's prefix keys match ours? ----------------------------


def fingerprint_mismatch(own: dict, r: BackendRecord) -> str | None:
    """The first fingerprint field where a backend's record differs from this proxy's
    (scheme, block size, secret), None when its keys can match ours."""
    for name in ("prefix_scheme", "block_bytes", "secret_tag"):
        if getattr(r, name) != own[name]:
            return "secret" if name == "secret_tag" else name
    return None


_WHAT = {"secret": "secret", "block_bytes": "block size", "prefix_scheme": "prefix-key scheme"}


def check_fingerprint(state: FleetState, r: BackendRecord) -> str | None:
    """A mismatched backend is ignored for cache matching: logged loudly once per
    instance, counted in a metric and shown on the dashboard."""
    what = fingerprint_mismatch(state.fingerprint, r)
    b = state.backends
    if b.mismatch.get(r.backend_id, (None, None)) != (r.instance_id, what):
        b.mismatch[r.backend_id] = (r.instance_id, what)
        for name in ("prefix_scheme", "block_bytes", "secret"):
            state.metrics.fingerprint_mismatch.labels(r.backend_id, name).set(name == what)
        if what is not None:
            theirs = {"secret": f"secret tag {r.secret_tag}", "block_bytes": f"{r.block_bytes} bytes",
                      "prefix_scheme": f"version {r.prefix_scheme}"}[what]
            log.warning("backend %s (%s) uses another %s than this proxy (%s): its prefix keys can "
                        "never match ours, so its cache is ignored for routing; give every proxy "
                        "and backend the same --secret and --block-bytes",
                        r.backend_id, r.url, _WHAT[what], theirs)
    return what


def describe(state: FleetState) -> list[dict]:
    b = state.backends
    return [
        {"id": r.backend_id, "url": r.url, "models": r.models, "queue_depth": r.queue_depth,
         "waiting": r.waiting, "running": r.running,
         "inflight": b.inflight.get(r.backend_id, 0), "suspect": b.is_suspect(r.backend_id),
         "prefill_tps": r.prefill_tps, "cache_bytes": r.cache_bytes, "cache_budget": r.cache_budget,
         "decoding": r.decoding, "max_batch": r.max_batch, "bytes_per_token": r.bytes_per_token,
         "mismatch": b.mismatch.get(r.backend_id, (None, None))[1],
         "tools_at": r.tools_at, "system_at": r.system_at, "tools_mark": r.tools_mark,
         "disk_bytes": r.disk_bytes, "disk_budget": r.disk_budget, "restore_tps": r.restore_tps,
         "ram_hits": r.ram_hits, "disk_hits": r.disk_hits}
        for r in sorted(b.records.values(), key=lambda r: r.backend_id)
    ]



# -- watches: is a silent backend gone? ---------------------------------------------


def watch_of(state: FleetState, bid: str, url: str) -> asyncio.Future:
    """The shared watch of backend `bid`; a new one once the last has fired."""
    watches = state.backends.watches
    watch = watches.get(bid)
    if watch is None or watch.done():
        watch = watches[bid] = asyncio.ensure_future(_watch(state, bid, url))
    return watch


async def _watch(state: FleetState, bid: str, url: str) -> None:
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


async def _answers(state: FleetState, bid: str, url: str) -> bool:
    """Whether `url`/health answers; one probe per backend at a time, its result
    shared by every request waiting on that backend for a refresh period."""
    b = state.backends
    now = time.monotonic()
    probe = b.probes.get(bid)
    if probe is None or (probe[1].done() and now - probe[0] > state.config.refresh_period):
        probe = b.probes[bid] = (now, asyncio.ensure_future(_probe(state, url)))
    return await asyncio.shield(probe[1])


async def _probe(state: FleetState, url: str) -> bool:
    try:
        timeout = aiohttp.ClientTimeout(total=state.config.probe_timeout)
        async with state.session.get(url + HEALTH_PATH, timeout=timeout) as r:
            return r.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False


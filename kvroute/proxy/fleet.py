"""The fleet view: what this proxy knows of each backend between registry answers (one
`Backend` each, from which a policy's `Candidate` is read), and the watches and /health
probes that tell a stopped backend from a slow one."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from kvroute.api.routes import HEALTH_PATH
from kvroute.core.prefix import DEFAULT_LAYOUT, PREFIX_SCHEME, Layout
from kvroute.core.registry import BackendRecord, Registry, RegistryUnavailable

from .observe.metrics import ProxyMetrics
from .policy.interface import ROUTE_REASONS, Candidate, Load

log = logging.getLogger("kvroute.proxy")


class FleetState(Protocol):
    """What the fleet's functions read of the proxy's state (proxy/state.py's State):
    named here so that this module need not import the one that imports it."""

    registry: Registry
    fleet: "Fleet"
    config: Any  # ProxyConfig: forget_after, refresh_period, probe_timeout
    metrics: ProxyMetrics
    session: aiohttp.ClientSession
    fingerprint: dict


@dataclass(eq=False)
class Backend:
    """One backend as this proxy sees it: its last record (what it reports of itself,
    through the registry) and what only this proxy knows of it."""

    record: BackendRecord
    # time.monotonic() when the registry last listed it live; None while it is not
    # listed: known from a lookup only, or forgotten with requests still open there.
    listed_at: float | None = None
    # Since when the registry's answers have left it out. Only answers count: while
    # Redis is unreachable nobody ages, so after an outage longer than forget_after
    # the fleet is still known when Redis answers again, empty.
    absent_since: float | None = None
    inflight: int = 0  # requests this proxy has open there
    unanswered_tokens: float = 0.0  # prefill tokens this proxy sent there, not yet answered
    suspect_until: float = 0.0  # time.monotonic(): it failed before answering; used last till then
    # (instance id, mismatched fingerprint field or None), as last checked
    mismatch: tuple[str | None, str | None] = (None, None)
    watch: asyncio.Future | None = None  # shared by its requests: is it gone? (watch_of)
    probe: tuple[float, asyncio.Future] | None = None  # the last /health probe: (start, answer)

    @property
    def id(self) -> str:
        return self.record.backend_id

    @property
    def url(self) -> str:
        return self.record.url

    def is_suspect(self) -> bool:
        return self.suspect_until > time.monotonic()

    def load(self, report: BackendRecord | None = None) -> Load:
        """How busy it is: what it reports (`report`, a lookup's record, else the last
        one listed) and what this proxy has sent there."""
        r = report or self.record
        return Load(unanswered_tokens=self.unanswered_tokens, inflight=self.inflight,
                    waiting=r.waiting, running=r.running, prefill_tps=r.prefill_tps,
                    bytes_per_token=r.bytes_per_token, decoding=r.decoding,
                    max_batch=r.max_batch, decode_steps_per_s=r.decode_steps_per_s,
                    reply_tokens=r.reply_tokens,
                    free_share=(max(0, r.cache_budget - r.cache_bytes) / r.cache_budget
                                if r.cache_budget > 0 else 0.0))

    def candidate(self, report: BackendRecord | None = None, advertised_depth: int = 0,
                  expected_depth: int = 0, disk_depth: int = 0) -> Candidate:
        """It as one candidate of a request, for the policy: its load, whether it is
        suspect, and how deep it holds the request's prefix (given by the lookup)."""
        r = report or self.record
        return Candidate(backend_id=r.backend_id, url=r.url, advertised_depth=advertised_depth,
                         expected_depth=expected_depth, load=self.load(r),
                         suspect=self.is_suspect(), disk_depth=disk_depth,
                         restore_tps=r.restore_tps)

    def describe(self) -> dict:
        """Its row in /health and /stats."""
        r = self.record
        return {
            "id": r.backend_id, "url": r.url, "models": r.models, "queue_depth": r.queue_depth,
            "waiting": r.waiting, "running": r.running,
            "inflight": self.inflight, "suspect": self.is_suspect(),
            "prefill_tps": r.prefill_tps, "cache_bytes": r.cache_bytes,
            "cache_budget": r.cache_budget, "cache_bytes_unshared": r.cache_bytes_unshared,
            "cache_blocks": r.cache_blocks, "decoding": r.decoding, "max_batch": r.max_batch,
            "bytes_per_token": r.bytes_per_token, "mismatch": self.mismatch[1],
            "tools_at": r.tools_at, "system_at": r.system_at, "tools_mark": r.tools_mark,
            "disk_bytes": r.disk_bytes, "disk_budget": r.disk_budget,
            "restore_tps": r.restore_tps, "ram_hits": r.ram_hits, "disk_hits": r.disk_hits}


@dataclass
class Fleet:
    """What this proxy knows of the fleet between registry answers: one `Backend` per
    backend the registry lists, or that a lookup named, or that has requests open."""

    backends: dict[str, Backend] = field(default_factory=dict)  # by id
    refreshed: float = 0.0
    refreshed_at: float = 0.0  # time.monotonic() of the last registry answer
    # model -> its chat template's layout, as its backends last published it. Kept when
    # they are forgotten: a model loaded again comes back with the same template.
    layouts: dict[str, Layout] = field(default_factory=dict)

    def update(self, records: list[BackendRecord], keep_for: float) -> None:
        # A backend missing from one answer (Redis restarted empty, heartbeat not yet
        # back) stays known for keep_for seconds; failover covers one that really died.
        now = time.monotonic()
        for r in records:
            b = self.view(r)
            b.record, b.listed_at, b.absent_since = r, now, None
            self._learn_layout(r)
        for b in list(self.backends.values()):
            if b.listed_at is not None and b.listed_at != now:
                if b.absent_since is None:
                    b.absent_since = now
                elif now - b.absent_since > keep_for:
                    b.listed_at = b.absent_since = None  # forgotten
            if b.listed_at is None and b.inflight == 0:
                self._drop(b)
        self.refreshed = time.time()
        self.refreshed_at = now

    def _drop(self, b: Backend) -> None:
        # No request of this proxy waits on its watch any more.
        del self.backends[b.id]
        if b.watch is not None:
            b.watch.cancel()

    def view(self, r: BackendRecord) -> Backend:
        """The backend of record `r` (a lookup's or the registry's list's): the fleet's
        own, or a new one, kept while listed or while requests are open there."""
        b = self.backends.get(r.backend_id)
        if b is None:
            b = self.backends[r.backend_id] = Backend(r)
        return b

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
        b = self.backends.get(backend_id)
        listed_at = b.listed_at if b is not None and b.listed_at is not None else 0.0
        return time.monotonic() - self.refreshed_at <= max_age and listed_at < self.refreshed_at

    def listed(self) -> list[Backend]:
        """The backends last known live."""
        return [b for b in self.backends.values() if b.listed_at is not None]

    def serving(self, model: str) -> list[Backend]:
        return [b for b in self.listed() if model in b.record.models]

    def models(self) -> list[str]:
        return sorted({m for b in self.listed() for m in b.record.models})

    def loaded_at(self) -> dict[str, float]:
        """Each model a live backend serves, and when the first of them still serving
        it loaded it (its `/v1/models` `created`): the same answer from every proxy."""
        out: dict[str, float] = {}
        for b in self.listed():
            for m in b.record.models:
                out[m] = min(out.get(m, b.record.started_at), b.record.started_at)
        return out

    def image_models(self) -> set[str]:
        """The models a live backend serves with images (vision-language models)."""
        return {m for b in self.listed() if b.record.images for m in b.record.models}

    def describe(self) -> list[dict]:
        """The rows of /health and /stats, by backend id."""
        return [b.describe() for b in sorted(self.listed(), key=lambda b: b.id)]


async def refresh_backends(state: FleetState) -> None:
    """Keep the last known live backends: the fallback when Redis does not answer."""
    while True:
        try:
            records = await state.registry.live_backends()
            state.fleet.update(records, keep_for=state.config.forget_after)
            for r in records:
                check_fingerprint(state, state.fleet.view(r), r)
                state.metrics.know_backend(r.backend_id, r.models, ROUTE_REASONS)
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


def check_fingerprint(state: FleetState, b: Backend, r: BackendRecord) -> str | None:
    """Whether backend `b`'s keys can match ours, by its record `r` (a lookup's or the
    registry's list's). A mismatched backend is ignored for cache matching: logged
    loudly once per instance, counted in a metric and shown on the dashboard."""
    what = fingerprint_mismatch(state.fingerprint, r)
    if b.mismatch != (r.instance_id, what):
        b.mismatch = (r.instance_id, what)
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


# -- watches: is a silent backend gone? ---------------------------------------------


def watch_of(state: FleetState, b: Backend) -> asyncio.Future:
    """The shared watch of backend `b`; a new one once the last has fired."""
    if b.watch is None or b.watch.done():
        b.watch = asyncio.ensure_future(_watch(state, b))
    return b.watch


async def _watch(state: FleetState, b: Backend) -> None:
    """Returns once backend `b` looks gone: the registry no longer lists it (its
    heartbeat lapsed) *and* its /health does not answer. Redis trouble alone never
    trips it: while the registry does not answer nothing counts as lapsed, and after
    Redis restarted empty the probe still finds the backend alive."""
    period = state.config.refresh_period
    lapsed = state.fleet.lapsed
    while True:
        await asyncio.sleep(period)
        # Asked again after the probe: a backend that just resumed may answer its
        # probe late but is listed again as soon as its next heartbeat lands.
        if lapsed(b.id, 3 * period) and not await _answers(state, b) and lapsed(b.id, 3 * period):
            return


async def _answers(state: FleetState, b: Backend) -> bool:
    """Whether its /health answers; one probe per backend at a time, its result
    shared by every request waiting on that backend for a refresh period."""
    now = time.monotonic()
    if b.probe is None or (b.probe[1].done() and now - b.probe[0] > state.config.refresh_period):
        b.probe = (now, asyncio.ensure_future(_probe(state, b.url)))
    return await asyncio.shield(b.probe[1])


async def _probe(state: FleetState, url: str) -> bool:
    try:
        timeout = aiohttp.ClientTimeout(total=state.config.probe_timeout)
        async with state.session.get(url + HEALTH_PATH, timeout=timeout) as r:
            return r.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False


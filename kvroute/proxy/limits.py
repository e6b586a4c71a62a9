"""Usage limits per API key or scope: requests a minute, tokens (prompt and generated) a
minute and a UTC day, requests in flight, and the models it may use (the settings of
kvroute/config.py). Over a limit a request gets a 429 with `Retry-After`, in its API's
error envelope (Anthropic's under /v1/messages: that middleware rewrites every error);
a model it may not use, a 403.

Which rule applies: the one naming the request's API key, else its scope's, else `*`'s,
which counts each team (scope, or `other` without one) apart. Every proxy counts in the
same Redis keys (kvroute/core/limit_counters.py), so a limit holds across proxies.
Tokens are charged when the answer ends: a request is admitted while its team is under
its token limits, and may take it past them.

With Redis down or slower than `--limit-timeout-ms`, each proxy decides alone from its own
counts of the same windows (docs/DESIGN.md invariant 4: Redis is never needed to serve):
a team may then get up to its limits through each proxy, never more than that, and the
counts of an outage are not merged back into Redis.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvroute.api.errors import APIError
from kvroute.config import LIMIT_NAMES
from kvroute.core.limit_counters import LEASE_MS, LimitCounters, LimitsUnavailable

from .teams import team_of

log = logging.getLogger("kvroute.proxy.limits")

ANY = "*"
MODEL_LIMIT = "allowed_models"
LIMITS = LIMIT_NAMES  # the `limit` label of refusals: one per setting


@dataclass(frozen=True)
class Rule:
    requests_per_minute: int = 0  # 0: no such limit
    tokens_per_minute: int = 0
    tokens_per_day: int = 0
    concurrent_requests: int = 0
    allowed_models: frozenset[str] | None = None  # None: any model

    @property
    def counts(self) -> bool:
        """Whether it limits anything the counters keep (not only models)."""
        return bool(self.requests_per_minute or self.tokens_per_minute or self.tokens_per_day
                    or self.concurrent_requests)


def rules_of(config: Any) -> dict[str, Rule]:
    """target -> its rule, from the (target, value) pairs of each limit setting."""
    values: dict[str, dict] = defaultdict(dict)
    for name in LIMIT_NAMES:
        for target, value in getattr(config, name):
            values[target][name] = frozenset(value) if name == MODEL_LIMIT else value
    return {target: Rule(**kw) for target, kw in values.items()}


@dataclass
class Admission:
    subject: str  # whose counters: "scope:<team>" or "key:<hash>"
    team: str
    rule: Rule
    request_id: str
    shared: bool  # counted in Redis (False: by this proxy alone)


class LocalCounts:
    """The same windows as the Redis scripts, counted by this proxy alone (Redis down)."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], tuple[int, int]] = {}  # (subject, kind) -> (window, n)
        self.open: dict[str, set[str]] = defaultdict(set)

    def _get(self, subject: str, kind: str, window: int) -> int:
        found = self.counts.get((subject, kind))
        return found[1] if found and found[0] == window else 0

    def _add(self, subject: str, kind: str, window: int, n: int) -> None:
        self.counts[(subject, kind)] = (window, self._get(subject, kind, window) + n)

    def admit(self, a: Admission) -> tuple[str, float]:
        now = time.time()
        minute, day = int(now // 60), int(now // 86400)
        r = a.rule
        if r.tokens_per_day and self._get(a.subject, "tpd", day) >= r.tokens_per_day:
            return "tokens_per_day", 86400 - now % 86400
        if r.tokens_per_minute and self._get(a.subject, "tpm", minute) >= r.tokens_per_minute:
            return "tokens_per_minute", 60 - now % 60
        if r.requests_per_minute and self._get(a.subject, "rpm", minute) >= r.requests_per_minute:
            return "requests_per_minute", 60 - now % 60
        if r.concurrent_requests:
            if len(self.open[a.subject]) >= r.concurrent_requests:
                return "concurrent_requests", 1.0
            self.open[a.subject].add(a.request_id)
        self._add(a.subject, "rpm", minute, 1)
        return "", 0.0

    def charge(self, subject: str, tokens: int) -> None:
        now = time.time()
        self._add(subject, "tpm", int(now // 60), tokens)
        self._add(subject, "tpd", int(now // 86400), tokens)

    def release(self, subject: str, request_id: str) -> None:
        self.open[subject].discard(request_id)


class Limits:
    def __init__(self, config: Any, metrics: Any, stats: Any):
        self.rules = rules_of(config)
        self.metrics, self.stats = metrics, stats
        self.counters = (LimitCounters(config.redis_url, config.limit_timeout_ms / 1000)
                         if any(r.counts for r in self.rules.values()) else None)
        self.local = LocalCounts()
        self.in_flight: dict[str, set[str]] = defaultdict(set)  # Redis-admitted, with leases
        self._tasks: set[asyncio.Task] = set()

    def rule_for(self, request: web.Request) -> tuple[str, Rule] | None:
        """(subject, rule) of the request's key, scope or team; None when none applies."""
        key, scope = request.get("api_key"), request.get("scope")
        if key and key in self.rules:
            return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16], self.rules[key]
        if scope and scope in self.rules:
            return "scope:" + scope, self.rules[scope]
        if ANY in self.rules:
            return "scope:" + team_of(scope), self.rules[ANY]
        return None

    def allows(self, request: web.Request, model: str) -> bool:
        found = self.rule_for(request) if self.rules else None
        return found is None or found[1].allowed_models is None or model in found[1].allowed_models

    def check_model(self, request: web.Request, model: str) -> None:
        if not self.allows(request, model):
            self._refused(request, MODEL_LIMIT)
            raise APIError(403, f"This API key may not use the model '{model[:200]}'.",
                           "permission_error", "model", "model_not_allowed")

    async def admit(self, request: web.Request, model: str) -> Admission | None:
        """Count the request under its rule, or raise the 429 (403) of the limit it is over."""
        if not self.rules:
            return None
        found = self.rule_for(request)
        if found is None:
            return None
        self.check_model(request, model)
        subject, rule = found
        if not rule.counts:
            return None
        a = Admission(subject, team_of(request.get("scope")), rule, uuid.uuid4().hex, True)
        try:
            limit, wait = await self.counters.admit(
                subject, a.request_id, requests_per_minute=rule.requests_per_minute,
                tokens_per_minute=rule.tokens_per_minute, tokens_per_day=rule.tokens_per_day,
                concurrent=rule.concurrent_requests)
        except LimitsUnavailable as exc:
            log.debug("usage limits: Redis did not answer (%s); deciding alone", exc)
            self.metrics.limits_local.inc()
            a.shared = False
            limit, wait = self.local.admit(a)
        if limit:
            self._refused(request, limit)
            err = APIError(429, f"Usage limit reached: {limit.replace('_', ' ')} of this API "
                           f"key's {'key' if subject.startswith('key:') else 'team'}; retry in "
                           f"{max(1, round(wait))} s.", "rate_limit_error", None, limit)
            err.retry_after = wait  # type: ignore[attr-defined]  (the Retry-After header)
            raise err
        if a.shared and rule.concurrent_requests:
            self.in_flight[subject].add(a.request_id)
        return a

    def _refused(self, request: web.Request, limit: str) -> None:
        team = team_of(request.get("scope"))
        self.metrics.child(self.metrics.limited, team, limit).inc()
        self.stats.count_limited(team, limit)

    def end(self, a: Admission | None, tokens: int) -> None:
        """The request ended: its tokens charged, its place in flight given back."""
        if a is None:
            return
        r = a.rule
        charge = tokens > 0 and (r.tokens_per_minute or r.tokens_per_day)
        if not a.shared:
            if charge:
                self.local.charge(a.subject, tokens)
            self.local.release(a.subject, a.request_id)
            return
        self.in_flight[a.subject].discard(a.request_id)
        if charge or r.concurrent_requests:
            self._spawn(self._end_shared(a, tokens if charge else 0))

    async def _end_shared(self, a: Admission, tokens: int) -> None:
        try:
            if tokens:
                await self.counters.charge(a.subject, tokens, bool(a.rule.tokens_per_minute),
                                           bool(a.rule.tokens_per_day))
            if a.rule.concurrent_requests:
                await self.counters.release(a.subject, a.request_id)
        except LimitsUnavailable:
            # The lease lapses by itself; the tokens count here, until Redis is back.
            self.local.charge(a.subject, tokens)

    async def renew_loop(self) -> None:
        """Keep the leases of this proxy's requests in flight (a dead proxy's lapse)."""
        while True:
            await asyncio.sleep(LEASE_MS / 3000)
            for subject, ids in list(self.in_flight.items()):
                try:
                    await self.counters.renew(subject, list(ids))
                except LimitsUnavailable:
                    pass

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.counters is not None:
            await self.counters.close()

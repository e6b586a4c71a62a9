"""The routing policies: which backend serves a request.

Every policy is a pure function of a `RouteContext` (the candidates and the request)
to a `Decision`, behind the one `RoutingPolicy` protocol; the server builds the
context, asks `choose`, and never names a policy.

`cache-aware` (the default) estimates, for every live backend serving the model,
the time to first token:

    ttft = queue wait + (prompt tokens - matched tokens) / prefill rate

where matched tokens come from the registry's prefix depth (advertised, or expected
from routing marks and this proxy's recent choices) and the queue wait from the
prefill work this proxy has sent there and not yet seen answered, plus what the
backend reports queued. It picks the lowest. A backend holding a deeper prefix is
still preferred while its estimate stays within `locality_slack` seconds of the best
one: keeping a conversation (or a burst sharing a new system prompt) on one backend
pays off on every later turn, until that backend's queue costs more than
re-prefilling elsewhere.

`round-robin`, `least-loaded` and `random` are there for comparison.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Protocol

POLICIES = ("cache-aware", "round-robin", "least-loaded", "random")


@dataclass(frozen=True)
class Load:
    """How busy a backend is, as this proxy sees it."""

    unanswered_tokens: float = 0.0  # prefill tokens this proxy sent there, not yet answered
    inflight: int = 0  # requests this proxy has open there
    waiting: int = 0  # backend-reported (all proxies): accepted, not yet in its batch
    running: int = 0  # backend-reported (all proxies): in its batch, prefilling or decoding
    prefill_tps: float = 0.0  # backend-measured; 0 = unknown

    @property
    def reported_queue(self) -> int:
        return self.waiting + self.running


@dataclass(frozen=True)
class Candidate:
    """One backend that could serve the request."""

    backend_id: str
    url: str
    advertised_depth: int = 0  # leading chain blocks the backend published as cached
    # Leading blocks expected there soon: routing marks in Redis (any proxy) or this
    # proxy's recent choices. Above advertised_depth only while a prefill is under way.
    expected_depth: int = 0
    load: Load = field(default_factory=Load)
    suspect: bool = False  # failed recently: used only when nothing else is left
    disk_depth: int = 0  # leading blocks its disk tier holds: restorable, slower than RAM
    restore_tps: float = 0.0  # backend-measured tokens/s restored from disk; 0 = unknown

    @property
    def depth(self) -> int:
        """Blocks the policy counts as matched: advertised or expected."""
        return max(self.advertised_depth, self.expected_depth)

    @property
    def expected_only(self) -> bool:
        """The deepest match is a routing-time expectation, not yet a commit."""
        return self.expected_depth > self.advertised_depth


@dataclass(frozen=True)
class RouteContext:
    candidates: list[Candidate]
    chain: list[int]  # the request's prefix keys; key 0 is the model's shared header
    ends: list[int]  # request byte offset where each chain block ends
    request_bytes: int
    registry_known: bool  # False: the registry did not answer, depths are all 0

    def matched_bytes(self, c: Candidate) -> int:
        """Request bytes the candidate's match covers beyond the shared header: block 0
        (salt and model) is common to every request of the model, matching it alone is
        no hit."""
        return self._covered(c.depth)

    def restore_bytes(self, c: Candidate) -> int:
        """Request bytes beyond the candidate's match that its disk tier would restore."""
        return max(0, self._covered(c.disk_depth) - self.matched_bytes(c))

    def _covered(self, depth: int) -> int:
        d = min(depth, len(self.ends))
        return self.ends[d - 1] - self.ends[0] if d > 1 else 0


@dataclass(frozen=True)
class Decision:
    candidate: Candidate
    reason: str  # cache-hit, pending-hit, load, no-registry, round-robin, least-loaded, random
    prefill_tokens: float = 0.0  # estimated tokens the backend must prefill
    ttft_estimate: float = 0.0
    predicted_tokens: int = 0  # estimated cached tokens
    # Record the choice (routing marks in Redis, this proxy's recent choices) so that
    # requests sharing the prefix follow it before the backend advertises it.
    mark: bool = False


@dataclass
class PolicyConfig:
    name: str = "cache-aware"
    bytes_per_token: float = 4.0  # no tokenizer in the proxy: text bytes stand in for tokens
    default_prefill_tps: float = 1000.0  # for a backend that has not measured itself yet
    locality_slack: float = 1.0  # seconds of extra estimated TTFT accepted to keep a prefix hit
    per_request_wait: float = 0.02  # seconds a queued request of another proxy is assumed to cost
    default_restore_tps: float = 20000.0  # tokens/s from a disk tier that has not restored yet


class RoutingPolicy(Protocol):
    name: str
    config: PolicyConfig

    def choose(self, ctx: RouteContext) -> Decision: ...


class _Base:
    name = ""

    def __init__(self, config: PolicyConfig):
        self.config = config
        self._tie = itertools.count()  # spreads equal candidates instead of taking the first

    def tokens(self, nbytes: int) -> float:
        return nbytes / self.config.bytes_per_token

    def unmatched_tokens(self, ctx: RouteContext, c: Candidate) -> float:
        reach = ctx.matched_bytes(c) + ctx.restore_bytes(c)
        return self.tokens(max(0, ctx.request_bytes - reach))

    def ttft(self, ctx: RouteContext, c: Candidate) -> float:
        """Queue, then the restore of what only the disk tier holds, then the prefill of
        the rest: a RAM hit beats the same hit from disk, which beats a cold prefill."""
        rate = c.load.prefill_tps or self.config.default_prefill_tps
        others = max(0, c.load.reported_queue - c.load.inflight)  # requests other proxies sent
        restore = self.tokens(ctx.restore_bytes(c)) / (c.restore_tps or self.config.default_restore_tps)
        return ((c.load.unanswered_tokens + self.unmatched_tokens(ctx, c)) / rate + restore
                + others * self.config.per_request_wait)

    def decide(self, ctx: RouteContext, c: Candidate, reason: str, **kw) -> Decision:
        return Decision(c, reason, self.unmatched_tokens(ctx, c), **kw)

    @staticmethod
    def pool(ctx: RouteContext) -> list[Candidate]:
        """Order is irrelevant; suspects are used only when nothing else is left."""
        if not ctx.candidates:
            raise ValueError("no candidates to choose from")
        return [c for c in ctx.candidates if not c.suspect] or list(ctx.candidates)

    def least_loaded(self, pool: list[Candidate]) -> Candidate:
        return min(pool, key=lambda c: (c.load.inflight + c.load.reported_queue,
                                        c.load.unanswered_tokens, next(self._tie)))


class RoundRobin(_Base):
    name = "round-robin"

    def choose(self, ctx: RouteContext) -> Decision:
        pool = sorted(self.pool(ctx), key=lambda c: c.backend_id)
        return self.decide(ctx, pool[next(self._tie) % len(pool)], "round-robin")


class Random(_Base):
    name = "random"

    def __init__(self, config: PolicyConfig, rng: random.Random | None = None):
        super().__init__(config)
        self._random = rng or random.Random()

    def choose(self, ctx: RouteContext) -> Decision:
        return self.decide(ctx, self._random.choice(self.pool(ctx)), "random")


class LeastLoaded(_Base):
    name = "least-loaded"

    def choose(self, ctx: RouteContext) -> Decision:
        reason = "least-loaded" if ctx.registry_known else "no-registry"
        return self.decide(ctx, self.least_loaded(self.pool(ctx)), reason)


class CacheAware(_Base):
    name = "cache-aware"

    def choose(self, ctx: RouteContext) -> Decision:
        pool = self.pool(ctx)
        if not ctx.registry_known:
            chosen = self.least_loaded(pool)
            return self.decide(ctx, chosen, "no-registry", mark=self._needs_mark(ctx, chosen))
        tie = next(self._tie)
        scored = sorted(
            ((self.ttft(ctx, c), c.load.inflight + c.load.reported_queue, (i - tie) % len(pool), c)
             for i, c in enumerate(sorted(pool, key=lambda c: c.backend_id))),
            key=lambda t: t[:3],
        )
        best_ttft, _, _, best = scored[0]
        def reach(c: Candidate) -> int:  # RAM or disk
            return ctx.matched_bytes(c) + ctx.restore_bytes(c)

        deepest = max(pool, key=lambda c: (reach(c), -self.ttft(ctx, c)))
        chosen, est = best, best_ttft
        if reach(deepest) > reach(best):
            deep_ttft = self.ttft(ctx, deepest)
            if deep_ttft <= best_ttft + self.config.locality_slack:
                chosen, est = deepest, deep_ttft
        matched = reach(chosen)
        if not matched:
            reason = "load"
        elif ctx.restore_bytes(chosen):
            reason = "disk-hit"
        else:
            # "pending-hit": the label users see in metrics and the dashboard.
            reason = "pending-hit" if chosen.expected_only else "cache-hit"
        return self.decide(ctx, chosen, reason, ttft_estimate=est,
                           predicted_tokens=int(self.tokens(matched)),
                           mark=self._needs_mark(ctx, chosen))

    @staticmethod
    def _needs_mark(ctx: RouteContext, chosen: Candidate) -> bool:
        # Only a prefix the chosen backend does not hold yet needs marking.
        return chosen.advertised_depth < len(ctx.chain)


_CLASSES: dict[str, type[_Base]] = {
    p.name: p for p in (CacheAware, RoundRobin, LeastLoaded, Random)}


def make_policy(config: PolicyConfig) -> RoutingPolicy:
    cls = _CLASSES.get(config.name)
    if cls is None:
        raise ValueError(f"unknown policy {config.name!r}; choose one of {', '.join(POLICIES)}")
    return cls(config)

"""The routing policies: which backend serves a request, one class each behind
`RoutingPolicy.choose()` (interface.py), found by name (`make_policy`).

`cache-aware` (the default) estimates, for every live backend serving the model,
the time to first token with the cost function of cost.py (queued work, decode
load, what the backend holds of the prompt, the model's calibrated prefill rate) and
places the request by the rules of placement.py: the cheapest wins, a backend
holding a deeper prefix is kept within `locality_slack` seconds, and candidates that
cost the same are told apart by free cache, then load.

Request bytes become tokens through the bytes per token the model's backends measure
and publish (their median; `bytes_per_token` until one has measured).

`round-robin`, `least-loaded` and `random` are there for comparison.
"""

from __future__ import annotations

import itertools
import random

from kvroute.config import POLICIES

from .cost import CostInput, calibrated_rate, cost, fleet_median
from .interface import Candidate, Decision, PolicyConfig, RouteContext, RoutingPolicy
from .placement import Option, Placer


class _Base:
    name = ""

    def __init__(self, config: PolicyConfig):
        self.config = config
        self._tie = itertools.count()  # spreads equal candidates instead of taking the first

    def bytes_per_token(self, ctx: RouteContext) -> float:
        """The model's measured bytes per token (median of its backends), else the default."""
        return (fleet_median([c.load.bytes_per_token for c in ctx.candidates])
                or self.config.bytes_per_token)

    def unmatched_tokens(self, ctx: RouteContext, c: Candidate, bpt: float = 0.0) -> float:
        return max(0, ctx.request_bytes - ctx.matched_bytes(c)) / (bpt or self.bytes_per_token(ctx))

    def decide(self, ctx: RouteContext, c: Candidate, reason: str, bpt: float = 0.0,
               **kw) -> Decision:
        return Decision(c, reason, self.unmatched_tokens(ctx, c, bpt), **kw)

    @staticmethod
    def pool(ctx: RouteContext) -> list[Candidate]:
        """Order is irrelevant; suspects are used only when nothing else is left."""
        if not ctx.candidates:
            raise ValueError("no candidates to choose from")
        return [c for c in ctx.candidates if not c.suspect] or list(ctx.candidates)

    def least_loaded(self, pool: list[Candidate]) -> Candidate:
        # Equally loaded backends take turns: a tie-break by position would send every
        # request of an idle fleet (Redis down, say) to the one listed first.
        def load(c: Candidate) -> tuple[int, float]:
            return c.load.inflight + c.load.reported_queue, c.load.unanswered_tokens
        least = min(map(load, pool))
        tied = sorted((c for c in pool if load(c) == least), key=lambda c: c.backend_id)
        return tied[next(self._tie) % len(tied)]


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

    def __init__(self, config: PolicyConfig):
        super().__init__(config)
        self._weights = config.weights()
        self._placer = Placer(slack=config.locality_slack)

    def calibration(self, ctx: RouteContext) -> tuple[float, float]:
        """The model's bytes per token and prefill rate: medians over its backends."""
        rate = fleet_median([x.load.prefill_tps for x in ctx.candidates])
        return self.bytes_per_token(ctx), rate or self._weights.default_prefill_tps

    def cost_input(self, ctx: RouteContext, c: Candidate,
                   calibration: tuple[float, float] | None = None) -> CostInput:
        """What the cost function sees of one candidate (cost.py)."""
        bpt, rate = calibration or self.calibration(ctx)
        w = self._weights
        load = c.load
        matched = ctx.matched_bytes(c)
        return CostInput(
            prompt_tokens=ctx.request_bytes / bpt, matched_tokens=matched / bpt,
            restore_tokens=ctx.restore_bytes(c, matched) / bpt, restore_tps=c.restore_tps,
            queued_tokens=load.unanswered_tokens,
            other_requests=max(0, load.reported_queue - load.inflight),  # other proxies' requests
            decoding=load.decoding, max_batch=load.max_batch,
            prefill_tps=calibrated_rate(load.prefill_tps, rate, w.rate_trust),
            decode_steps_per_s=load.decode_steps_per_s, reply_tokens=load.reply_tokens)

    def ttft(self, ctx: RouteContext, c: Candidate) -> float:
        return cost(self.cost_input(ctx, c), self._weights).ttft

    def choose(self, ctx: RouteContext) -> Decision:
        pool = self.pool(ctx)
        if not ctx.registry_known:
            chosen = self.least_loaded(pool)
            return self.decide(ctx, chosen, "no-registry", mark=self._needs_mark(ctx, chosen))
        calibration = self.calibration(ctx)
        inputs = [self.cost_input(ctx, c, calibration) for c in pool]
        options = [Option(cost(x, self._weights), x.matched_tokens + x.restore_tokens,
                          c.load.free_share, c.load.inflight + c.load.reported_queue, c.backend_id)
                   for c, x in zip(pool, inputs)]
        i = self._placer.place(options)
        chosen, option, x = pool[i], options[i], inputs[i]
        if not option.matched_tokens:
            reason = "load"
        elif x.restore_tokens:
            reason = "disk-hit"
        else:
            # "pending-hit": the label users see in metrics and the dashboard.
            reason = "pending-hit" if chosen.expected_only else "cache-hit"
        return self.decide(ctx, chosen, reason, calibration[0],
                           predicted_tokens=int(option.matched_tokens),
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

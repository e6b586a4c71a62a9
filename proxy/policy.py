"""The routing policy: which backend serves a request.

`cache-aware` (the default) estimates, for every live backend serving the model,
the time to first token:

    ttft = queue wait + (prompt tokens - matched tokens) / prefill rate

where matched tokens come from the registry's prefix depth (advertised or pending)
and the queue wait from the prefill work this proxy has sent there and not yet
seen answered, plus what the backend reports queued. It picks the lowest. A
backend holding a deeper prefix is still preferred while its estimate stays
within `locality_slack` seconds of the best one: keeping a conversation (or a
burst sharing a new system prompt) on one backend pays off on every later turn,
until that backend's queue costs more than re-prefilling elsewhere.

`round-robin`, `least-loaded` and `random` are there for comparison.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

POLICIES = ("cache-aware", "round-robin", "least-loaded", "random")


@dataclass
class Candidate:
    backend_id: str
    url: str
    depth: int = 0  # matched prefix blocks (advertised or pending)
    pending_only: bool = False  # the deepest match is a routing-time mark, not yet a commit
    matched_bytes: int = 0  # request bytes those blocks cover, beyond the shared header
    prefill_tps: float = 0.0  # backend-measured; 0 = unknown
    reported_queue: int = 0  # the backend's own queue depth (all proxies), from its heartbeat
    inflight: int = 0  # requests this proxy has open there
    pending_tokens: float = 0.0  # prefill work this proxy sent there, not yet answered
    suspect: bool = False


@dataclass
class Decision:
    candidate: Candidate
    reason: str  # cache-hit, pending-hit, load, no-registry, round-robin, least-loaded, random
    ttft_estimate: float = 0.0
    predicted_tokens: int = 0


@dataclass
class PolicyConfig:
    name: str = "cache-aware"
    bytes_per_token: float = 4.0  # no tokenizer in the proxy: text bytes stand in for tokens
    default_prefill_tps: float = 1000.0  # for a backend that has not measured itself yet
    locality_slack: float = 1.0  # seconds of extra estimated TTFT accepted to keep a prefix hit
    per_request_wait: float = 0.02  # seconds a queued request of another proxy is assumed to cost


class Policy:
    def __init__(self, config: PolicyConfig):
        if config.name not in POLICIES:
            raise ValueError(f"unknown policy {config.name!r}; choose one of {', '.join(POLICIES)}")
        self.config = config
        self._rr = itertools.count()
        self._random = random.Random()

    def tokens(self, nbytes: int) -> float:
        return nbytes / self.config.bytes_per_token

    def ttft(self, c: Candidate, request_bytes: int) -> float:
        rate = c.prefill_tps or self.config.default_prefill_tps
        unmatched = self.tokens(max(0, request_bytes - c.matched_bytes))
        others = max(0, c.reported_queue - c.inflight)  # requests other proxies sent there
        return (c.pending_tokens + unmatched) / rate + others * self.config.per_request_wait

    def choose(self, candidates: list[Candidate], request_bytes: int, registry_known: bool) -> Decision:
        """Order is irrelevant; suspects are used only when nothing else is left."""
        pool = [c for c in candidates if not c.suspect] or list(candidates)
        name = self.config.name
        if name == "round-robin":
            pool.sort(key=lambda c: c.backend_id)
            return Decision(pool[next(self._rr) % len(pool)], "round-robin")
        if name == "random":
            return Decision(self._random.choice(pool), "random")
        if name == "least-loaded" or not registry_known:
            best = min(pool, key=lambda c: (c.inflight + c.reported_queue, c.pending_tokens,
                                            next(self._rr)))
            return Decision(best, "least-loaded" if registry_known else "no-registry")
        return self._cache_aware(pool, request_bytes)

    def _cache_aware(self, pool: list[Candidate], request_bytes: int) -> Decision:
        # The tie-breaker counter spreads equal candidates instead of always taking the first.
        tie = next(self._rr)
        scored = sorted(
            ((self.ttft(c, request_bytes), c.inflight + c.reported_queue, (i - tie) % len(pool), c)
             for i, c in enumerate(sorted(pool, key=lambda c: c.backend_id))),
            key=lambda t: t[:3],
        )
        best_ttft, _, _, best = scored[0]
        deepest = max(pool, key=lambda c: (c.matched_bytes, -self.ttft(c, request_bytes)))
        chosen, est = best, best_ttft
        if deepest.matched_bytes > best.matched_bytes:
            deep_ttft = self.ttft(deepest, request_bytes)
            if deep_ttft <= best_ttft + self.config.locality_slack:
                chosen, est = deepest, deep_ttft
        if not chosen.matched_bytes:
            reason = "load"
        else:
            reason = "pending-hit" if chosen.pending_only else "cache-hit"
        return Decision(chosen, reason, est, int(self.tokens(chosen.matched_bytes)))

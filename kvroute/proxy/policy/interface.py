"""What a routing policy sees and answers: the interface every policy follows.

Every policy is a pure function of a `RouteContext` (the candidates and the request)
to a `Decision`, behind the one `RoutingPolicy` protocol; the router builds the
context, asks `choose`, and never names a policy (policies.py holds them, by name).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvroute.config import PROXY

from .cost import CostWeights


@dataclass(frozen=True)
class Load:
    """How busy a backend is, as this proxy sees it."""

    unanswered_tokens: float = 0.0  # prefill tokens this proxy sent there, not yet answered
    inflight: int = 0  # requests this proxy has open there
    waiting: int = 0  # backend-reported (all proxies): accepted, not yet in its batch
    running: int = 0  # backend-reported (all proxies): in its batch, prefilling or decoding
    prefill_tps: float = 0.0  # backend-measured; 0 = unknown
    # Backend-published, for the cost function (0 = not published):
    bytes_per_token: float = 0.0  # canonical request bytes per prompt token
    decoding: int = 0  # sequences decoding now
    max_batch: int = 0
    decode_steps_per_s: float = 0.0
    reply_tokens: float = 0.0  # mean tokens of a finished reply
    free_share: float = 0.0  # share of the cache budget not held

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
        return self.covered(c.depth)

    def restore_bytes(self, c: Candidate, matched: int) -> int:
        """Request bytes beyond the candidate's match (`matched`, from matched_bytes)
        that its disk tier would restore."""
        return max(0, self.covered(c.disk_depth) - matched)

    def covered(self, depth: int) -> int:
        """Request bytes the first `depth` chain blocks cover beyond the shared header."""
        d = min(depth, len(self.ends))
        return self.ends[d - 1] - self.ends[0] if d > 1 else 0


# Why a policy chose its backend (x-kvroute-route-reason), as policies.py and the
# router's live route (routing.py) decide it.
ROUTE_REASONS = ("cache-hit", "pending-hit", "disk-hit", "load", "no-registry", "live-route",
                 "round-robin", "least-loaded", "random")


@dataclass(frozen=True)
class Decision:
    candidate: Candidate
    reason: str  # one of ROUTE_REASONS
    prefill_tokens: float = 0.0  # estimated tokens the backend must prefill
    predicted_tokens: int = 0  # estimated cached tokens
    # Record the choice (routing marks in Redis, this proxy's recent choices) so that
    # requests sharing the prefix follow it before the backend advertises it.
    mark: bool = False


_PROXY = {s.name: s.default for s in PROXY}  # the proxy's settings and defaults


@dataclass
class PolicyConfig:
    name: str = _PROXY["policy"]
    bytes_per_token: float = 4.0  # until a backend of the model has measured its own
    default_prefill_tps: float = CostWeights.default_prefill_tps
    locality_slack: float = _PROXY["locality_slack"]
    per_request_wait: float = CostWeights.per_request_wait

    def weights(self) -> CostWeights:
        return CostWeights(per_request_wait=self.per_request_wait,
                           default_prefill_tps=self.default_prefill_tps)


class RoutingPolicy(Protocol):
    name: str
    config: PolicyConfig

    def choose(self, ctx: RouteContext) -> Decision: ...

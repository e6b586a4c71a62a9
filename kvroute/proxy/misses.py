"""Why a routed request's prompt missed the cache: the backend's view (what its store
holds, held and would not keep, kvroute/backend/misses.py) and the routing's facts
(what the registry predicted, where the request went and why, whether the lookup
answered, where this proxy sent the conversation before) combined into one reason of
kvroute/core/misses.py's closed set.

Each cause comes with the tokens it lost (prefilled although a cache held them); the
largest loss names the reason. Without a cause the request is a hit (the cache served
what any cache held) or new. A blind routing (the registry did not answer) explains
a miss nothing else explains; its loss is unknown (0).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvroute.core import misses as reasons
from kvroute.core.misses import MIN_LOST_TOKENS

# A prediction miss: the backend served less than half of what its advertised keys
# promised (the dashboard marks the same rows), by at least MIN_LOST_TOKENS.
PREDICTION_SHARE = 0.5


@dataclass(frozen=True)
class Facts:
    """What is known of one answered request when its headers arrive."""

    cached: int  # prompt tokens the backend served from its cache
    backend_reason: str | None = None  # its own reason (None: an older backend)
    backend_lost: int = 0
    diverged_at: int | None = None  # where the prompt left the entry of its deepest key
    predicted: float = 0.0  # tokens the chosen backend's advertised keys (RAM) promised
    elsewhere: float = 0.0  # most tokens another candidate held or was expected to
    elsewhere_failed: bool = False  # ... and it failed this request or is suspect
    lookup: str = "ok"  # "late" (past its deadline) or "down" (Redis did not answer)
    previous: str | None = None  # the backend this proxy sent the conversation to: "restarted", "gone"
    previous_tokens: float = 0.0  # tokens of the prompt that conversation had there


@dataclass(frozen=True)
class Miss:
    reason: str
    lost: int = 0  # tokens the reason cost (an estimate where the proxy decides)
    diverged_at: int | None = None  # template drift: the token position where it diverged


def explain(f: Facts) -> Miss:
    causes: list[tuple[float, str]] = []
    served = f.backend_reason in (reasons.HIT, reasons.NEW_PREFIX, None)
    if not served:
        causes.append((f.backend_lost, f.backend_reason))
    if served and f.cached < PREDICTION_SHARE * f.predicted:
        causes.append((f.predicted - f.cached, reasons.TEMPLATE_DRIFT))
    causes.append((f.elsewhere - max(f.cached, f.predicted),
                   reasons.BACKEND_GONE if f.elsewhere_failed else reasons.ROUTED_FOR_LOAD))
    if f.previous is not None:
        causes.append((f.previous_tokens - f.cached, reasons.BACKEND_RESTARTED
                       if f.previous == "restarted" else reasons.BACKEND_GONE))
    lost, reason = max(causes, key=lambda c: c[0])  # the first of equals: the backend's own
    if lost >= MIN_LOST_TOKENS:
        return Miss(reason, int(lost), f.diverged_at if reason == reasons.TEMPLATE_DRIFT else None)
    if f.backend_reason == reasons.HIT or (f.backend_reason is None and f.cached > 0):
        return Miss(reasons.HIT)
    if f.lookup != "ok":
        return Miss(reasons.LOOKUP_LATE if f.lookup == "late" else reasons.REGISTRY_DOWN)
    return Miss(reasons.NEW_PREFIX)


def client_reason(reason: str) -> str:
    """The reason as the client may read it. Another scope holding the prompt is told to
    operators only (metrics, /stats): told to a client, it would let one team test
    whether another team's prompt is cached (docs/DESIGN.md invariant 3)."""
    return reasons.NEW_PREFIX if reason == reasons.OTHER_SCOPE else reason

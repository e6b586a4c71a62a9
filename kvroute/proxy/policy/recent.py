"""This proxy's own routing choices: recent ones, so that requests it routes
concurrently and that share a new prefix follow one another before the backend
advertises that prefix (RecentChoices); and live conversations' routes, so that a
follow-up turn stays on its backend when the registry lookup answers "unknown"
(LiveRoutes).

Routing marks in Redis cover other proxies; these cover requests whose marks may not
have reached Redis before the next lookup. Choices are bucketed by model and first
content key (key 0, the header, is common to a whole model): only chains that can
share a prefix are compared.
"""

from __future__ import annotations

import collections
import time

from kvroute.core import prefix

_BUCKETS = 4096  # distinct (model, first content key) pairs remembered at most
_PER_BUCKET = 64


class RecentChoices:
    def __init__(self) -> None:
        # (model, first content key) -> deque of (chain, backend id, expiry)
        self.buckets: dict[tuple[str, int], collections.deque] = {}

    def remember(self, model: str, keys: list[int], backend_id: str, ttl: float) -> None:
        if len(keys) < 2:
            return
        now = time.monotonic()
        if len(self.buckets) >= _BUCKETS:  # bounded memory: drop expired buckets
            for k in [k for k, q in self.buckets.items() if not q or q[-1][2] < now]:
                del self.buckets[k]
        bucket = self.buckets.setdefault((model, keys[1]), collections.deque(maxlen=_PER_BUCKET))
        bucket.append((keys, backend_id, now + ttl))

    def depths(self, model: str, keys: list[int]) -> dict[str, int]:
        """Backend id -> leading keys of `keys` recently routed there."""
        bucket = self.buckets.get((model, keys[1])) if len(keys) > 1 else None
        if not bucket:
            return {}
        now = time.monotonic()
        while bucket and bucket[0][2] < now:
            bucket.popleft()
        depths: dict[str, int] = {}
        for chain, bid, _ in bucket:
            depths[bid] = max(depths.get(bid, 0), prefix.common_prefix(chain, keys))
        return depths


_LIVE_ROUTES = 65536  # conversations remembered at most (about 10 MB)
_LIVE_TTL = 600.0  # seconds a conversation's route is remembered after its last turn


class LiveRoutes:
    """Where this proxy last sent each live conversation, for when the registry cannot
    say (a lookup past its deadline, Redis down): the next turn of a conversation
    extends its chain, so its backend still holds the prefix.

    Keyed by a request's last two chain keys: the last but one is a full block that the
    next turn repeats (the last one, partial, changes as the conversation grows); the
    last one catches a retry of the same prompt. A chain key hashes the whole prefix
    before it (salt, scope and model included), so one key names one conversation.
    Bounded: least recently routed first out, and entries lapse after `ttl` seconds.
    The backend's instance is kept too: a conversation whose backend restarted since
    (or is gone) lost its cache there (proxy/misses.py).
    """

    def __init__(self, size: int = _LIVE_ROUTES, ttl: float = _LIVE_TTL) -> None:
        self.size = size
        self.ttl = ttl
        self.routes: collections.OrderedDict[int, tuple[str, str, float]] = collections.OrderedDict()

    def remember(self, keys: list[int], backend_id: str, instance_id: str = "") -> None:
        expiry = time.monotonic() + self.ttl
        for key in keys[max(1, len(keys) - 2):]:  # key 0 is common to the whole model
            self.routes[key] = (backend_id, instance_id, expiry)
            self.routes.move_to_end(key)
        while len(self.routes) > self.size:
            self.routes.popitem(last=False)

    def find(self, keys: list[int]) -> tuple[str, str, int] | None:
        """The backend (id, instance id) of the deepest remembered prefix of `keys`, and
        that prefix's length in keys; None when no prefix beyond the header is remembered."""
        now = time.monotonic()
        for depth in range(len(keys), 1, -1):
            hit = self.routes.get(keys[depth - 1])
            if hit is None:
                continue
            if hit[2] < now:
                del self.routes[keys[depth - 1]]
                continue
            return hit[0], hit[1], depth
        return None

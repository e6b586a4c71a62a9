"""This proxy's own recent routing choices, so that requests it routes concurrently and
that share a new prefix follow one another before the backend advertises that prefix.

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

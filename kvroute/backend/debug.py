"""GET /debug/cache: the store's entries with a digest of each entry's KV bytes, which
tests compare across exit paths and restarts. Hashes and counts only, never tokens or
text."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import xxhash
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

from .store import Store, held_tokens


def describe_entries(store: Store) -> list[dict]:
    """Engine thread only: it reads the caches."""
    out = []
    with store.lock:
        for e in store.entries.values():
            digest = xxhash.xxh3_64()
            for _, arr in tree_flatten([c.state for c in e.cache]):
                if isinstance(arr, mx.array):
                    # Through a copy: an entry kept whole hands out its own arrays, and on
                    # CUDA a host read moves a buffer into managed memory for good.
                    # bfloat16 has no numpy dtype: hash the raw bytes through a view.
                    arr = mx.array(arr)
                    digest.update(np.array(arr.view(mx.uint16) if arr.dtype == mx.bfloat16 else arr).tobytes())
            # Full-attention layers store exactly their tokens' keys; windows and
            # recurrent states hold less (their `offset` still counts every token).
            full = [c.keys.shape[2] for c in e.cache if type(c) is KVCache and c.keys is not None]
            out.append(
                {
                    "id": e.id,
                    "tokens": int(len(e.tokens)),
                    "kv_tokens": min(full) if full else None,
                    "kv_tokens_max": max(full) if full else None,
                    "offset": held_tokens(e.cache),
                    "trimmable": e.trimmable,
                    "nbytes": e.nbytes,
                    "exit_path": e.exit_path,
                    "hits": e.hits,
                    "kv_digest": digest.hexdigest(),
                    # The prefix keys advertised for it, as stored in Redis (hashes only).
                    "chain": [f"{k:016x}" for k in e.chain],
                }
            )
    return out

"""The prompt-cache store with real mlx-lm KV caches (no model needed)."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from backend.store import Store


def make_cache(n_tokens: int, layers: int = 2, seed: int = 0) -> list[KVCache]:
    mx.random.seed(seed)
    cache = []
    for _ in range(layers):
        c = KVCache()
        k = mx.random.normal((1, 2, n_tokens, 8))
        c.update_and_fetch(k, k * 2)
        cache.append(c)
    return cache


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_lookup_longest_prefix_and_trim():
    store = Store(budget_bytes=1 << 30)
    store.insert("m", tokens(10), make_cache(10), "prefill")
    store.insert("m", tokens(4, 100), make_cache(4), "prefill")
    # Shares 6 tokens with the first entry, then diverges: the entry is trimmed to 6.
    m = store.lookup("m", tokens(6) + [999, 1000])
    assert m.tokens == 6
    assert m.cache[0].size() == 6
    # The stored entry itself is untouched by the trim of its view.
    assert sorted(e.cache[0].size() for e in store.entries.values()) == [4, 10]


def test_lookup_leaves_one_token_to_process():
    store = Store(budget_bytes=1 << 30)
    store.insert("m", tokens(10), make_cache(10), "prefill")
    assert store.lookup("m", tokens(10)).tokens == 9
    assert store.lookup("m", tokens(12)).tokens == 10


def test_models_do_not_share_entries():
    store = Store(budget_bytes=1 << 30)
    store.insert("a", tokens(10), make_cache(10), "prefill")
    assert store.lookup("b", tokens(12)).tokens == 0


def test_insert_rejects_token_kv_mismatch():
    store = Store(budget_bytes=1 << 30)
    with pytest.raises(ValueError):
        store.insert("m", tokens(9), make_cache(10), "prefill")


def test_extension_supersedes_prefix_entry_and_events_refcount_keys():
    store = Store(budget_bytes=1 << 30)
    events = []
    store.listeners.append(events.append)
    store.insert("m", tokens(10), make_cache(10), "prefill", chain=[1, 2])
    store.insert("m", tokens(15), make_cache(15), "finish", chain=[1, 2, 3])
    assert len(store) == 1
    kinds = [(e.kind, e.keys) for e in events]
    # Key 1 and 2 stay held throughout: only 3 is new, and nothing is released.
    assert kinds == [("insert", [1, 2]), ("insert", [3]), ("evict", [])]
    # A commit covered by an existing entry adds nothing.
    assert store.insert("m", tokens(12), make_cache(12), "prefill", chain=[1, 2]) is None
    assert store.covers("m", tokens(15)) and not store.covers("m", tokens(16))


def test_lru_eviction_under_budget_emits_released_keys():
    one = sum(c.nbytes for c in make_cache(10))
    store = Store(budget_bytes=int(one * 2.5))
    events = []
    store.listeners.append(events.append)
    store.insert("m", tokens(10, 0), make_cache(10), "prefill", chain=[10])
    store.insert("m", tokens(10, 100), make_cache(10), "prefill", chain=[20])
    store.lookup("m", tokens(10, 0) + [1])  # touch the first: the second is now LRU
    store.insert("m", tokens(10, 200), make_cache(10), "prefill", chain=[30])
    assert store.nbytes <= store.budget_bytes
    assert store.evictions == 1
    evicted = [e for e in events if e.kind == "evict"]
    assert [e.keys for e in evicted] == [[20]]
    assert store.lookup("m", tokens(10, 0) + [1]).tokens == 10
    assert store.lookup("m", tokens(10, 100) + [1]).tokens == 0


def test_snapshot_lists_chains_per_model():
    store = Store(budget_bytes=1 << 30)
    store.insert("a", tokens(5), make_cache(5), "prefill", chain=[1, 2])
    store.insert("b", tokens(5, 50), make_cache(5), "prefill", chain=[7])
    assert store.snapshot() == {"a": [[1, 2]], "b": [[7]]}

"""The prompt-cache store with real mlx-lm KV caches (no model needed)."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from kvroute.backend.store import Store, common_prefix


def make_cache(n_tokens: int, layers: int = 2, seed: int = 0) -> list[KVCache]:
    mx.random.seed(seed)
    cache = []
    for _ in range(layers):
        # Exactly n_tokens long, as the engine's committed caches are (extracted
        # from the batch), not a generator's 256-token buffer.
        c = KVCache()
        k = mx.random.normal((1, 2, n_tokens, 8))
        c.keys, c.values, c.offset = k, k * 2, n_tokens
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


def make_window_cache(n_tokens: int, window: int = 4) -> list:
    """A sliding-window layer that has rotated (it cannot drop tokens any more)
    beside a recurrent layer, as in Gemma 3 / Qwen3-Next style hybrids."""
    from mlx_lm.models.cache import ArraysCache, RotatingKVCache

    rot = RotatingKVCache(max_size=window)
    for i in range(n_tokens):  # one token at a time, as decoding fills it
        k = mx.full((1, 2, 1, 8), float(i))
        rot.update_and_fetch(k, k)
    rec = ArraysCache(size=1)
    rec[0] = mx.full((1, 3), float(n_tokens))
    return [rot, rec]


def test_held_tokens_counts_windows_and_trusts_recurrent_states():
    from kvroute.backend.store import held_tokens

    assert held_tokens(make_window_cache(9)) == 9  # the window keeps 4, but saw 9
    assert held_tokens(make_window_cache(9)[1:]) is None  # recurrent only: no count
    assert held_tokens(make_cache(5) + make_window_cache(6)[:1]) == -1  # torn state


def test_untrimmable_entry_serves_only_prompts_that_extend_it():
    store = Store(budget_bytes=1 << 30)
    entry = store.insert("m", tokens(9), make_window_cache(9), "checkpoint")
    assert not entry.trimmable
    assert store.lookup("m", tokens(12)).tokens == 9
    # Diverging inside it, or a repeat of exactly its tokens, needs a trim: no hit.
    assert store.lookup("m", tokens(7) + [500, 501]).tokens == 0
    assert store.lookup("m", tokens(9)).tokens == 0
    # A checkpoint never supersedes the shorter ones it extends.
    store.insert("m", tokens(12), make_window_cache(12), "checkpoint")
    assert len(store) == 2
    assert store.lookup("m", tokens(10) + [7]).tokens == 9


def test_views_never_alias_stored_arrays():
    store = Store(budget_bytes=1 << 30)
    store.insert("m", tokens(10), make_cache(10), "checkpoint")
    (entry,) = store.entries.values()
    before = np.array(entry.cache[0].keys)
    view = store.lookup("m", tokens(6) + [99]).cache
    # What a generator does with the view: write new keys where the trim left room.
    view[0].update_and_fetch(mx.ones((1, 2, 3, 8)) * 7, mx.ones((1, 2, 3, 8)))
    mx.eval(view[0].keys)
    assert np.array_equal(np.array(entry.cache[0].keys), before)
    window = store.insert("m", tokens(9, 50), make_window_cache(9), "checkpoint")
    rec_view = store.lookup("m", tokens(9, 50) + [1]).cache[1]
    rec_view[0] = mx.zeros((1, 3))  # an ArraysCache assigns into its state list
    assert window.cache[1][0].tolist() == [[9.0, 9.0, 9.0]]


def test_partial_prefill_regression_superseding_entry_keeps_the_keys():
    """A disconnect mid-prefill commits an entry with no chain of its own; it
    supersedes turn 1's entry, whose keys must stay advertised so the client's
    retry is routed back here."""
    store = Store(budget_bytes=1 << 30)
    events = []
    store.listeners.append(events.append)
    store.insert("m", tokens(10), make_cache(10), "finish", chain=[1, 2])
    partial = store.insert("m", tokens(30), make_cache(30), "disconnect_prefill", chain=[])
    assert len(store) == 1 and partial.chain == [1, 2]
    assert [(e.kind, e.keys) for e in events] == [("insert", [1, 2]), ("insert", []), ("evict", [])]
    assert store.snapshot() == {"m": [[1, 2]]}


def test_common_prefix_counts_shared_tokens_wherever_they_part():
    # Parting in the head, just past it, deep in, not at all; either side the shorter,
    # lists of equal tokens of unequal lengths, and empty sides.
    rng = np.random.default_rng(3)
    base = rng.integers(0, 50, 5000).astype(np.int32)
    for at in (0, 1, 63, 64, 65, 127, 4096, 4999):
        other = base.copy()
        other[at] += 1
        assert common_prefix(base, other) == at
        assert common_prefix(other[: at + 10], base) == at
    for cut in (0, 1, 64, 100, 5000):
        assert common_prefix(base[:cut], base) == cut
        assert common_prefix(base, base[:cut]) == cut
    assert common_prefix(np.array([], np.int32), base) == 0

"""The paged store: shared prefixes held once, hits exact, eviction from tails inward.

Real mlx-lm caches whose keys and values are a function of the token and its
position's prefix (as a causal model's are): two conversations that share their
first tokens share those tokens' KV exactly, and blocks can be shared by content."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

from kvroute.backend.paged import BLOCK_TOKENS
from kvroute.backend.store import Store

HEADS, DIM, LAYERS = 2, 8, 2


def kv_of(tokens: list[int]) -> list[KVCache]:
    """Per layer, the KV a causal model would hold for `tokens`: each position's
    values depend on its token and the running sum of the tokens before it."""
    t = np.asarray(tokens, dtype=np.float32)
    prefix = np.cumsum(t) % 997
    base = np.stack([t, prefix], axis=-1)  # [T, 2]
    cache = []
    for layer in range(LAYERS):
        grid = np.arange(HEADS * DIM, dtype=np.float32).reshape(HEADS, 1, DIM) + layer
        k = mx.array(np.sin(base[None, :, :1] * 0.01 + grid) + base[None, :, 1:] * 1e-3)[None]
        c = KVCache()
        c.keys, c.values, c.offset = k, -k, len(tokens)
        cache.append(c)
    return cache


def one_bytes(n: int) -> int:
    return sum(c.nbytes for c in kv_of(list(range(n))))


def same_cache(a: list, b: list) -> bool:
    return all(x.offset == y.offset and np.array_equal(np.array(x.keys[..., :x.offset, :]),
                                                      np.array(y.keys[..., :y.offset, :]))
               and np.array_equal(np.array(x.values[..., :x.offset, :]),
                                  np.array(y.values[..., :y.offset, :]))
               for x, y in zip(a, b, strict=True))


SYSTEM = [7 + (i * 31) % 500 for i in range(3267)]  # the 3,267-token system prompt


def question(i: int) -> list[int]:
    return [1000 + i * 10 + j for j in range(12)]


def reply(i: int) -> list[int]:
    return [2000 + i * 10 + j for j in range(9)]


def test_six_conversations_sharing_a_system_prompt_hold_it_once():
    store = Store(budget_bytes=1 << 30)
    prompts = [SYSTEM + question(i) for i in range(6)]
    sizes = []
    for i, p in enumerate(prompts):
        store.insert("m", p, kv_of(p), "checkpoint", chain=[i])
        done = p + reply(i)
        store.insert("m", done, kv_of(done), "finish", chain=[i, 100 + i])
        sizes.append(store.nbytes)
    assert len(store) == 6
    one = sizes[0]
    assert store.nbytes <= 1.15 * one, [s / one for s in sizes]
    stats = store.stats()
    assert stats["bytes"] == store.nbytes and stats["bytes_unshared"] >= 5.5 * one
    assert stats["sharing_ratio"] > 5
    # Each repeat of a conversation is cached to its last token but one, exactly.
    for i, p in enumerate(prompts):
        done = p + reply(i)
        hit = store.lookup("m", done)
        assert hit.tokens == len(done) - 1
        assert same_cache(hit.cache, kv_of(done[:-1]))


def test_ten_sessions_under_a_budget_of_two_whole_conversations_stay_cached():
    """Turn 1 of ten sessions of one shared prefix, then turn 2 of each: under a budget
    that holds two whole conversations, every turn 2 finds its turn 1."""
    conversation = len(SYSTEM) + 12 + 9
    store = Store(budget_bytes=2 * one_bytes(conversation))
    turn1 = []
    for i in range(10):
        p = SYSTEM + question(i)
        store.insert("m", p, kv_of(p), "checkpoint")
        done = p + reply(i)
        store.insert("m", done, kv_of(done), "finish")
        turn1.append(done)
        assert store.nbytes <= store.budget_bytes
    hits = 0
    for i, done in enumerate(turn1):
        second = done + [3000 + i, 3001, 3002]
        hit = store.lookup("m", second)
        hits += hit.tokens == len(done)
        assert same_cache(hit.cache, kv_of(done)) if hit.tokens == len(done) else True
    assert hits / 10 >= 0.9, hits
    assert store.stats()["evictions"] == 0


def test_eviction_cuts_tails_inward_and_the_shared_head_outlives_them():
    head = SYSTEM[: 10 * BLOCK_TOKENS]
    tails = [[5000 + 100 * i + j for j in range(4 * BLOCK_TOKENS + 5)] for i in range(3)]
    per_tail = one_bytes(len(tails[0]))
    store = Store(budget_bytes=one_bytes(len(head)) + 2 * per_tail + per_tail // 2)
    events = []
    store.listeners.append(events.append)
    for i, tail in enumerate(tails):
        p = head + tail
        store.insert("m", p, kv_of(p), "finish", chain=[1, 10 + i])
    assert store.nbytes <= store.budget_bytes
    # The oldest conversation lost its own tokens from the end, block by block; the
    # head is whole, and the other two conversations are untouched.
    first, second, third = (store.depth("m", head + t + [1]) for t in tails)
    assert second == third == len(head) + len(tails[0])
    assert len(head) <= first < len(head) + len(tails[0]) and first % BLOCK_TOKENS == 0
    assert store.lookup("m", head + [9]).tokens == len(head)
    trimmed = [e for e in events if e.reason == "trimmed"]
    assert trimmed and trimmed[0].before.tokens.size == len(head) + len(tails[0])
    # Its own key (10) went with the tokens it no longer holds; none is known for the
    # shorter state, so it is no longer advertised.
    assert 10 in trimmed[0].keys and store.evictions == 0


def test_blocks_are_counted_once_and_freed_with_their_last_user():
    p = SYSTEM[:200]
    store = Store(budget_bytes=1 << 30)
    a = store.insert("m", p + [1, 2], kv_of(p + [1, 2]), "finish")
    b = store.insert("m", p + [3, 4], kv_of(p + [3, 4]), "finish")
    shared = len(p) // BLOCK_TOKENS
    assert store.stats()["blocks"] == shared  # the tails (8 + 2 tokens) are each entry's own
    assert store.nbytes < a.nbytes + b.nbytes
    store.remove(a.id)
    assert store.stats()["blocks"] == shared
    store.remove(b.id)
    assert store.stats()["blocks"] == 0 and store.nbytes == 0


def test_scopes_and_models_never_share_blocks():
    p = SYSTEM[:128]
    store = Store(budget_bytes=1 << 30)
    store.insert("m", p + [1], kv_of(p + [1]), "finish", scope="a")
    store.insert("m", p + [2], kv_of(p + [2]), "finish", scope="b")
    store.insert("n", p + [3], kv_of(p + [3]), "finish", scope="a")
    assert store.stats()["blocks"] == 3 * (len(p) // BLOCK_TOKENS)


@pytest.mark.parametrize("n", [1, 31, 32, 33, 64, 100])
def test_a_hit_at_any_depth_is_the_committed_state_exactly(n):
    p = SYSTEM[:100]
    store = Store(budget_bytes=1 << 30)
    store.insert("m", p, kv_of(p), "finish")
    hit = store.lookup("m", p[:n] + [99999])
    assert hit.tokens == n and same_cache(hit.cache, kv_of(p[:n]))
    # What a generator does with it never reaches the stored blocks.
    hit.cache[0].update_and_fetch(mx.ones((1, HEADS, 3, DIM)), mx.ones((1, HEADS, 3, DIM)))
    mx.eval(hit.cache[0].keys)
    assert same_cache(store.lookup("m", p + [1]).cache, kv_of(p))


@pytest.mark.parametrize("n", [1, 33, 99])
def test_a_hot_copy_serves_the_next_hit_once_and_exactly(n):
    """A finished turn's contiguous copy serves its conversation's next hit (no
    assembly from blocks), once; it answers as the blocks do, at any depth, and
    nothing done to it reaches the store."""
    p = SYSTEM[:100]
    store = Store(budget_bytes=1 << 30)
    entry = store.insert("m", p, kv_of(p), "finish")
    finished = kv_of(p)
    assert store.keep_hot(entry, finished) and store.stats()["hot_entries"] == 1
    finished[0].keys[..., :5, :] = 0  # the generator's cache, written after the commit
    mx.eval(finished[0].keys)
    hit = store.lookup("m", p[:n] + [99999])
    assert hit.tokens == n and same_cache(hit.cache, kv_of(p[:n]))
    assert store.stats()["hot_hits"] == 1 and store.hot_bytes == 0
    hit.cache[0].update_and_fetch(mx.ones((1, HEADS, 3, DIM)), mx.ones((1, HEADS, 3, DIM)))
    mx.eval(hit.cache[0].keys)
    again = store.lookup("m", p + [1])  # from the blocks now
    assert store.stats()["hot_hits"] == 1 and same_cache(again.cache, kv_of(p))


def test_a_hot_copy_counts_its_own_bytes_not_the_working_buffers():
    """A working cache's buffers run past its tokens (they grow by steps): the copy
    holds the tokens only, and the budget counts what it holds, to the byte."""
    p = SYSTEM[:100]
    store = Store(budget_bytes=1 << 30)
    entry = store.insert("m", p, kv_of(p), "finish")
    working = []
    for layer in kv_of(p):
        grown = KVCache()
        grown.update_and_fetch(layer.keys, layer.values)  # a 256-token buffer, 100 held
        working.append(grown)
    assert working[0].keys.shape[2] > len(p)
    assert store.keep_hot(entry, working)
    assert store.hot_bytes == one_bytes(100)
    store.lookup("m", p + [1])
    assert store.hot_bytes == 0 and store.stats()["hot_hits"] == 1


def test_hot_copies_use_only_the_budgets_free_room_and_go_first():
    p, q = SYSTEM[:100], SYSTEM[200:300]
    whole = one_bytes(100)
    tight = Store(budget_bytes=whole + whole // 2)
    entry = tight.insert("m", p, kv_of(p), "finish")
    assert not tight.keep_hot(entry, kv_of(p))  # no room beside the entry
    store = Store(budget_bytes=2 * whole + whole // 2)
    entry = store.insert("m", p, kv_of(p), "finish")
    assert store.keep_hot(entry, kv_of(p))
    store.insert("m", q, kv_of(q), "finish")  # needs the room: the copy goes, no entry does
    assert store.stats()["entries"] == 2 and store.stats()["hot_entries"] == 0
    assert store.evictions == 0 and store.hot_bytes == 0
    assert not store.keep_hot(entry, kv_of(p[:50]))  # a cache that is not the entry's


def test_a_hybrid_pages_its_attention_layers_and_keeps_the_rest_whole():
    p = SYSTEM[:150]
    recurrent = ArraysCache(size=1)
    recurrent[0] = mx.full((1, 3), 5.0)
    window = RotatingKVCache(max_size=4)
    for i in range(len(p)):
        window.update_and_fetch(mx.full((1, 2, 1, 8), float(i)), mx.full((1, 2, 1, 8), float(i)))
    attention = kv_of(p)
    store = Store(budget_bytes=1 << 30)
    entry = store.insert("m", p, [attention[0], CacheList(recurrent, attention[1]), window], "checkpoint")
    assert not entry.trimmable and store.stats()["blocks"] == len(p) // BLOCK_TOKENS
    hit = store.lookup("m", p + [1])
    assert hit.tokens == len(p)
    kv0, (rec, kv1), win = hit.cache[0], hit.cache[1].caches, hit.cache[2]
    assert same_cache([kv0, kv1], attention)
    assert rec[0].tolist() == [[5.0, 5.0, 5.0]] and win.offset == len(p)
    assert np.array_equal(np.array(win.keys), np.array(window.keys))


@pytest.mark.parametrize("bits, error, smaller", [(8, 0.02, 3.0), (4, 0.25, 5.0)])
def test_quantized_storage_holds_more_and_stays_close(bits, error, smaller):
    """Opt-in: blocks stored by mx.quantize, dequantized into the working cache on a
    hit; the tokens after the last full block stay exact. The deviation this causes in
    answers is measured per family in BENCHMARKS.md (bench_quantized)."""
    p = SYSTEM[:10 * BLOCK_TOKENS + 7]
    exact, quantized = Store(1 << 30), Store(1 << 30, quantization=bits)
    for store in (exact, quantized):
        store.insert("m", p, kv_of(p), "finish")
    assert exact.nbytes >= smaller * quantized.nbytes * 0.9
    assert quantized.stats()["quantization"] == bits and exact.stats()["quantization"] == 0
    want, got = kv_of(p), quantized.lookup("m", p + [1]).cache
    for w, g in zip(want, got, strict=True):
        assert g.offset == len(p) and g.keys.dtype == w.keys.dtype
        assert float(mx.abs(g.keys - w.keys).max()) <= error
        assert float(mx.abs(g.values - w.values).max()) <= error
        tail = slice(10 * BLOCK_TOKENS, len(p))
        assert np.array_equal(np.array(g.keys[..., tail, :]), np.array(w.keys[..., tail, :]))
    assert same_cache(exact.lookup("m", p + [1]).cache, want)  # the default stays exact


def test_a_state_with_fewer_blocks_than_its_tokens_fill_reads_the_rest_from_its_tail():
    """A disk record kept whole (over the RAM budget) has no blocks: its layers hold
    every token, and any prefix of it comes from them."""
    from kvroute.backend.paged import from_disk

    p = SYSTEM[:100]
    state = from_disk(kv_of(p), [], len(p))
    for n in (5, 32, 70, 100):
        assert same_cache(state.assemble(n), kv_of(p[:n]))


def test_random_workload_keeps_the_books_and_every_entry_exact():
    """Conversations branching from shared heads, committed, extended and looked up at
    random under a tight budget: the bytes held are the blocks once plus what entries
    hold alone, every block is counted by exactly the entries that hold it, the budget
    holds, and every entry still assembles exactly its own tokens' KV."""
    rng = np.random.default_rng(7)
    heads = [SYSTEM[:k] for k in (40, 100, 170)]
    store = Store(budget_bytes=one_bytes(600))
    convs: list[list[int]] = []
    for step in range(60):
        if convs and rng.random() < 0.5:
            c = convs[rng.integers(len(convs))]
            c += [int(t) for t in rng.integers(600, 900, rng.integers(1, 40))]
        else:
            convs.append(list(heads[rng.integers(3)]) + [int(t) for t in rng.integers(600, 900, 5)])
            c = convs[-1]
        store.insert("m", c, kv_of(c), "finish")
        if rng.random() < 0.3:
            store.lookup("m", convs[rng.integers(len(convs))] + [1])
        refs: dict[int, int] = {}
        for e in store.entries.values():
            for b in e.state.blocks:
                refs[b.key] = refs.get(b.key, 0) + 1
        assert refs == {k: b.refs for k, b in store.pool.blocks.items()}
        assert store.nbytes == store.pool.nbytes + sum(e.state.own_bytes for e in store.entries.values())
        assert store.nbytes <= store.budget_bytes or len(store) == 1
    stats = store.stats()
    assert stats["blocks_evicted"] > 0 and stats["sharing_ratio"] > 1  # it did both
    for e in store.entries.values():
        assert same_cache(e.cache, kv_of(e.tokens.tolist()))

"""A prompt whose KV is larger than the RAM budget is still kept: RAM holds the longest
prefix that fits, the disk tier the whole; what neither keeps is refused, logged and
counted, never counted as a commit.

The demo model's KV costs 1 KiB per token (test_disk_tier.py), so a 1 MiB RAM budget
holds 1,024 tokens and a ~1,900-token prompt is well over it (the black-box report had
a 3,106-token prompt over 4 MiB with a model of twice the bytes per token).
"""

from __future__ import annotations

import gc
import logging
import uuid

import mlx.core as mx
import pytest
import redis as redis_py
from tests.harness import BackendProcess, chat, wait_until
from tests.test_disk import make_cache, make_tier, restore, same_state
from tests.test_disk_tier import GREEDY, metric, next_turn, written
from tests.test_families import assert_entries_consistent, assert_same_answer, cached, conversation
from tests.test_store import make_window_cache, tokens

from kvroute.backend.kv_budget import describe_budgets, kv_rate
from kvroute.backend.store import Store, cache_nbytes, prefix_cache
from kvroute.devtools import arch_models
from kvroute.core import redis_keys

KIB = 1024
BUDGET = "1MiB"
FITS = (1 << 20) // KIB  # tokens of the demo model's KV one 1 MiB entry holds


def kv(n: int, seed: int = 0) -> list:
    """A state holding exactly `n` tokens' KV, as the engine commits them (mlx-lm's
    own caches grow by 256 tokens at a time)."""
    cache = prefix_cache(make_cache(n, seed=seed), n)
    mx.eval([c.state for c in cache])
    return cache


PER_TOKEN = cache_nbytes(kv(1))


def long_conversation(items: int = 120) -> list[dict]:
    """~1,900 tokens: well over a 1 MiB budget, and quick to prefill on a CPU."""
    facts = " ".join(f"item{i} costs {i * 7 % 100} coins;" for i in range(items))
    return [{"role": "system", "content": f"{uuid.uuid4().hex[:8]} You keep the price list."},
            {"role": "user", "content": f"{facts} Which item costs the most?"}]


def start(model, log_dir, *extra: str) -> BackendProcess:
    proc = BackendProcess(model, model_id="demo", log_dir=log_dir,
                          backend_id=f"oversize-{uuid.uuid4().hex[:6]}",
                          extra=["--prefill-step", "256", "--cache-bytes", BUDGET, *extra])
    proc.start()
    return proc


def commits(backend: BackendProcess) -> float:
    return metric(backend, "kvroute_backend_commits_total")


# -- the store ---------------------------------------------------------------------


def test_an_entry_over_the_budget_keeps_the_prefix_that_fits_and_advertises_only_its_keys():
    store = Store(budget_bytes=40 * PER_TOKEN)
    events = []
    store.listeners.append(events.append)
    whole = kv(100)
    done = store.commit("m", tokens(100), whole, "checkpoint", chain=[1, 2, 3],
                        prefix_chains={30: [1], 60: [1, 2], 99: [1, 2, 3]})
    assert (done.kept, done.over_budget, done.on_disk, done.refused) == (40, True, False, "")
    assert done.disk_refused == "no_disk_tier"
    (entry,) = store.entries.values()
    assert entry.tokens.tolist() == tokens(40) and entry.nbytes <= store.budget_bytes
    # The prefix's arrays hold exactly its tokens, equal to the whole's first 40.
    for kept, full in zip(entry.cache, whole):
        assert kept.offset == kept.keys.shape[2] == 40
        assert mx.array_equal(kept.keys, full.keys[..., :40, :]).item()
        assert mx.array_equal(kept.values, full.values[..., :40, :]).item()
    # Only the keys of positions inside the prefix: 30 is, 60 and 99 are not.
    assert [(e.kind, e.keys) for e in events] == [("insert", [1])]
    assert store.snapshot() == {"m": [[1]]}
    hit = store.lookup("m", tokens(100))
    assert hit.tokens == 40 and same_state(hit.cache, entry.cache)


def test_the_prefix_frees_the_whole_state():
    store = Store(budget_bytes=100 * PER_TOKEN)
    gc.collect()
    before = mx.get_active_memory()
    whole = kv(10_000)  # ~2.5 MB
    store.commit("m", tokens(10_000), whole, "checkpoint")
    del whole
    gc.collect()
    # A slice of the whole would keep all of its buffer alive.
    assert mx.get_active_memory() - before < 10 * store.budget_bytes


def test_the_next_commit_over_the_budget_refreshes_the_same_prefix():
    store = Store(budget_bytes=40 * PER_TOKEN)
    store.commit("m", tokens(99), kv(99), "checkpoint", prefix_chains={30: [1]})
    done = store.commit("m", tokens(105), kv(105), "finish", chain=[1, 2, 3, 4],
                        prefix_chains={30: [1], 35: [1, 9]})
    assert done.kept == 40 and done.entry is None  # covered by the entry already there
    (entry,) = store.entries.values()
    assert entry.chain == [1, 9]  # a deeper known position inside the prefix


def test_the_overflow_takes_the_whole_and_inherits_the_keys_of_what_it_extends():
    store = Store(budget_bytes=40 * PER_TOKEN)
    taken = []
    store.overflow = lambda entry: taken.append(entry) or ""
    store.commit("m", tokens(20), kv(20), "finish", chain=[1])
    done = store.commit("m", tokens(100), kv(100), "checkpoint", chain=[1, 2, 3])
    assert done.on_disk and done.kept == 40 and not done.refused
    (whole,) = taken
    assert whole.tokens.tolist() == tokens(100) and whole.chain == [1, 2, 3]
    (prefix,) = store.entries.values()  # it superseded the 20-token entry, keeping its key
    assert prefix.part_of == whole.id and prefix.chain == [1]


def test_nothing_kept_anywhere_is_refused_with_the_overflows_reason():
    store = Store(budget_bytes=PER_TOKEN // 2)  # not even one token
    events = []
    store.listeners.append(events.append)
    done = store.commit("m", tokens(10), kv(10), "checkpoint", chain=[1])
    assert (done.kept, done.refused) == (0, "no_disk_tier")
    store.overflow = lambda entry: "disk_queue_full"
    assert store.commit("m", tokens(10), kv(10), "finish").refused == "disk_queue_full"
    assert len(store) == 0 and events == []


def test_an_untrimmable_entry_over_the_budget_goes_whole_to_disk_and_ram_keeps_none():
    window = make_window_cache(9)
    store = Store(budget_bytes=cache_nbytes(window) - 1)
    assert store.commit("m", tokens(9), window, "checkpoint").refused == "no_disk_tier"
    taken = []
    store.overflow = lambda entry: taken.append(entry) or ""
    done = store.commit("m", tokens(9), make_window_cache(9), "checkpoint", chain=[5])
    assert (done.kept, done.on_disk, done.refused) == (0, True, "")
    assert len(store) == 0 and not taken[0].trimmable


def test_the_disk_tier_writes_the_whole_once_and_replaces_what_it_extends(tmp_path):
    tier, metrics = make_tier(tmp_path)
    store = Store(budget_bytes=40 * PER_TOKEN)
    store.listeners.append(tier.on_store_event)
    store.overflow = tier.take
    store.commit("m", tokens(99), kv(99), "checkpoint", chain=[1, 2])
    wait_until(lambda: len(tier.index) == 1, 30, what="the whole on disk")
    (record,) = tier.index.values()
    assert len(record.tokens) == 99 and record.chain == [1, 2]  # the prefix is not written
    found = restore(tier, tokens(99) + [7])
    assert found.tokens == 99
    # The finish extends it: one file, holding the keys of both.
    store.commit("m", tokens(105), kv(105), "finish", chain=[1, 2, 3])
    wait_until(lambda: [len(r.tokens) for r in tier.index.values()] == [105], 30,
               what="the extended file replaced")
    assert tier.snapshot() == {"m": [[1, 2, 3]]}
    # A repeat of a whole already on disk is not written again.
    written_ok = metric_value(metrics, metrics.disk_writes, result="ok")
    store.commit("m", tokens(104), kv(104), "checkpoint", chain=[1, 2])
    assert metric_value(metrics, metrics.disk_writes, result="ok") == written_ok
    assert tier._queue.qsize() == 0
    tier.close()


def test_the_disk_tier_refuses_a_whole_over_its_budget(tmp_path):
    tier, _ = make_tier(tmp_path, budget=10 * PER_TOKEN)
    store = Store(budget_bytes=PER_TOKEN // 2)
    store.overflow = tier.take
    assert store.commit("m", tokens(20), kv(20), "checkpoint").refused == "over_disk_budget"
    tier.close()


def metric_value(metrics, counter, **labels) -> float:
    return counter.labels(model="m", backend="b", **labels)._value.get()


# -- start-up: what one entry may hold ---------------------------------------------


def test_the_demo_models_kv_rate(text_model):
    from mlx_lm import load

    model, _ = load(str(text_model))
    assert kv_rate(model) == (KIB, 0)  # 2 layers x 2 KV heads x 32 x fp32 x keys and values


def test_budgets_are_told_in_tokens_and_short_ones_warned(caplog):
    caplog.set_level(logging.INFO, logger="kvroute.backend.kv_budget")
    counts = describe_budgets(1 << 20, 32 << 30, (KIB, 0), 8192)
    assert counts == {"ram_tokens": 1024, "disk_tokens": 32 << 20}
    assert "holds up to 1,024 tokens in RAM" in caplog.text
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "prompts over 1,024 tokens" in warning.getMessage()
    assert "the disk tier the whole" in warning.getMessage()
    caplog.clear()
    describe_budgets(1 << 20, 0, (KIB, 0), 8192)
    assert "add a disk tier" in caplog.text
    caplog.clear()
    assert describe_budgets(16 << 20, 0, (KIB, 0), 8192)["ram_tokens"] == 16384
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


# -- real backends -------------------------------------------------------------------


def test_a_prompt_over_the_ram_budget_is_served_from_disk_exactly(text_model, tmp_path, redis_db):
    redis = redis_db
    backend = start(text_model, tmp_path, "--disk-cache-dir", str(tmp_path / "disk"),
                    "--redis-url", redis.url)
    try:
        messages = long_conversation()
        turn1 = chat(backend, messages, **GREEDY).body
        prompt = turn1["usage"]["prompt_tokens"]
        assert prompt > 1.5 * FITS
        wait_until(lambda: written(backend), 60, what="the whole prompt on disk")
        # RAM holds a prefix within its budget, its KV exactly its tokens.
        entries = backend.cache()
        assert entries and all(e["tokens"] <= FITS and e["nbytes"] <= 1 << 20 for e in entries)
        assert_entries_consistent(backend)
        # RAM advertises less than the disk tier, which advertises the whole.
        client = redis_py.Redis.from_url(redis.url)
        tag = redis_keys.model_tag("demo")

        def advertised() -> tuple[set, set] | None:
            ram = client.smembers(f"{tag}idx:{backend.backend_id}")
            disk = client.smembers(f"{tag}didx:{backend.backend_id}")
            return (ram, disk) if disk else None

        ram, disk = wait_until(advertised, 30, what="the disk tier's keys in Redis")
        assert ram < disk

        repeat = chat(backend, messages, **GREEDY).body
        assert cached(repeat) >= 0.9 * prompt
        assert_same_answer(repeat, turn1)  # turn 1 was a cold prefill
        follow = next_turn(messages, turn1)
        hit = chat(backend, follow, **GREEDY).body
        assert cached(hit) >= 0.9 * hit["usage"]["prompt_tokens"]
        reference = chat(backend, follow, scope=uuid.uuid4().hex, **GREEDY).body
        assert cached(reference) == 0
        assert_same_answer(hit, reference)
        assert metric(backend, "kvroute_backend_cache_hits_total", tier="disk") >= 2
        assert metric(backend, "kvroute_backend_commits_refused_total") == 0
        assert metric(backend, "kvroute_backend_commits_over_budget_total", whole="disk") >= 1
        assert "is over the RAM budget (1.0 MiB): RAM keeps its first" in backend.log()
    finally:
        backend.stop()


def test_without_a_disk_tier_ram_keeps_the_longest_prefix_that_fits(text_model, tmp_path):
    backend = start(text_model, tmp_path)
    try:
        messages = long_conversation()
        turn1 = chat(backend, messages, **GREEDY).body
        assert turn1["usage"]["prompt_tokens"] > 1.5 * FITS
        repeat = chat(backend, messages, **GREEDY).body
        assert cached(repeat) == FITS
        assert_same_answer(repeat, turn1)
        follow = next_turn(messages, turn1)
        hit = chat(backend, follow, **GREEDY).body
        assert cached(hit) == FITS
        assert_same_answer(hit, chat(backend, follow, scope=uuid.uuid4().hex, **GREEDY).body)
        assert_entries_consistent(backend)
        assert metric(backend, "kvroute_backend_commits_over_budget_total", whole="dropped") >= 1
        assert metric(backend, "kvroute_backend_commits_refused_total") == 0
        assert "the rest is lost: there is no disk tier" in backend.log()
    finally:
        backend.stop()


@pytest.mark.parametrize("disk", [True, False])
def test_an_untrimmable_family_keeps_its_checkpoints_that_fit_and_the_whole_on_disk(
        model_cache, tmp_path, disk):
    """Gemma 3's sliding windows rotate past 32 tokens: such a state cannot be cut, so
    RAM keeps only the checkpoints that fit (the shared header), the disk the rest."""
    path = arch_models.ensure("gemma3_text", cache_dir=model_cache)
    extra = ["--disk-cache-dir", str(tmp_path / "disk")] if disk else []
    backend = BackendProcess(path, model_id="gemma3_text", log_dir=tmp_path,
                             backend_id=f"oversize-g3-{disk}",
                             extra=["--cache-bytes", "100KiB", *extra])
    backend.start()
    try:
        messages = long_conversation(40)  # ~630 tokens, ~370 KiB of state
        turn1 = chat(backend, messages, **GREEDY).body
        prompt = turn1["usage"]["prompt_tokens"]
        (header,) = backend.cache()
        assert header["tokens"] < 32 and header["nbytes"] <= 100 * KIB
        if disk:
            wait_until(lambda: written(backend, 2), 60, what="the checkpoints on disk")
        repeat = chat(backend, messages, **GREEDY).body
        assert cached(repeat) == (prompt - 1 if disk else header["tokens"])
        assert_same_answer(repeat, turn1)
        follow = next_turn(messages, turn1)
        hit = chat(backend, follow, **GREEDY).body
        assert cached(hit) >= (0.9 * prompt if disk else header["tokens"])
        assert_same_answer(hit, chat(backend, follow, scope=uuid.uuid4().hex, **GREEDY).body)
        refused = metric(backend, "kvroute_backend_commits_refused_total")
        assert (refused == 0) if disk else (refused >= 2)
    finally:
        backend.stop()


@pytest.mark.parametrize("disk, reason", [(False, "no_disk_tier"), (True, "over_disk_budget")])
def test_a_commit_kept_nowhere_is_refused_and_logged(text_model, tmp_path, disk, reason):
    # Under one token's KV in RAM; the disk tier, where there is one, is as small.
    extra = ["--cache-bytes", "512B"]
    if disk:
        extra += ["--disk-cache-dir", str(tmp_path / "disk"), "--disk-cache-bytes", "512B"]
    backend = start(text_model, tmp_path, *extra)
    try:
        messages = conversation()
        first = chat(backend, messages, **GREEDY).body
        assert first["choices"][0]["message"]["content"] is not None  # served all the same
        wait_until(lambda: metric(backend, "kvroute_backend_commits_refused_total",
                                  reason=reason) >= 2, 10, what="checkpoint and finish refused")
        assert commits(backend) == 0
        assert backend.health()["cache"]["entries"] == 0
        assert cached(chat(backend, messages, **GREEDY).body) == 0
        assert "not keeping a prompt cache of" in backend.log()
    finally:
        backend.stop()

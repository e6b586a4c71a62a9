"""The hardware path: the fused-attention caches, warm-up, memory limits, shutdown.

The speed itself is measured by bench/bench_hw.py (BENCHMARKS.md); these tests
check what must hold on every machine: the fused causal path gives the same
tokens and (within rounding) the same logits as mlx-lm's masked path, a backend
is warm before it says healthy, it applies its memory limits, and it exits 0 on
SIGTERM.
"""

from __future__ import annotations

import gc
import signal

import mlx.core as mx
import pytest
from tests.harness import BackendProcess, SSEStream, metric_sum, post_json, request, wait_until
from mlx_lm import load
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from kvroute.backend.attention import FastBatchKVCache, fast, new_cache


@pytest.fixture(scope="module")
def demo(text_model):
    model, tokenizer = load(str(text_model))
    return model, tokenizer


def _prompts(n: int, lengths: list[int]) -> list[list[int]]:
    return [[(7 * i + 3 * j) % (n - 10) + 5 for j in range(length)]
            for i, length in enumerate(lengths)]


def _greedy(model, prompts, caches, max_tokens=12, step=16) -> dict[int, list[int]]:
    gen = BatchGenerator(model, stop_tokens=[], prefill_step_size=step, prefill_batch_size=8)
    uids = gen.insert(prompts, max_tokens=[max_tokens] * len(prompts), caches=caches)
    out: dict[int, list[int]] = {u: [] for u in uids}
    while any(len(v) < max_tokens for v in out.values()):
        for r in gen.next_generated():
            out[r.uid].append(r.token)
    return [out[u] for u in uids]


@pytest.mark.parametrize("lengths", [[40], [33, 33, 33], [5, 47, 20]])
def test_fused_path_generates_what_the_masked_path_does(demo, lengths):
    """One sequence, equal lengths (both fused) and unequal ones (masked fallback
    mid-batch): the tokens equal mlx-lm's own caches' tokens."""
    model, tok = demo
    prompts = _prompts(len(tok.vocab) if hasattr(tok, "vocab") else 1000, lengths)
    ref = _greedy(model, prompts, [make_prompt_cache(model) for _ in prompts])
    got = _greedy(model, prompts, [new_cache(model) for _ in prompts])
    assert got == ref


def test_fused_prefill_matches_masked_logits(demo):
    model, _ = demo
    tokens = mx.array([list(range(10, 74))])
    masked = BatchKVCache.merge(make_prompt_cache(model))
    fused = FastBatchKVCache.merge(new_cache(model))
    assert fused.make_mask(64) == "causal" and fused.make_mask(1) is None
    a = model(tokens[:, :40], cache=[BatchKVCache([0]) for _ in model.layers])
    b = model(tokens[:, :40], cache=[FastBatchKVCache([0]) for _ in model.layers])
    assert mx.allclose(a, b, atol=1e-3, rtol=1e-3).item()
    del masked


def test_padded_rows_take_the_masked_path_and_extract_exactly(demo):
    model, _ = demo
    short, long_ = make_prompt_cache(model), make_prompt_cache(model)
    model(mx.array([[5, 6, 7]]), cache=short)
    model(mx.array([[5, 6, 7, 8, 9, 10]]), cache=long_)
    merged = [c.merge([a, b]) for c, a, b in zip(fast(short), fast(short), fast(long_))]
    assert all(isinstance(c, FastBatchKVCache) for c in merged)
    assert merged[0].padded and not isinstance(merged[0].make_mask(1), (str, type(None)))
    assert merged[0].offset.tolist() == [3, 6]  # each row's position, as mlx-lm keeps it
    first = merged[0].extract(0)
    assert first.offset == 3 and mx.array_equal(first.keys, short[0].keys[..., :3, :]).item()
    merged[0].filter([1])  # the long row alone: no padding left
    assert not merged[0].padded and merged[0].make_mask(1) is None
    assert merged[0].offset == 6  # unpadded: a plain int, RoPE's scalar path


def test_backend_is_warm_when_healthy_applies_limits_and_exits_0(text_model, tmp_path):
    """Health answers only after the warm-up ran (its time is in /health), the
    memory limits given are applied, and SIGTERM ends the process with exit 0
    after an orderly engine stop (on CUDA the teardown used to abort)."""
    backend = BackendProcess(text_model, model_id="demo", log_dir=tmp_path,
                             extra=["--memory-limit", "3GiB", "--cache-limit", "256MiB",
                                    "--prefill-step", "64"])
    backend.start(timeout=180)
    try:
        device = backend.health()["device"]
        assert device["warmup_s"] >= 0 and "warmed up in" in backend.log()
        assert device["memory_limit"] == 3 << 30 and device["cache_limit"] == 256 << 20
        assert device["prefill_step"] == 64 and device["kind"] in ("cpu", "cuda", "metal")
        # Serving still works after the warm-up (its generator and caches are gone).
        status, body = post_json(backend.url + "/v1/completions",
                                 {"model": "demo", "prompt": "hello " * 80, "max_tokens": 3})
        assert status == 200 and body["usage"]["completion_tokens"] == 3, body
        # What the process holds, for an operator sizing replicas: MLX's own counts
        # (the weights at least), under the cap given; the same as gauges.
        memory = backend.health()["memory"]
        assert memory["limit"] == 3 << 30 and 0 < memory["active"] <= memory["peak"]
        text = request(backend.url + "/metrics")[2].decode()
        assert metric_sum(text, "kvroute_backend_memory_bytes", kind="peak") > 0
        # A request in flight when SIGTERM arrives does not stop a clean exit.
        stream = SSEStream(backend.url + "/v1/completions",
                           {"model": "demo", "prompt": "long " * 300, "max_tokens": 200})
        assert stream.status == 200
        backend.proc.send_signal(signal.SIGTERM)
        assert backend.proc.wait(60) == 0, backend.log()
        stream.close()
        assert "terminate called" not in backend.log()
    finally:
        backend.stop()


def test_platform_default_prefill_step(text_model, tmp_path):
    backend = BackendProcess(text_model, model_id="demo", log_dir=tmp_path, extra=["--no-warmup"])
    backend.start(timeout=180)
    try:
        device = backend.health()["device"]
        assert "warmup_s" not in device
        assert device["prefill_step"] == (512 if device["kind"] == "cpu" else 2048)
        assert "memory_limit" not in device  # none given: MLX's default
    finally:
        backend.proc.send_signal(signal.SIGTERM)
        assert backend.proc.wait(60) == 0, backend.log()
        backend.stop()


def test_serve_shares_the_gpu_memory_among_replicas(text_model):
    """On a GPU the budget is the card's memory and every replica gets a cap, in
    proportion to its need, that together stay within memory_fraction of it; on CUDA
    each replica's cost also counts what its process holds on the card beyond MLX's
    own count (its context, the libraries' workspaces), which its MLX cap leaves out,
    so caps and those together stay within the budget; a deployment that cannot fit
    the card is refused with the arithmetic."""
    from kvroute.core import accel
    from kvroute import config
    from kvroute.serve import capacity
    from kvroute.serve.launcher import Launcher

    def plan(card: accel.Accelerator) -> tuple[config.ModelSpec, Launcher]:
        cfg = config.build({"models": [str(text_model)], "replicas": 2, "cache_bytes": 8 << 30,
                            "prefill_step": 4096}, {})
        launcher = Launcher(cfg)
        launcher.paths = {cfg.models[0].alias: str(text_model)}
        launcher._plan(card)
        launcher.loader.initial()
        return cfg.models[0], launcher

    card = accel.Accelerator("cuda", "test GPU", 140 << 30)
    spec, launcher = plan(card)
    budget = int(0.85 * card.memory)
    assert spec.prefill_step == 4096
    assert 8 << 30 < spec.memory_limit
    assert spec.replicas * (spec.memory_limit + capacity.CUDA_OVERHEAD) <= budget
    assert ["--memory-limit", str(spec.memory_limit)] == spec.backend_flags()[
        spec.backend_flags().index("--memory-limit"):][:2]
    cost = launcher.loader.slots[spec.alias].cost
    assert cost.overhead == capacity.PROCESS_OVERHEAD + capacity.CUDA_OVERHEAD
    assert "2.0 GiB process" in launcher._memory_note()
    # On a Mac's unified memory there is no such process term: the cap is the share.
    mac, launcher = plan(accel.Accelerator("metal", "test Mac", 140 << 30))
    assert launcher.loader.slots[mac.alias].cost.overhead == capacity.PROCESS_OVERHEAD
    assert mac.memory_limit == spec.memory_limit + capacity.CUDA_OVERHEAD
    # The CUDA term alone tips a card that fits otherwise over its budget.
    need = launcher.loader.slots[mac.alias].cost.total
    tight = accel.Accelerator("cuda", "tight", int(2 * need / 0.85) + (64 << 20))
    plan(accel.Accelerator("metal", "tight Mac", tight.memory))
    with pytest.raises(config.ConfigError, match="cuda memory"):
        plan(tight)
    with pytest.raises(config.ConfigError, match="cuda memory"):
        plan(accel.Accelerator("cuda", "small", 10 << 30))


def test_replica_limits_never_oversubscribe_what_runs_together():
    from kvroute.serve.capacity import replica_limits

    GiB = 1 << 30
    # All fit: the rest of the budget is shared in proportion to need.
    assert replica_limits([GiB, GiB, 2 * GiB], 8 * GiB) == [2 * GiB, 2 * GiB, 4 * GiB]
    # Not all at once (models on demand): each its own need, never a cut below it.
    assert replica_limits([3 * GiB, 3 * GiB, 4 * GiB], 8 * GiB) == [3 * GiB, 3 * GiB, 4 * GiB]
    assert replica_limits([], 8 * GiB) == []


def test_on_cuda_the_budget_is_the_cards_memory_not_what_mlx_reports(monkeypatch):
    """MLX 0.32 reports a CUDA device's memory as the host's RAM (125.8 GiB for an
    80 GB H100 in a 128 GB host): the card's own figure wins. No GPU here: MLX's
    answers and the runtime's are stand-ins."""
    import mlx.core as mx

    from kvroute.core import accel

    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mx, "device_info", lambda: {"device_name": "H100", "memory_size": 135 << 30})
    monkeypatch.setattr(accel, "cuda_memory", lambda: 80 << 30)
    assert accel.detect() == accel.Accelerator("cuda", "H100", 80 << 30)
    monkeypatch.setattr(accel, "cuda_memory", lambda: 0)  # no runtime, no nvidia-smi
    assert accel.detect().memory == 135 << 30


def test_the_accelerator_probe_answers():
    from kvroute.core import accel

    device = accel.probe()
    assert device.kind in ("cpu", "cuda", "metal") and device.memory > 1 << 30



def test_serial_long_prefill_holds_the_second_and_it_hits_the_first(text_model, tmp_path):
    """With --long-prefill serial a second long prompt waits while the first is
    prefilled, then enters and finds the shared prefix committed; both answer."""
    backend = BackendProcess(text_model, model_id="demo", log_dir=tmp_path,
                             extra=["--long-prefill", "serial", "--prefill-step", "32",
                                    "--enable-faults", "--no-warmup"])
    backend.start(timeout=180)
    try:
        shared = " ".join(f"word{i % 50}" for i in range(300))
        first = SSEStream(backend.url + "/v1/completions",
                          {"model": "demo", "prompt": shared + " one", "max_tokens": 3,
                           "kvroute_fault": "slow_prefill:0.05"})
        wait_until(lambda: backend.health()["engine"]["prefilling"] == 1, timeout=60,
                   what="the first prompt's prefill")
        second = SSEStream(backend.url + "/v1/completions",
                           {"model": "demo", "prompt": shared + " two", "max_tokens": 3,
                            "stream_options": {"include_usage": True}})

        def held() -> bool:
            engine = backend.health()["engine"]
            return engine["prefilling"] == 1 and engine["queued"] == 1
        wait_until(held, timeout=60, what="the second prompt to wait for the first")
        assert [e for e in first.events() if e == "[DONE]"]
        events = [e for e in second.events() if isinstance(e, dict)]
        usage = events[-1]["usage"]
        assert usage["completion_tokens"] == 3
        assert usage["prompt_tokens_details"]["cached_tokens"] > usage["prompt_tokens"] // 2
        assert backend.health()["device"]["serial_prefill"] is True
    finally:
        backend.stop()


def test_a_hit_and_its_hand_over_share_arrays_without_changing_the_entry(demo):
    """A batch of one (a cache hit) starts from the stored entry's arrays and a
    deep copy (mlx-lm's hand-over to decoding) shares them, without a copy of the
    state: neither may change the entry or each other, and the hit continues
    exactly as the plain cache does."""
    import copy

    model, _ = demo
    entry = new_cache(model)
    model(mx.array([[5, 6, 7, 8, 9]]), cache=entry)
    before = [mx.array(c.keys[..., : c.offset, :]) for c in entry]
    plain = make_prompt_cache(model)
    model(mx.array([[5, 6, 7, 8, 9]]), cache=plain)

    batch = [FastBatchKVCache.merge([c]) for c in entry]
    twin = copy.deepcopy(batch)
    assert all(b.size() == 5 and not b.padded for b in batch)
    nxt = mx.array([[11, 12]])
    got = model(nxt, cache=batch)
    ref = model(nxt, cache=plain)
    assert mx.allclose(got, ref, atol=1e-4, rtol=1e-4).item()
    assert all(t.size() == 5 for t in twin)  # the copy did not see the other's update
    other = model(mx.array([[13]]), cache=twin)
    assert other.shape[1] == 1 and all(t.size() == 6 for t in twin)
    for c, old in zip(entry, before):  # the stored entry is unchanged
        assert c.offset == 5 and mx.array_equal(c.keys[..., :5, :], old).item()
    for b in batch:
        b.filter([0])  # every row: kept as it is
        assert b.size() == 7


def test_working_buffers_keep_first_tokens_off_cudnn_decode_plans():
    """MLX on CUDA takes a decode step's attention to cuDNN, which builds a plan per
    buffer length and row count on first use, only when the keys' buffer length is
    a multiple of 256. A buffer grown for a prompt or a suffix, or a small one,
    must miss that test (the first token never waits for a plan); one grown during
    a long decode must pass it (cuDNN is faster there). What the cache returns is
    what was written, whatever the buffer's length."""
    from kvroute.backend.attention import CUDNN_DECODE_STEP, VECTOR_DECODE_TOKENS

    def tokens(start: int, n: int) -> mx.array:
        column = mx.arange(start, start + n, dtype=mx.float32).reshape(1, 1, n, 1)
        return column * mx.ones((1, 2, 1, 4))

    cache, written = FastBatchKVCache([0]), 0
    for n in (2048, 2048, 70):  # two prompt chunks and a suffix
        keys, _ = cache.update_and_fetch(tokens(written, n), tokens(written, n))
        written += n
        assert cache.keys.shape[2] % CUDNN_DECODE_STEP != 0
    lengths = set()
    while written < VECTOR_DECODE_TOKENS + 2 * CUDNN_DECODE_STEP:  # a long decode
        keys, values = cache.update_and_fetch(tokens(written, 1), tokens(written, 1))
        written += 1
        lengths.add(cache.keys.shape[2])
    small = {n for n in lengths if n <= VECTOR_DECODE_TOKENS}
    assert small and all(n % CUDNN_DECODE_STEP for n in small)
    assert any(n > VECTOR_DECODE_TOKENS and n % CUDNN_DECODE_STEP == 0 for n in lengths)
    assert keys.shape[2] == written
    assert mx.array_equal(keys[0, 1, :, 0], mx.arange(written, dtype=mx.float32)).item()
    assert mx.array_equal(values, keys).item()


@pytest.mark.parametrize("mask", ["causal", None, "bool", "additive"])
def test_plain_attention_is_mlx_attention(mask):
    """The plan-free attention used on CUDA for new shapes (backend/attention.py)
    computes what mx.fast.scaled_dot_product_attention does, with grouped heads,
    fewer queries than keys, and every kind of mask the models pass."""
    from kvroute.backend.attention import _plain_attention

    mx.random.seed(3)
    B, Hq, Hk, L, S, D = 2, 8, 2, 5, 23, 16
    q, k, v = (mx.random.normal(s) for s in ((B, Hq, L, D), (B, Hk, S, D), (B, Hk, S, D)))
    if mask == "bool":  # left padding of the first row, as mlx-lm's batched mask has it
        m = mx.arange(S)[None, None, None] >= mx.array([3, 0])[:, None, None, None]
        m = m & (mx.arange(S - L, S)[:, None] >= mx.arange(S)[None])
    elif mask == "additive":
        m = mx.random.normal((B, 1, L, S))
    else:
        m = mask
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=m)
    got = _plain_attention(q, k, v, 0.25, m)
    assert got.shape == ref.shape and mx.allclose(got, ref, atol=1e-5, rtol=1e-5).item()
    if not isinstance(m, mx.array):
        # In the models' bfloat16 it is bit for bit MLX's own (CPU) attention.
        q, k, v = (a.astype(mx.bfloat16) for a in (q, k, v))
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=m)
        assert mx.array_equal(_plain_attention(q, k, v, 0.25, m), ref).item()


def test_plan_free_attention_generates_what_the_fused_path_does(demo, monkeypatch):
    """With the plan-free attention in place (as on CUDA), a cold prompt, a batch of
    unequal prompts and a cache hit generate the tokens mlx-lm's own caches give."""
    import sys

    from kvroute.backend import attention
    from mlx_lm.models import base

    wrapped = attention.plan_free(base.scaled_dot_product_attention)
    model, tok = demo
    monkeypatch.setattr(sys.modules[type(model).__module__], "scaled_dot_product_attention",
                        wrapped)
    monkeypatch.setattr(attention, "_full_chunk", 16)
    calls, plain = [], attention._plain_attention
    monkeypatch.setattr(attention, "_plain_attention",
                        lambda *a: calls.append(a[0].shape) or plain(*a))
    prompts = _prompts(len(tok.vocab) if hasattr(tok, "vocab") else 1000, [40, 5, 47, 21])
    ref = _greedy(model, prompts, [make_prompt_cache(model) for _ in prompts])
    assert not calls  # mlx-lm's own caches keep mlx-lm's attention
    got = _greedy(model, prompts, [new_cache(model) for _ in prompts])
    assert got == ref and calls
    hit = new_cache(model)
    model(mx.array([prompts[0][:30]]), cache=hit)
    assert _greedy(model, [prompts[0]], [hit])[0] == ref[0]



def test_kept_buffer_cache_generates_the_same_and_keeps_buffers(demo, monkeypatch):
    """On a GPU the engine stops mlx-lm's generator from emptying MLX's buffer cache
    after every prefill chunk (backend/mlx_patches.py keep_buffer_cache): the tokens are
    the same, the generator's freed buffers stay cached, everything else of mlx.core
    is what the generator sees."""
    import importlib

    from kvroute.backend.mlx_patches import keep_buffer_cache

    generate = importlib.import_module("mlx_lm.generate")

    model, tok = demo
    prompts = _prompts(len(tok.vocab) if hasattr(tok, "vocab") else 1000, [40, 5, 47])
    ref = _greedy(model, prompts, [new_cache(model) for _ in prompts])
    monkeypatch.setattr(generate, "mx", generate.mx)  # undone after the test
    keep_buffer_cache()
    keep_buffer_cache()  # once is enough: a second call changes nothing
    assert generate.mx.array is mx.array and generate.mx._module is mx
    assert _greedy(model, prompts, [new_cache(model) for _ in prompts]) == ref
    mx.eval(mx.zeros((1 << 20,)) + 1)  # its inputs' buffers go back to the cache
    # Nothing else may free into the cache between the two readings: the generators'
    # garbage (reference cycles) is collected now, not at some allocation below.
    gc.collect()
    mx.synchronize()
    held = mx.get_cache_memory()
    generate.mx.clear_cache()  # what the generator calls after each chunk
    assert held > 0 and mx.get_cache_memory() == held


@pytest.mark.parametrize("budget", [0.0, 600.0])
def test_the_cuda_warm_up_keeps_within_its_time(text_model, monkeypatch, caplog, budget):
    """A model that prefills slowly on CUDA (a hybrid's per-token recurrence) must not
    spend minutes warming up before it says healthy: the spread of prompt lengths and
    the long prompt stop when WARM_CUDA_SECONDS is over. There is no CUDA here: the
    in-process engine is told it is on CUDA (what warm-up runs is the same)."""
    import logging

    from kvroute.backend import engine as engine_mod
    from kvroute.backend.metrics import BackendMetrics
    from kvroute.backend.store import Store

    model, tokenizer = load(str(text_model))
    e = engine_mod.Engine(model, tokenizer, "demo", Store(64 << 20), BackendMetrics("demo", "t"),
                          prefill_step=64, max_batch=4)
    e.on_cuda = True
    monkeypatch.setattr(engine_mod, "WARM_CUDA_SECONDS", budget)
    caplog.set_level(logging.INFO, "kvroute.backend.engine")
    e.warm_up(long_tokens=300)
    said = " ".join(r.getMessage() for r in caplog.records)
    if budget:
        assert "warmed up to 300 tokens" in said and "time is up" not in said
    else:
        assert "time is up" in said and "warmed up to" not in said
    assert e.prefill_tps > 0  # the warm rate the proxies see is measured either way


def test_on_a_card_running_low_a_backend_gives_its_buffer_cache_back(text_model, monkeypatch, caplog):
    """Replicas share one CUDA card, and MLX caps only its own memory: when the card's
    free memory (the driver's count, every process's) falls under the reserve (6% of
    the card, 2 GiB at least), a backend lets its buffer cache go before its next step,
    counts it, and says so at most once a minute; with room on the card it keeps the
    cache. There is no CUDA card here: the in-process engine is told it is on CUDA and
    the driver's count is stood in for; the buffer cache is MLX's own."""
    import logging

    from kvroute.backend import engine as engine_mod
    from kvroute.backend.metrics import BackendMetrics
    from kvroute.backend.store import Store

    import time

    model, tokenizer = load(str(text_model))
    metrics = BackendMetrics("demo", "t")
    e = engine_mod.Engine(model, tokenizer, "demo", Store(64 << 20), metrics, prefill_step=64, max_batch=4)
    e.on_cuda = True
    caplog.set_level(logging.INFO, "kvroute.backend.engine")
    total = 80 << 30
    free = {"bytes": 40 << 30}
    monkeypatch.setattr(engine_mod, "card_memory", lambda: (free["bytes"], total))

    def fill_cache() -> int:
        a = mx.zeros((1 << 20,))
        mx.eval(a)
        del a
        return mx.get_cache_memory()

    def low() -> float:
        return metrics.registry.get_sample_value("kvroute_backend_card_low_total",
                                                 {"model": "demo", "backend": "t"})

    assert fill_cache() > 0
    e._mind_the_card()
    assert mx.get_cache_memory() > 0 and low() == 0  # room on the card: kept
    free["bytes"] = int(engine_mod.CARD_RESERVE * total) + 1  # above the reserve: kept
    e._card_checked -= engine_mod.CARD_CHECK_S
    e._mind_the_card()
    assert mx.get_cache_memory() > 0 and low() == 0
    free["bytes"] = int(engine_mod.CARD_RESERVE * total) - 1
    e._card_checked = time.monotonic()
    e._mind_the_card()
    assert mx.get_cache_memory() > 0  # looked at no more often than CARD_CHECK_S
    e._card_checked -= engine_mod.CARD_CHECK_S
    e._mind_the_card()
    assert mx.get_cache_memory() == 0 and low() == 1
    assert fill_cache() > 0
    e._card_checked -= engine_mod.CARD_CHECK_S
    e._mind_the_card()
    assert mx.get_cache_memory() == 0 and low() == 2
    total = 16 << 30  # a small card: the reserve is CARD_RESERVE_MIN, not 6% of it
    free["bytes"] = engine_mod.CARD_RESERVE_MIN - 1
    assert fill_cache() > 0
    e._card_checked -= engine_mod.CARD_CHECK_S
    e._mind_the_card()
    assert mx.get_cache_memory() == 0 and low() == 3
    said = [r.getMessage() for r in caplog.records if "gave back" in r.getMessage()]
    assert len(said) == 1 and "of MLX's buffer cache" in said[0]


@pytest.mark.skipif(not (hasattr(mx, "cuda") and mx.cuda.is_available()),
                    reason="needs a CUDA GPU (CUDA's memory pool)")
def test_on_a_gpu_the_pool_figures_follow_what_mlx_holds():
    """On a real card: the pool's "in use" grows by what MLX allocates, and what MLX
    frees in whole (its buffer cache emptied) goes back to the card at once, without a
    trim; what a pool keeps beyond "in use" is holes between live arrays."""
    from kvroute.core import accel

    mx.synchronize()
    held0, used0 = accel.pool_memory()
    a = [mx.zeros((1 << 26,), dtype=mx.float32) for _ in range(8)]  # 2 GiB
    mx.eval(a)
    held1, used1 = accel.pool_memory()
    assert used1 - used0 >= 2 << 30 and held1 >= used1
    free1, _ = accel.card_memory()
    del a
    mx.clear_cache()
    mx.synchronize()
    held2, used2 = accel.pool_memory()
    free2, _ = accel.card_memory()
    assert used1 - used2 >= 2 << 30 and held1 - held2 >= (2 << 30) - (64 << 20)
    assert free2 - free1 >= (2 << 30) - (64 << 20)


def test_cudas_pool_figures_ask_the_runtime_and_never_raise(monkeypatch):
    """`pool_memory` reads the default pool's reserved and used bytes (/health and
    kvroute_backend_memory_bytes show them); a runtime that refuses gives None. There
    is no CUDA runtime here: a stand-in answers as the real one does."""
    import ctypes

    from kvroute.core import accel

    class Runtime:
        def __init__(self, refuse: str = ""):
            self.calls, self.refuse = [], refuse

        def cudaGetDevice(self, device):
            self.calls.append("cudaGetDevice")
            return 0

        def cudaDeviceGetDefaultMemPool(self, pool, device):
            self.calls.append("cudaDeviceGetDefaultMemPool")
            return int(self.refuse == "pool")

        def cudaMemPoolGetAttribute(self, pool, attr, value):
            self.calls.append(f"attr {attr.value}")
            ctypes.cast(value, ctypes.POINTER(ctypes.c_uint64))[0] = {5: 7 << 30, 7: 5 << 30}[attr.value]
            return int(self.refuse == "attr")

    r = Runtime()
    monkeypatch.setattr(accel, "cuda_runtime", lambda: r)
    assert accel.pool_memory() == (7 << 30, 5 << 30)
    assert r.calls == ["cudaGetDevice", "cudaDeviceGetDefaultMemPool", "attr 5", "attr 7"]
    for refuse in ("pool", "attr"):
        monkeypatch.setattr(accel, "cuda_runtime", lambda r=Runtime(refuse): r)
        assert accel.pool_memory() is None
    monkeypatch.setattr(accel, "cuda_runtime", lambda: None)
    assert accel.pool_memory() is None


def test_out_of_device_memory_past_a_step_fails_its_requests_with_a_503_and_serves_on(text_model):
    """A failed step's recovery (it re-admits what was in prefill), or a commit after
    a step, can find the card full too: the error then reaches the engine loop, whose
    requests fail with the same 503 to retry as a failed step's (not a 500 "Internal
    engine error"), and the engine serves the next request. In process, the demo
    model; there is no card here to fill: MLX's CUDA allocation error is raised where
    the engine hands a step's results on."""
    import asyncio

    from kvroute.api.errors import APIError
    from kvroute.backend import engine as engine_mod
    from kvroute.backend.jobs import Delta, Finish, Job
    from kvroute.backend.metrics import BackendMetrics
    from kvroute.backend.requests import SamplingParams
    from kvroute.backend.store import Store

    model, tokenizer = load(str(text_model))
    e = engine_mod.Engine(model, tokenizer, "demo", Store(64 << 20), BackendMetrics("demo", "t"),
                          prefill_step=16, max_batch=4)
    real, failures = e._after_sending, [RuntimeError("cudaMallocAsync(&data, size, stream) failed: "
                                                     "out of memory")]

    def after_sending():
        if failures:
            raise failures.pop()
        real()

    e._after_sending = after_sending
    e.start()

    async def turn():
        job = Job(prompt=tokenizer.encode("hello there, how are you"), params=SamplingParams(temperature=0.0),
                  max_tokens=6, tools=None, loop=asyncio.get_running_loop(), events=asyncio.Queue())
        e.submit(job)
        while isinstance(event := await asyncio.wait_for(job.events.get(), 60), Delta):
            pass
        return event

    try:
        failed = asyncio.run(turn())
        assert isinstance(failed, APIError) and failed.status == 503, failed
        assert "out of device memory" in failed.message and "retry" in failed.message
        assert isinstance(asyncio.run(turn()), Finish)
    finally:
        e.stop()




def test_the_engine_measures_its_prefill_rate_and_decode_steps_from_its_steps(text_model):
    """The proxies route by each backend's prefill rate and decode steps per second
    (its /health), which the engine measures from the generator's own counts, step by
    step: a request's prompt and its decode leave both rates above zero, and a
    longer prompt moves the prefill rate. In process, the demo model."""
    import asyncio

    from kvroute.backend import engine as engine_mod
    from kvroute.backend.jobs import Delta, Finish, Job
    from kvroute.backend.metrics import BackendMetrics
    from kvroute.backend.requests import SamplingParams
    from kvroute.backend.store import Store

    model, tokenizer = load(str(text_model))
    e = engine_mod.Engine(model, tokenizer, "demo", Store(64 << 20), BackendMetrics("demo", "t"),
                          prefill_step=16, max_batch=4)
    assert e.prefill_tps == 0 and e.decode_steps_per_s == 0
    e.start()

    async def turn(words: int) -> None:
        job = Job(prompt=tokenizer.encode(" ".join(["hello"] * words)), params=SamplingParams(temperature=0.0),
                  max_tokens=8, tools=None, loop=asyncio.get_running_loop(), events=asyncio.Queue())
        e.submit(job)
        while isinstance(event := await asyncio.wait_for(job.events.get(), 60), Delta):
            pass
        assert isinstance(event, Finish), event

    try:
        asyncio.run(turn(20))
        first, steps = e.prefill_tps, e.decode_steps_per_s
        assert first > 0 and steps > 0
        asyncio.run(turn(60))
        assert e.prefill_tps != first and e.decode_steps_per_s > 0
    finally:
        e.stop()

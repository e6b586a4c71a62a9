"""The gated-delta recurrence by chunks (chunked_delta.py), which CUDA backends run for
Qwen3-Next's and Qwen3.5's linear layers instead of mlx-lm's per-token loop.

Held to the loop: outputs and final states agree to float32 rounding for every shape
a prompt gives it (grouped heads, lengths not a multiple of the chunk, a left-padded
batch row, no state yet), on the tiny random-weight Qwen3-Next too. The GPU cannot
run here: these run on MLX's CPU backend, the same operations."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models import gated_delta
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.gated_delta import normalize_qk

from kvroute.backend import chunked_delta, mlx_patches
from kvroute.backend.chunked_delta import gated_delta_chunked
from kvroute.devtools import arch_models

LOOP = gated_delta.gated_delta_ops


def inputs(b: int, t: int, hk: int, hv: int, dk: int, dv: int, seed: int = 0, dtype=mx.bfloat16):
    keys = mx.random.split(mx.random.key(seed), 6)
    q = mx.random.normal((b, t, hk, dk), key=keys[0]).astype(dtype)
    k = mx.random.normal((b, t, hk, dk), key=keys[1]).astype(dtype)
    q, k = normalize_qk(q, k, inv_scale=dk ** -0.5, eps=1e-6)
    v = mx.random.normal((b, t, hv, dv), key=keys[2]).astype(dtype)
    g = mx.exp(-0.3 * mx.exp(0.5 * mx.random.normal((b, t, hv), key=keys[3])))
    beta = mx.sigmoid(mx.random.normal((b, t, hv), key=keys[4]))
    state = 0.1 * mx.random.normal((b, hv, dv, dk), key=keys[5])
    return q, k, v, g, beta, state


def gap(x: mx.array, y: mx.array) -> float:
    x, y = x.astype(mx.float32), y.astype(mx.float32)
    return (mx.max(mx.abs(x - y)) / mx.max(mx.abs(x))).item()


@pytest.mark.parametrize("b,t,hk,hv,dk,dv", [
    (1, 64, 2, 2, 32, 32),    # one whole chunk
    (1, 200, 2, 4, 32, 16),   # grouped heads, a padded last chunk
    (2, 130, 1, 2, 16, 8),    # a batch
    (1, 40, 2, 2, 128, 128),  # less than a chunk, Qwen3-Next's head size
])
def test_chunks_agree_with_the_loop(b, t, hk, hv, dk, dv):
    q, k, v, g, beta, state = inputs(b, t, hk, hv, dk, dv)
    y0, s0 = LOOP(q, k, v, g, beta, state)
    y1, s1 = gated_delta_chunked(q, k, v, g, beta, state)
    assert y1.shape == y0.shape and y1.dtype == y0.dtype and s1.shape == s0.shape
    assert gap(s0, s1) < 1e-5
    assert gap(y0, y1) < 2e-2  # y is bfloat16: its rounding, not the recurrence's


def test_float32_outputs_agree_closely_and_no_state_is_zeros():
    q, k, v, g, beta, _ = inputs(1, 150, 2, 4, 32, 32, seed=3, dtype=mx.float32)
    y0, s0 = LOOP(q, k, v, g, beta, None)
    y1, s1 = gated_delta_chunked(q, k, v, g, beta, None)
    assert gap(y0, y1) < 1e-5 and gap(s0, s1) < 1e-5


def test_a_chunk_of_near_identical_keys():
    """A run of one token (spaces, a repeated line) gives a chunk of near-identical
    keys with steps near 1 and little decay: where the chunk's triangular inverse was
    a product of powers, those powers grew to ~1e17 and the state came out as noise."""
    keys = mx.random.split(mx.random.key(5), 4)
    one = mx.random.normal((1, 1, 2, 32), key=keys[0])
    k = mx.broadcast_to(one, (1, 128, 2, 32)) + 0.01 * mx.random.normal((1, 128, 2, 32), key=keys[1])
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    q = mx.random.normal((1, 128, 2, 32), key=keys[2]) * 32 ** -0.5
    v = mx.random.normal((1, 128, 2, 32), key=keys[3])
    g, beta = mx.full((1, 128, 2), 0.999), mx.full((1, 128, 2), 0.95)
    y0, s0 = LOOP(q, k, v, g, beta, None)
    y1, s1 = gated_delta_chunked(q, k, v, g, beta, None)
    assert gap(y0, y1) < 1e-4 and gap(s0, s1) < 1e-4


def test_a_masked_step_leaves_the_state_as_it_was():
    """A left-padded batch row (mlx-lm's batched prefill): the padding's steps change
    nothing, and the kept positions' outputs agree."""
    q, k, v, g, beta, state = inputs(2, 100, 2, 4, 32, 32, seed=1, dtype=mx.float32)
    mask = mx.arange(100)[None, :] >= mx.array([[0], [37]])
    y0, s0 = LOOP(q, k, v, g, beta, state, mask)
    y1, s1 = gated_delta_chunked(q, k, v, g, beta, state, mask)
    assert gap(s0, s1) < 1e-5
    assert gap(y0[1, 37:], y1[1, 37:]) < 1e-5 and gap(y0[0], y1[0]) < 1e-5
    _, alone = gated_delta_chunked(q[1:, 37:], k[1:, 37:], v[1:, 37:], g[1:, 37:], beta[1:, 37:], state[1:])
    assert gap(alone, s1[1:]) < 1e-5  # as if the padding were not there


def test_decode_steps_and_vector_gates_keep_the_loop():
    calls = []

    def loop(*args):
        calls.append(args[0].shape[1])
        return LOOP(*args)

    ops = chunked_delta.ops_with_chunks(loop)
    q, k, v, g, beta, state = inputs(1, 100, 2, 2, 16, 16, seed=2)
    ops(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], state)  # a decode step
    ops(q, k, v, mx.repeat(g[..., None], 16, -1), beta, state)  # a vector gate
    ops(q, k, v, g, beta, state)  # a prompt: by chunks
    assert calls == [1, 100]


def test_the_device_check_refuses_a_chunked_form_that_disagrees(monkeypatch):
    monkeypatch.setattr(gated_delta, "gated_delta_ops", LOOP)
    monkeypatch.setattr(chunked_delta, "gated_delta_chunked",
                        lambda q, k, v, g, beta, state=None, mask=None: LOOP(q, k, v, g * 0.9, beta, state, mask))
    assert mlx_patches.chunked_gated_delta() is None
    assert gated_delta.gated_delta_ops is LOOP


def test_the_tiny_qwen3_next_answers_as_with_the_loop(model_cache, monkeypatch):
    """The whole model, prefilled in two calls (a cache hit's shape), with the patch a
    CUDA backend applies and without it: the same logits to float32 rounding."""
    path = arch_models.ensure("qwen3_next", cache_dir=model_cache)
    model, tokenizer = load(str(path))
    assert mlx_patches.uses_gated_delta(model)
    tokens = mx.array(tokenizer.encode("Which ticket blocks the Thursday release, and who owns it? " * 4))[None]

    def logits() -> mx.array:
        cache = make_prompt_cache(model)
        model(tokens[:, :70], cache=cache)
        return model(tokens[:, 70:], cache=cache)[:, -1].astype(mx.float32)

    monkeypatch.setattr(gated_delta, "gated_delta_ops", LOOP)
    before = logits()
    runs = []
    monkeypatch.setattr(chunked_delta, "gated_delta_chunked",
                        lambda *a, **kw: runs.append(a[0].shape[1]) or gated_delta_chunked(*a, **kw))
    error = mlx_patches.chunked_gated_delta()
    assert error is not None and error < 1e-4
    assert getattr(gated_delta.gated_delta_ops, "kvroute_chunked", False)
    runs.clear()  # the device check's own run
    after = logits()
    rest = tokens.shape[1] - 70
    assert runs == [70, 70, rest, rest]  # both linear layers, both calls, by chunks
    assert gap(before, after) < 1e-4
    assert mx.argmax(before).item() == mx.argmax(after).item()


def test_an_engine_on_cuda_prefills_a_hybrid_by_chunks(model_cache, monkeypatch):
    """What the engine does when it finds CUDA (told so here): a model with gated-delta
    layers gets the chunked form; on a CPU or a Mac the loop stays (hits there answer
    bit for bit as a cold prefill)."""
    from kvroute.backend import engine as engine_mod
    from kvroute.backend.metrics import BackendMetrics
    from kvroute.backend.store import Store

    path = arch_models.ensure("qwen3_next", cache_dir=model_cache)
    model, tokenizer = load(str(path))
    monkeypatch.setattr(gated_delta, "gated_delta_ops", LOOP)
    engine_mod.Engine(model, tokenizer, "q", Store(16 << 20), BackendMetrics("q", "t"), prefill_step=64)
    assert gated_delta.gated_delta_ops is LOOP  # this CPU: no CUDA
    monkeypatch.setattr(engine_mod, "avoid_cudnn_plans", lambda step: True)
    engine_mod.Engine(model, tokenizer, "q", Store(16 << 20), BackendMetrics("q", "t"), prefill_step=64)
    assert getattr(gated_delta.gated_delta_ops, "kvroute_chunked", False)

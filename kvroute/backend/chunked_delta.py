"""The gated-delta recurrence (Qwen3-Next's and Qwen3.5's linear-attention layers) by
chunks of tokens, for where mlx-lm has no fused kernel.

mlx-lm runs the recurrence through a Metal kernel on a Mac and, everywhere else, as a
Python loop of about ten small operations per token of the prompt: on an H200 a
7B-class hybrid prefilled ~500 tokens/s that way, every operation a kernel launch.
The same recurrence over a chunk of C tokens is a few matrix products (the chunked
form of Gated DeltaNet, Yang et al. 2024), so a prompt costs about ten operations per
chunk, most of them batched over all chunks at once.

Per head, with the state S (Dv x Dk), decay g_t, step beta_t, key k_t, value v_t:
    S_t = g_t S_{t-1} + u_t k_t^T,   u_t = beta_t (v_t - g_t S_{t-1} k_t),   y_t = S_t q_t.
Within a chunk, with gamma_t the product of g up to t and S0 the state before it:
    (I + A) U = diag(beta) V - diag(beta gamma) K S0^T,
        A[t, s] = beta_t (gamma_t / gamma_s) k_t . k_s   for s < t
    Y = diag(gamma) Q S0^T + (M * Q K^T) U,   M[t, s] = gamma_t / gamma_s for s <= t
    S_C = gamma_C S0 + U^T diag(gamma_C / gamma) K
(I + A) is unit lower triangular: its inverse is built by doubling inverted diagonal
blocks, a few batched matrix products a level, no solve. Decays are taken as logs and
differenced before `exp`, so no ratio overflows.

It is the same recurrence, not the same rounding: outputs agree with the loop to
float32 precision (tests/test_chunked_delta.py), not bit for bit, which is why it
runs only where the engine turns it on (CUDA), never on a machine whose cache hits
are held to equal a cold prefill bit for bit. MLX multiplies float32 matrices on
CUDA in TF32 unless MLX_ENABLE_TF32=0 (a 10-bit mantissa, ~1e-3, still finer than
the bfloat16 the model runs in); the check at start (mlx_patches.chunked_gated_delta)
measures the agreement on the device and keeps the loop past 2e-2.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

CHUNK = 64
MIN_TOKENS = 32  # shorter runs (decode steps) keep mlx-lm's loop: fewer operations


def _unit_lower_inverse(a: mx.array) -> mx.array:
    """(I + a)^-1 for strictly lower triangular `a` ([..., C, C], C a power of two), by
    doubling the diagonal blocks already inverted: the inverse of [[L1, 0], [A, L2]] is
    [[L1^-1, 0], [-L2^-1 A L1^-1, L2^-1]]. Every product is of true inverse blocks, so
    it is as stable as forward substitution; the shorter way, the product of
    (I + N^(2^j)) for N = -a, is not: with a chunk of near-identical keys N's powers
    grow to binomial sizes and cancel (tests/test_chunked_delta.py has that prompt)."""
    c = a.shape[-1]
    lead = a.shape[:-2]
    inv = mx.ones((*lead, c, 1, 1), dtype=a.dtype)  # C blocks of 1 x 1: the unit diagonal
    b = 1
    while b < c:
        pairs = c // (2 * b)
        blocks = a.reshape(*lead, pairs, 2, b, pairs, 2, b)
        # The lower-left b x b block of each 2b x 2b diagonal block: [..., pairs, b, b].
        diag = mx.diagonal(blocks, axis1=-6, axis2=-3)  # [..., 2, b, 2, b, pairs]
        lower = mx.moveaxis(diag[..., 1, :, 0, :, :], -1, -3)
        first, second = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        corner = -(second @ lower @ first)
        top = mx.concatenate([first, mx.zeros_like(first)], axis=-1)
        inv = mx.concatenate([top, mx.concatenate([corner, second], axis=-1)], axis=-2)
        b *= 2
    return inv[..., 0, :, :]


def gated_delta_chunked(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
                        state: mx.array | None = None, mask: mx.array | None = None,
                        chunk: int = CHUNK) -> tuple[mx.array, mx.array]:
    """mlx-lm's `gated_delta_ops` (scalar gating), by chunks. Shapes as there:
    q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; state [B, Hv, Dv, Dk];
    mask [B, T] (a masked step leaves the state as it was). Returns y [B, T, Hv, Dv]
    in q's dtype and the state in float32."""
    b, t, hk, dk = q.shape
    hv, dv = v.shape[-2:]
    out_dtype = q.dtype
    if state is None:
        state = mx.zeros((b, hv, dv, dk), dtype=mx.float32)
    if hv // hk > 1:
        q, k = mx.repeat(q, hv // hk, -2), mx.repeat(k, hv // hk, -2)
    f32 = mx.float32
    q, k, v, beta = (x.astype(f32) for x in (q, k, v, beta))
    log_g = mx.log(mx.maximum(g.astype(f32), 1e-30))
    if mask is not None:  # a masked step: no decay, no update
        keep = mask.astype(mx.bool_)[..., None]
        log_g = mx.where(keep, log_g, 0.0)
        beta = mx.where(keep, beta, 0.0)
    n = -(-t // chunk)
    pad = n * chunk - t
    if pad:  # padded steps neither decay nor update; their outputs are dropped
        q, k, v = (mx.pad(x, [(0, 0), (0, pad), (0, 0), (0, 0)]) for x in (q, k, v))
        log_g, beta = (mx.pad(x, [(0, 0), (0, pad), (0, 0)]) for x in (log_g, beta))

    def chunks(x: mx.array) -> mx.array:  # [B, T, H, ...] -> [B, H, n, C, ...]
        x = x.reshape(b, n, chunk, hv, -1)
        return x.transpose(0, 3, 1, 2, 4)

    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    cum = chunks(log_g)[..., 0].astype(f32).cumsum(axis=-1)  # log gamma, [B, H, n, C]
    bc = chunks(beta)[..., 0]
    rows = mx.arange(chunk)
    upto = rows[:, None] >= rows[None, :]  # s <= t
    before = rows[:, None] > rows[None, :]  # s < t
    diff = cum[..., :, None] - cum[..., None, :]
    ratio = mx.where(upto, mx.exp(mx.where(upto, diff, 0.0)), 0.0)  # gamma_t / gamma_s
    kkt = kc @ kc.swapaxes(-1, -2)
    a = mx.where(before, bc[..., None] * ratio * kkt, 0.0)
    inv = _unit_lower_inverse(a)
    gamma = mx.exp(cum)
    u0 = inv @ (bc[..., None] * vc)  # [B, H, n, C, Dv]
    w = inv @ ((bc * gamma)[..., None] * kc)  # [B, H, n, C, Dk]
    p = (qc @ kc.swapaxes(-1, -2)) * ratio  # [B, H, n, C, C]
    qg = gamma[..., None] * qc
    kt = mx.exp(cum[..., -1:] - cum)[..., None] * kc  # (gamma_C / gamma_s) k_s
    gc = mx.exp(cum[..., -1])[..., None, None]  # [B, H, n, 1, 1]
    s = state.astype(f32)
    ys = []
    for i in range(n):
        st = s.swapaxes(-1, -2)  # [B, H, Dk, Dv]
        u = u0[:, :, i] - w[:, :, i] @ st
        ys.append(qg[:, :, i] @ st + p[:, :, i] @ u)
        s = gc[:, :, i] * s + u.swapaxes(-1, -2) @ kt[:, :, i]
    y = mx.stack(ys, axis=2).transpose(0, 2, 3, 1, 4).reshape(b, n * chunk, hv, dv)
    return y[:, :t].astype(out_dtype), s


def ops_with_chunks(loop: Any) -> Any:
    """`gated_delta_ops` that runs prompts of MIN_TOKENS or more by chunks (scalar
    gating; a vector gate, and decode steps, keep `loop`)."""

    def ops(q, k, v, g, beta, state=None, mask=None):
        if g.ndim != 3 or q.shape[1] < MIN_TOKENS:
            return loop(q, k, v, g, beta, state, mask)
        return gated_delta_chunked(q, k, v, g, beta, state, mask)

    ops.kvroute_chunked = True  # type: ignore[attr-defined]
    return ops

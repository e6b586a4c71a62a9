"""KV caches that let a batch use the fused causal attention kernel.

mlx-lm's `BatchKVCache` always hands the model an explicit boolean mask (it
allows for left padding), and an explicit mask keeps `scaled_dot_product_attention`
off its fused causal kernel: on a GPU a long prefill then materialises every
query×key score and runs several times slower than a single sequence does with a
plain `KVCache` (mask "causal"), and a decode step takes the masked path too.

`FastBatchKVCache` keeps a Python copy of each row's left padding, so asking
"is there any padding?" costs no device synchronisation, and returns the
string "causal" (prefill) or no mask at all (decode) while no row is padded: one
sequence alone, or rows of equal length. With padding it falls back to mlx-lm's
mask, so results are the same either way (tested against the masked path).

Only the generator's working caches are of these classes: `extract` gives plain
`KVCache`s back, so what the prompt-cache store keeps is mlx-lm's own type.

The same mirror makes a decode step cheaper: unpadded, every row's position is
one Python int, so RoPE takes its scalar path and no per-layer array update of
the offsets is queued (on a GPU, where a 7B decode step is a few milliseconds of
small kernels, each of those costs a launch).
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache


# MLX on CUDA sends a decode step's attention to cuDNN when the keys are a slice of a
# buffer whose length is a multiple of 256 (how mlx-lm's caches grow), and cuDNN
# builds a plan for each row count and buffer length the process has not run yet:
# ~50 ms on an H200 (0.4-0.7 s for some lengths), paid by the first token of a
# prompt of a new length, and again whenever a batch's buffer grows to a length or
# its row count changes to one the plan cache (256 entries) does not hold. MLX's
# own vector kernel needs no plan and is as fast while rows x buffer tokens are
# few (up to ~8k); beyond that it is slower per step (8 rows at 16k tokens: 0.34
# against 0.07 ms a layer), which over the 256 steps a buffer lasts outweighs one
# plan. So a working cache's buffer misses cuDNN's test (a few unused slots) when
# it grows for a prompt or suffix, so that no first token waits for a plan, and
# when it is small; it passes the test when it grows during a long decode.
CUDNN_DECODE_STEP = 256
DECODE_SLACK = 8
VECTOR_DECODE_TOKENS = 8192  # rows x buffer length kept off cuDNN during decode


def buffer_length(prev: int, n: int, rows: int, step: int) -> int:
    """The length a working cache's buffer grows to when `n` tokens join `prev`:
    rounded up to a multiple of `step` (a decode step from a full buffer grows it
    by one `step`, as mlx-lm's caches do), plus the slack that keeps it off cuDNN's
    decode path (see above)."""
    length = -(-(prev + n) // step) * step
    if length % CUDNN_DECODE_STEP == 0 and (n > 1 or rows * length <= VECTOR_DECODE_TOKENS):
        length += DECODE_SLACK
    return length


class FastKVCache(KVCache):
    """A `KVCache` whose batch form is a `FastBatchKVCache`."""

    @classmethod
    def merge(cls, caches: list[Any]) -> "FastBatchKVCache":
        return FastBatchKVCache.merge(caches)


class FastBatchKVCache(BatchKVCache):
    def __init__(self, left_padding: list[int]):
        self._pad = [int(p) for p in left_padding]  # mirrors self.left_padding
        self._rpad: list[int] | None = None  # mirrors right padding while it is pending
        self._array_offset = False
        self._offsets: tuple[tuple, mx.array] | None = None
        super().__init__(left_padding)

    # Each row's position is always _idx - its left padding (mlx-lm keeps the same
    # quantity as an array, updated by one more kernel per layer and step). Unpadded,
    # every row is at _idx: a plain int, which RoPE takes on its scalar path, as for
    # a single sequence's KVCache. Assignments from mlx-lm's own methods are ignored.
    @property
    def offset(self) -> Any:
        if not self._array_offset and not self.padded:
            return self._idx
        key = (self._idx, tuple(self._pad))
        if self._offsets is None or self._offsets[0] != key:
            self._offsets = (key, mx.array([self._idx - p for p in self._pad]))
        return self._offsets[1]

    @offset.setter
    def offset(self, value: Any) -> None:
        pass

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        prev = self._idx
        if self.keys is None or (prev + keys.shape[2]) > self.keys.shape[2]:
            B, n_kv_heads, _, k_head_dim = keys.shape
            grow = buffer_length(prev, keys.shape[2], B, self.step) - prev
            new_k = mx.zeros((B, n_kv_heads, grow, k_head_dim), keys.dtype)
            new_v = mx.zeros((B, n_kv_heads, grow, values.shape[3]), values.dtype)
            if self.keys is not None:
                if prev != self.keys.shape[2]:
                    self.keys = self.keys[..., :prev, :]
                    self.values = self.values[..., :prev, :]
                self.keys = mx.concatenate([self.keys, new_k], axis=2)
                self.values = mx.concatenate([self.values, new_v], axis=2)
            else:
                self.keys, self.values = new_k, new_v
        self._idx += keys.shape[2]
        self.keys[..., prev : self._idx, :] = keys
        self.values[..., prev : self._idx, :] = values
        return self.keys[..., : self._idx, :], self.values[..., : self._idx, :]

    @classmethod
    def merge(cls, caches: list[Any]) -> "FastBatchKVCache":
        if all(c.size() == 0 for c in caches):
            return cls([0] * len(caches))  # mlx-lm's merge names its own class here
        if len(caches) == 1 and caches[0].keys is not None:
            # One sequence (a cache hit): a batch of one is its own arrays, no copy of
            # the whole state into fresh zeros (on a GPU, gigabytes at 30k tokens). They
            # may be shared with the store's entry: MLX updates are functional, so the
            # first write here copies rather than change the entry.
            (one,) = caches
            cache = cls([0])
            cache.keys, cache.values = one.keys[..., : one.offset, :], one.values[..., : one.offset, :]
            cache._idx = one.offset
            return cache
        cache = super().merge(caches)
        cache._offsets = None  # its `offset += n` may have changed the cached array in place
        return cache

    @property
    def padded(self) -> bool:
        return self._rpad is not None or any(self._pad)

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        if return_array or kwargs.get("window_size") or self.padded:
            return super().make_mask(N, return_array=return_array, **kwargs)
        # Every row starts at position 0: the kernel's own causal mask (aligned to
        # the end of the keys, as for a plain KVCache) is exact; a decode step
        # attends to everything.
        return "causal" if N > 1 else None

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        super().prepare(left_padding=left_padding, lengths=lengths, right_padding=right_padding)
        if left_padding is not None:
            self._pad = [a + int(b) for a, b in zip(self._pad, left_padding)]
        if right_padding is not None and max(right_padding) > 0:
            self._rpad = [int(p) for p in right_padding]

    def finalize(self) -> None:
        super().finalize()
        if self._rpad is not None:
            self._pad = [a + b for a, b in zip(self._pad, self._rpad)]
            self._rpad = None

    def __deepcopy__(self, memo: dict) -> "FastBatchKVCache":
        # mlx-lm deep-copies a prompt batch's caches when it hands sequences over to
        # decoding, then keeps only some rows of each copy (`filter`). MLX arrays are
        # never changed in place while shared, so the copy can share them: the state is
        # not copied on every prefill-to-decode hand-over.
        # (Each array gets a Python object of its own, over the same buffer: an indexed
        # assignment rebinds the object it is made on, which must not be the other's.)
        new = self.__class__.__new__(self.__class__)
        new.__dict__ = {
            k: list(v) if isinstance(v, list) else mx.stop_gradient(v) if isinstance(v, mx.array)
            else v
            for k, v in self.__dict__.items()
        }
        return new

    def filter(self, batch_indices: list[int]) -> None:
        if list(batch_indices) == list(range(len(self._pad))) and min(self._pad, default=0) == 0:
            return  # every row, in order, none to shift: nothing to gather
        # mlx-lm's filter reads the padding back from the device (a sync on every
        # finished sequence); the mirror answers the same question for free.
        if self.keys is not None:
            self.keys = self.keys[batch_indices]
            self.values = self.values[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        self._pad = [self._pad[i] for i in batch_indices]
        shift = min(self._pad) if self._pad else 0
        if shift > 0:
            if self.keys is not None:
                self.keys = self.keys[..., shift:, :]
                self.values = self.values[..., shift:, :]
            self._idx -= shift
            self.left_padding = self.left_padding - shift
            self._pad = [p - shift for p in self._pad]

    def extend(self, other: BatchKVCache) -> None:
        theirs = _padding_of(other)
        if self.keys is None and other.keys is None:
            pad = self._pad + theirs
        else:
            top = max(self._idx, other._idx)
            pad = [p + top - self._idx for p in self._pad] + [p + top - other._idx for p in theirs]
        # mlx-lm concatenates the rows' offsets: let both caches answer with arrays.
        self._array_offset = True
        if isinstance(other, FastBatchKVCache):
            other._array_offset = True
        try:
            super().extend(other)
        finally:
            self._array_offset = False
            if isinstance(other, FastBatchKVCache):
                other._array_offset = False
        self._pad = pad

    def extract(self, idx: int) -> KVCache:
        cache = KVCache()
        start = self._pad[idx]
        cache.keys = mx.contiguous(self.keys[idx : idx + 1, :, start : self._idx])
        cache.values = mx.contiguous(self.values[idx : idx + 1, :, start : self._idx])
        cache.offset = cache.keys.shape[2]
        return cache

    @property
    def state(self):
        return super().state

    @state.setter
    def state(self, v) -> None:
        self.keys, self.values, self.offset, self.left_padding, self._idx = v
        self._pad = _padding_of(self)
        self._rpad = None


def _padding_of(cache: BatchKVCache) -> list[int]:
    pad = getattr(cache, "_pad", None)
    return list(pad) if pad is not None else [int(p) for p in cache.left_padding.tolist()]


def fast(cache: list[Any]) -> list[Any]:
    """The same per-layer cache with its plain `KVCache` layers as `FastKVCache`s
    (sharing their arrays); other layer types are left as they are."""
    out = []
    for layer in cache:
        if type(layer) is KVCache:
            new = FastKVCache()
            new.keys, new.values, new.offset = layer.keys, layer.values, layer.offset
            layer = new
        out.append(layer)
    return out


def new_cache(model: Any) -> list[Any]:
    return fast(make_prompt_cache(model))


# -- attention without a per-shape plan (CUDA) ---------------------------------------
# On CUDA, MLX runs a multi-row attention call through cuDNN, which builds an
# execution plan for each exact shape of queries and keys (tens to hundreds of
# milliseconds) and keeps it in an LRU. A prompt's last, partial chunk and the
# suffix of a cache hit have shapes no request had before, so nearly every request
# paid a plan build: on an H200 a cold 2k prompt took 0.25 s at a new length and
# 0.08 s at a length seen before, a 70-token turn on a 31k cached prompt 0.12-0.19 s
# against 0.08 s. For such calls, when the scores are small, the plain attention
# below (MLX's own fallback arithmetic: matmul, mask, softmax with float32
# accumulation, matmul) costs a few milliseconds and no plan. Calls the size of a
# full prefill chunk repeat their shapes and keep cuDNN's fused kernel.

PLAN_FREE_SCORE_BYTES = 512 << 20  # float32 scores of one layer's call, at most
_full_chunk = 0  # the engine's prefill step: chunks of that size keep cuDNN


def _plain_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Any) -> mx.array:
    """softmax(q k^T * scale + mask) v, as MLX's fallback computes it (scores in the
    inputs' type, a precise softmax), with two savings that matter when a few
    queries meet a long cache (a cache hit's suffix): grouped query heads are
    folded into the rows of one matmul per key head, so keys and values are never
    repeated per query head, and a causal mask touches only the last L columns,
    the only ones it hides anything in."""
    B, Hq, L, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    rep = Hq // Hk
    q = (q * scale).reshape(B, Hk, rep * L, D)
    scores = (q @ k.swapaxes(-1, -2)).reshape(B, Hk, rep, L, S)
    low = mx.finfo(scores.dtype).min
    if isinstance(mask, str):  # "causal", aligned to the end of the keys (L <= S)
        # Query i sits at S - L + i: of the last L keys it may see the first i + 1.
        allowed = mx.arange(L)[:, None] >= mx.arange(L)[None]
        scores[..., S - L:] = mx.where(allowed, scores[..., S - L:], low)
    elif mask is not None:
        mask = mask[:, :, None] if mask.shape[1] == 1 else mask.reshape(B, Hk, rep, L, S)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, low)
        else:
            scores = scores + mask.astype(scores.dtype)
    weights = mx.softmax(scores, axis=-1, precise=True).reshape(B, Hk, rep * L, S)
    return (weights @ v).reshape(B, Hq, L, v.shape[-1])


def _plan_free(q: mx.array, k: mx.array, cache: Any, sinks: Any) -> bool:
    L, S = q.shape[2], k.shape[2]
    return (isinstance(cache, FastBatchKVCache) and sinks is None and 1 < L != _full_chunk
            and q.shape[0] * q.shape[1] * L * S * 4 <= PLAN_FREE_SCORE_BYTES)


def plan_free(original: Any) -> Any:
    """mlx-lm's attention function `original`, with the engine's calls of new shapes
    (see above) taken by `_plain_attention`."""
    def attention(queries, keys, values, cache, scale, mask, sinks=None):
        if _plan_free(queries, keys, cache, sinks):
            return _plain_attention(queries, keys, values, scale, mask)
        return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)

    return attention


def avoid_cudnn_plans(prefill_step: int) -> bool:
    """On CUDA, give mlx-lm's model modules (which import the attention function by
    name) the `plan_free` one. Returns whether it applied (CUDA only)."""
    global _full_chunk
    if not (hasattr(mx, "cuda") and mx.cuda.is_available()):
        return False
    _full_chunk = prefill_step
    from mlx_lm.models import base

    original = base.scaled_dot_product_attention
    wrapped = plan_free(original)
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and \
                getattr(module, "scaled_dot_product_attention", None) is original:
            module.scaled_dot_product_attention = wrapped
    return True

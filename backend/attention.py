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

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache


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
            n_steps = (self.step + keys.shape[2] - 1) // self.step
            new_k = mx.zeros((B, n_kv_heads, n_steps * self.step, k_head_dim), keys.dtype)
            new_v = mx.zeros((B, n_kv_heads, n_steps * self.step, values.shape[3]), values.dtype)
            if self.keys is not None:
                if prev % self.step != 0:
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

    def filter(self, batch_indices: list[int]) -> None:
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

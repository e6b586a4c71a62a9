"""Committed caches kept as token blocks, each stored once and shared by content.

A team's conversations share long prefixes (a system prompt, a tool list): kept as
whole states, that prefix would be held once per conversation. Here the layers that
hold exactly one key and one value per token (mlx-lm's `KVCache`: full attention)
are cut into blocks of `BLOCK_TOKENS` tokens. A block is named by a chain key over
its tokens and its parent's key (the registry's chain idea, core/prefix.py), so two
entries whose tokens pass through the same block name the same one and the `Pool`
stores it once, counting the entries that use it. Equal tokens after an equal prefix
mean equal keys and values (attention is causal), so sharing changes no answer.

What cannot be cut (a rotated sliding window, a recurrent state, a window that has
not rotated yet) stays whole in the entry, as before; the tokens after the last full
block (the *tail*) stay in the entry too. A hit assembles a working cache from its
blocks with one concatenation per group of same-shaped layers (a block stacks them:
MLX ops cost a fixed time each, so a block is one array of keys and one of values,
not two per layer): one copy, as the private copy was before. At least one token
stays in an entry's own tail. Measured on the 2-core VM (28 layers of 4 x 128 fp16,
16k tokens, 511 blocks): commit 1.1 s (two copies of the new tokens: stacked, then
cut), a hit 0.7 s, where one plain copy of that state took 1.3 s.

32 tokens a block: a conversation's private part costs at most one partial block
more than its own tokens (the block where it leaves the shared prefix), and a 32k
prompt is ~1,000 blocks, whose concatenation on a hit costs less than the copy.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
import xxhash
from mlx_lm.models.cache import CacheList, KVCache, trim_prompt_cache

from .join import join

BLOCK_TOKENS = 32

_H = xxhash.xxh3_64_intdigest


def root_key(model: str, scope: str | None) -> int:
    """The chain's start: blocks are never shared across models or cache scopes."""
    return _H(f"{model}\0{scope or ''}".encode())


def block_keys(root: int, tokens: np.ndarray, count: int) -> list[int]:
    """Keys of the first `count` full blocks of `tokens`: key_i = xxh3(key_{i-1} || block_i)."""
    # One byte string sliced per block: a numpy slice per block cost 3x (~1 ms at 32k).
    data = np.ascontiguousarray(tokens[:count * BLOCK_TOKENS], dtype=np.int32).tobytes()
    step, keys, parent = BLOCK_TOKENS * 4, [], root
    for at in range(0, count * step, step):
        parent = _H(parent.to_bytes(8, "little") + data[at:at + step])
        keys.append(parent)
    return keys


@dataclass(eq=False)
class Block:
    key: int
    # Per group of paged layers of one shape (usually one group: all of them): keys,
    # values [layers, heads, BLOCK, dim], the group's layers stacked, so that a block
    # costs one array each however many layers the model has (an MLX op has a fixed
    # cost: ~1,000 blocks x 56 arrays a 32k-token commit or hit took seconds on a CPU);
    # each a `Quantized` in a pool that stores blocks quantized.
    kv: list[tuple[Any, Any]]
    nbytes: int
    refs: int = 0


# Quantization groups: 64 values, along the head dimension where it holds whole groups
# (real models: 64, 128), else across a few tokens' worth of it (tiny test models).
GROUP = 64


@dataclass(frozen=True)
class Quantized:
    """One array of a block stored by `mx.quantize` (docs/CACHING.md, Quantized storage)."""

    parts: tuple[mx.array, mx.array, mx.array]  # data, scales, biases
    shape: tuple[int, ...]
    dtype: Any
    bits: int

    @classmethod
    def of(cls, x: mx.array, bits: int) -> "Quantized":
        flat = x.reshape(-1, GROUP if x.shape[-1] % GROUP else x.shape[-1])
        return cls(tuple(mx.quantize(flat, group_size=GROUP, bits=bits)), tuple(x.shape), x.dtype, bits)

    def array(self) -> mx.array:
        out = mx.dequantize(*self.parts, group_size=GROUP, bits=self.bits)
        return out.reshape(self.shape).astype(self.dtype)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def quantizable(kv: list[tuple[mx.array, mx.array]]) -> bool:
    """Whether `mx.quantize` takes a block of these layers (groups of GROUP values)."""
    return all(x.size % GROUP == 0 for pair in kv for x in pair)


def _plain(x: Any) -> mx.array:
    return x.array() if isinstance(x, Quantized) else x


@dataclass
class Pool:
    """Every block of one store, by key; a block lives while an entry uses it. With
    `bits` (8 or 4) blocks are stored quantized: opt-in, answers then deviate."""

    blocks: dict[int, Block] = field(default_factory=dict)
    nbytes: int = 0
    bits: int = 0
    # A block read back from disk and still held by a restored state, by key (the disk
    # tier's `Blocks.restored`): committing a restored conversation takes its blocks
    # as they are, where copying them out of the working cache again cost an 8k-token
    # 7B hit 20-37 ms on an H100 (250 blocks).
    restored: Any = field(default=lambda key: None, repr=False)

    def acquire(self, key: int, make: Any) -> Block:
        block = self.blocks.get(key)
        if block is None:
            kv = make()
            if self.bits and quantizable(kv):
                kv = [(Quantized.of(k, self.bits), Quantized.of(v, self.bits)) for k, v in kv]
                mx.eval([q.parts for pair in kv for q in pair])
            block = self.blocks[key] = Block(key, kv, sum(k.nbytes + v.nbytes for k, v in kv))
            self.nbytes += block.nbytes
        block.refs += 1
        return block

    def release(self, block: Block) -> int:
        """Drop one use; the bytes freed (the block's, when it was the last use)."""
        block.refs -= 1
        if block.refs > 0:
            return 0
        del self.blocks[block.key]
        self.nbytes -= block.nbytes
        return block.nbytes


class _Slot:
    """Where a paged layer sits in an entry's skeleton."""

    def __init__(self, index: int):
        self.index = index


def _pageable(layer: Any) -> bool:
    return type(layer) is KVCache and layer.keys is not None


def _skeleton(cache: list[Any], paged: list[Any]) -> list[Any]:
    # The cache with each pageable layer replaced by a _Slot (in `paged`'s order).
    def walk(layer: Any) -> Any:
        if isinstance(layer, CacheList):
            return CacheList(*map(walk, layer.caches))
        if _pageable(layer):
            paged.append(layer)
            return _Slot(len(paged) - 1)
        return layer
    return [walk(layer) for layer in cache]


def _own(x: mx.array, start: int, stop: int) -> mx.array:
    # A buffer of its own: a slice would keep the whole committed state alive.
    return mx.array(x[..., start:stop, :])


@dataclass(eq=False)
class Paged:
    """One entry's state: shared blocks, then its own tail and whole layers."""

    tokens: int
    skeleton: list[Any]  # per layer: a _Slot for a paged layer, else the layer whole
    blocks: list[Block]
    tail: list[tuple[mx.array, mx.array]]  # per paged layer: the tokens after the blocks
    own_bytes: int  # tail + whole layers: what this entry holds alone
    groups: list[list[int]] = field(default_factory=list)  # paged layers by shape (Block.kv)

    @property
    def whole(self) -> bool:
        """Whether some layer is kept whole (such an entry is never cut shorter)."""
        return _any_whole(self.skeleton)

    @property
    def nbytes(self) -> int:
        """What it would hold alone: its blocks and its own rest."""
        return sum(b.nbytes for b in self.blocks) + self.own_bytes

    @property
    def slots(self) -> int:
        return len(self.tail)

    def assemble(self, n: int | None = None) -> list[Any]:
        """A private cache holding the first `n` tokens (all by default); layers kept
        whole are trimmed by what is left out (only possible where they can be)."""
        n = self.tokens if n is None else n
        cut = self.tokens if self.whole else n  # whole layers are trimmed, not cut
        layers: list[Any] = [None] * self.slots
        for g, slots in enumerate(self.groups):
            keys, values = self._group(g, slots, cut)
            for j, s in enumerate(slots):
                layer = layers[s] = KVCache()
                layer.keys, layer.values, layer.offset = keys[j:j + 1], values[j:j + 1], cut
        out = [_fill(layer, layers) for layer in private_copy(self.skeleton)]
        if cut > n:
            trim_prompt_cache(out, cut - n)
        return out

    def _group(self, g: int, slots: list[int], n: int) -> tuple[mx.array, mx.array]:
        # One concatenation of exactly the parts that hold the first n tokens: the
        # only copy a hit makes, into arrays no stored block shares.
        full = min(n // BLOCK_TOKENS, len(self.blocks))  # the tail follows the last block
        rest = n - full * BLOCK_TOKENS
        parts = [tuple(map(_plain, b.kv[g])) for b in self.blocks[:full]]
        if rest and full < len(self.blocks):
            k, v = map(_plain, self.blocks[full].kv[g])
            parts.append((k[:, :, :rest, :], v[:, :, :rest, :]))
        elif rest:
            parts.append(tuple(mx.stack([self.tail[s][i][0, :, :rest, :] for s in slots])
                               for i in (0, 1)))
        return join([k for k, _ in parts]), join([v for _, v in parts])

    def drop_tail(self) -> int:
        """Cut the entry back to its last full block; the bytes freed."""
        freed = sum(k.nbytes + v.nbytes for k, v in self.tail)
        self.tail = [(_empty(k), _empty(v)) for k, v in self.tail]
        self.own_bytes -= freed
        self.tokens = len(self.blocks) * BLOCK_TOKENS
        return freed


def for_disk(state: Paged) -> tuple[list[Any], list[Block]] | None:
    """What the disk tier writes for an entry, without running MLX (the writer thread
    reads these evaluated arrays; on CUDA through copies, diskfile.save): its layers with each paged one holding the tokens
    after its blocks, and those blocks. At least one token stays in the record (a
    block's worth when it ends on a block). None where blocks are stored quantized."""
    blocks, tail = list(state.blocks), state.tail
    if state.slots and state.tokens == len(blocks) * BLOCK_TOKENS:
        return None  # cut back to its blocks (`page` always leaves a token in the tail)
    if any(isinstance(x, Quantized) for b in blocks for pair in b.kv for x in pair):
        return None
    layers = []
    for k, v in tail:
        layer = KVCache()
        layer.keys, layer.values, layer.offset = k, v, k.shape[2]
        layers.append(layer)
    return [_fill(layer, layers) for layer in state.skeleton], blocks


def from_disk(cache: list[Any], blocks: list[Block], tokens: int, head: bool = False) -> Paged:
    """A restored record as a Paged state (its paged layers: every plain `KVCache`),
    so the engine assembles its private view as from RAM. With `head`, `blocks` are
    the first of the record's and the state holds just their tokens (a hit that
    shares only that much of the record reads no more of it); a record with a layer
    kept whole is only ever read whole."""
    paged: list[KVCache] = []
    skeleton = _skeleton(cache, paged)
    if head:
        if _any_whole(skeleton):
            raise ValueError("a record with layers kept whole is read whole")
        tail = [(_empty(c.keys), _empty(c.values)) for c in paged]
        tokens = len(blocks) * BLOCK_TOKENS
    else:
        tail = [(c.keys[..., :c.offset, :], c.values[..., :c.offset, :]) for c in paged]
        held = len(blocks) * BLOCK_TOKENS + (paged[0].offset if paged else 0)
        if paged and (held != tokens or any(c.offset != paged[0].offset for c in paged)):
            raise ValueError(f"the record's blocks and layers hold {held} tokens, it lists {tokens}")
    if not paged and blocks:
        raise ValueError("a record lists blocks but has no layer to put them in")
    groups = _groups(paged)
    for b in blocks:  # each group's layers stacked, a block's worth of tokens
        if len(b.kv) != len(groups) or any(
                k.shape[0] != len(g) or k.shape[2] != BLOCK_TOKENS or v.shape[:3] != k.shape[:3]
                for (k, v), g in zip(b.kv, groups)):
            raise ValueError(f"block {b.key:016x} does not fit the record's layers")
    whole = _whole_layers(skeleton)
    if any(isinstance(getattr(c, "offset", None), int) and c.offset != tokens for c in whole):
        raise ValueError(f"a layer of the record does not hold its {tokens} tokens")
    own = sum(c.nbytes for c in whole) + sum(k.nbytes + v.nbytes for k, v in tail)
    return Paged(tokens, skeleton, blocks, tail, own, groups)


def keeps_whole(cache: list[Any]) -> bool:
    """Whether a record's layers (its own file) include one kept whole: such a record
    serves a hit only when read whole."""
    return _any_whole(_skeleton(cache, []))


def _empty(x: mx.array) -> mx.array:
    # Not an empty slice of `x`: that would keep its buffer alive.
    return mx.zeros((*x.shape[:2], 0, x.shape[3]), x.dtype)


def _any_whole(skeleton: list[Any]) -> bool:
    def whole(layer: Any) -> bool:
        if isinstance(layer, CacheList):
            return any(map(whole, layer.caches))
        return not isinstance(layer, _Slot)
    return any(map(whole, skeleton))


def _fill(layer: Any, layers: list[KVCache]) -> Any:
    if isinstance(layer, CacheList):
        return CacheList(*(_fill(c, layers) for c in layer.caches))
    return layers[layer.index] if isinstance(layer, _Slot) else layer


def _groups(paged: list[KVCache]) -> list[list[int]]:
    """Paged layers by the shape and dtype of their keys and values, in layer order."""
    by: dict[tuple, list[int]] = {}
    for i, c in enumerate(paged):
        k, v = c.keys, c.values
        by.setdefault((k.shape[1], k.shape[3], v.shape[1], v.shape[3], k.dtype, v.dtype), []).append(i)
    return list(by.values())


def page(cache: list[Any], tokens: np.ndarray, root: int, pool: Pool) -> Paged:
    """Keep `cache` (holding exactly `tokens`) as blocks in `pool` plus its own rest.
    Blocks the pool has already are used as they are: only new ones are copied, all of
    them out of one copy of the new tokens' KV per group (few MLX ops, one eval). At
    least one token stays in the tail: an entry's own file on disk holds it."""
    paged: list[KVCache] = []
    skeleton = _skeleton(cache, paged)
    if not paged:
        return Paged(len(tokens), skeleton, [], [], sum(c.nbytes for c in cache))
    n, groups = len(tokens), _groups(paged)
    full = (n - 1) // BLOCK_TOKENS
    keys = block_keys(root, tokens, full)
    missing = [i for i, key in enumerate(keys) if key not in pool.blocks]
    found = {i: kv for i in missing if (kv := _adoptable(pool, keys[i], paged, groups)) is not None}
    new = [i for i in missing if i not in found]
    pieces = _new_blocks(paged, groups, new[0], full) if new else {}
    pieces.update(found)
    blocks = [pool.acquire(key, lambda i=i: pieces[i]) for i, key in enumerate(keys)]
    tail = [(_own(c.keys, full * BLOCK_TOKENS, n), _own(c.values, full * BLOCK_TOKENS, n))
            for c in paged]
    mx.eval(tail)
    own = sum(c.nbytes for c in _whole_layers(skeleton)) + sum(k.nbytes + v.nbytes for k, v in tail)
    return Paged(n, skeleton, blocks, tail, own, groups)


def _adoptable(pool: Pool, key: int, paged: list[KVCache], groups: list[list[int]]) -> Any:
    """The KV of a restored block of `key` where it fits this cache's layers as the
    pool keeps them (not where the pool quantizes: a restored block is as saved)."""
    if pool.bits:
        return None
    block = pool.restored(key)
    if block is None or len(block.kv) != len(groups):
        return None
    for pair, g in zip(block.kv, groups):
        # As _new_blocks would cut it: the group's layers stacked, a block's tokens.
        for x, ref in zip(pair, (paged[g[0]].keys, paged[g[0]].values)):
            if x.dtype != ref.dtype or x.shape != (len(g), ref.shape[1], BLOCK_TOKENS, ref.shape[3]):
                return None
    return block.kv


def _new_blocks(paged: list[KVCache], groups: list[list[int]], first: int,
                end: int) -> dict[int, list[tuple[mx.array, mx.array]]]:
    """Blocks first..end-1 of `paged`, each in arrays of its own, evaluated at once."""
    a, b = first * BLOCK_TOKENS, end * BLOCK_TOKENS
    region = [tuple(mx.stack([getattr(paged[s], name)[0, :, a:b, :] for s in g])
                    for name in ("keys", "values")) for g in groups]
    out = {i: [(mx.array(k[:, :, (i - first) * BLOCK_TOKENS:(i - first + 1) * BLOCK_TOKENS, :]),
                mx.array(v[:, :, (i - first) * BLOCK_TOKENS:(i - first + 1) * BLOCK_TOKENS, :]))
               for k, v in region] for i in range(first, end)}
    mx.eval(list(out.values()))
    return out


def _whole_layers(skeleton: list[Any]) -> list[Any]:
    out = []
    for layer in skeleton:
        if isinstance(layer, CacheList):
            out.extend(_whole_layers(layer.caches))
        elif not isinstance(layer, _Slot):
            out.append(layer)
    return out


def release(state: Paged, pool: Pool) -> int:
    """Give back every block of an entry; the pool's bytes freed."""
    freed = sum(pool.release(b) for b in state.blocks)
    state.blocks = []
    return freed


def _fresh(value: Any) -> Any:
    # A new array object per array: mlx-lm caches assign into their arrays in
    # place (`keys[..., a:b, :] = new`), which rebinds the array object they
    # hold; sharing that object with a stored entry would let a user of the copy
    # overwrite the entry. A whole-array slice is a new object over the same
    # buffer (no copy); MLX never writes into a buffer another array still uses.
    if isinstance(value, mx.array):
        return value[...] if value.ndim else mx.array(value)
    if isinstance(value, list):
        return [_fresh(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_fresh(v) for v in value)
    return value


def private_copy(cache: list[Any]) -> list[Any]:
    """A copy of a per-model cache that shares no array object with `cache`."""
    def copy_layer(layer: Any) -> Any:
        if isinstance(layer, CacheList):
            return CacheList(*map(copy_layer, layer.caches))
        new = copy.copy(layer)
        for name, value in vars(layer).items():
            setattr(new, name, _fresh(value))
        return new
    return [copy_layer(layer) for layer in cache]

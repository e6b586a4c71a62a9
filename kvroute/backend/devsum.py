"""A checksum of arrays that MLX computes where the arrays are.

On CUDA, MLX's reader copies a disk-tier file straight into device memory. Checking
those bytes against the file's xxh3 meant reading every file twice (once on the host
to checksum it, once by MLX), which made a restore about twice as slow as MLX's read
alone. This sum is computed by MLX on the loaded arrays, on the GPU: plain integer
arithmetic (uint32 products that wrap, summed), so the writer and the reader get the
same value on any device and in any reduction order.

It finds damage (a flipped bit, a zeroed page, words out of place), as the xxh3 sums
beside it do; it is not meant to stop a forger. A file's arrays, in name order, are
taken as one run of 32-bit words, cut into chunks of 65,536 words (the last may be
shorter). Each chunk gives two lanes: its words times an odd multiple of their
position, summed mod 2**32 (any one changed word changes it, as does a swap of two),
and its words times a pseudo-random odd 64-bit weight each, summed mod 2**64, so that
errors which cancel in the first lane (two flips of a word's top bit, say: 2**31
times any odd number is 2**31) almost never cancel in the second. The file's sum is
the xxh3 of every array's name, dtype and shape and every chunk's lanes, in order.
Chunks keep the position weights small (one chunk's worth, made once per process).

Not `mx.compile`d, though that would make fewer kernels: a function MLX first
compiles on a thread other than the main one aborts the process at exit (MLX 0.32),
and restores run on reader threads. Files laid out alike (a model's block files)
are summed together instead, a pass over up to 32 MB of them: a restore of an
8k-token conversation of a 7B model checks its 250 block files (1.8 MB each) in 15
passes, not 250.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import orjson
import xxhash

_K1 = 0x9E3779B1  # odd: (2i + 1) * _K1 differs for every position i < 2**31


def _splitmix64(x: Any) -> Any:
    """SplitMix64's output function (uint64): consecutive inputs, unrelated outputs."""
    import mlx.core as mx

    def c(v: int) -> Any:  # MLX takes uint64 constants above 2**63 only as arrays
        return mx.array(np.uint64(v))

    x = x * c(0x9E3779B97F4A7C15)
    x = (x ^ (x >> 30)) * c(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> 27)) * c(0x94D049BB133111EB)
    return x ^ (x >> 31)


CHUNK = 1 << 16  # words

_weights_lock = threading.Lock()
_weights: OrderedDict[int, tuple[Any, Any]] = OrderedDict()  # by chunk length, newest last


def _weights_for(n: int) -> tuple[Any, Any]:
    """The two lanes' position weights for a chunk of `n` words, kept for the last few
    lengths (a whole chunk's, and the odd ends of a model's block files)."""
    import mlx.core as mx

    with _weights_lock:
        if n in _weights:
            _weights.move_to_end(n)
            return _weights[n]
    pos = mx.arange(n, dtype=mx.uint32)
    pair = ((pos * 2 + 1) * _K1, _splitmix64(pos.astype(mx.uint64)) | mx.array(np.uint64(1)))
    mx.eval(pair)  # evaluated here: another reader thread may use them
    with _weights_lock:
        _weights[n] = pair
        while len(_weights) > 8:
            _weights.popitem(last=False)
    return pair


def _words(stacked: Any) -> Any:
    """Each file's bytes of one array, as saved, in uint32 words: `stacked` holds that
    array of every file along its first axis; whole 4-byte words where a file's size
    allows, else each 2-byte or 1-byte element widened. Shape (files, words)."""
    import mlx.core as mx

    flat = stacked.reshape(stacked.shape[0], -1)  # a copy in row order from a strided view
    each = stacked.nbytes // stacked.shape[0]
    if each % 4 == 0:
        return flat.view(mx.uint32)
    if each % 2 == 0:
        return flat.view(mx.uint16).astype(mx.uint32)
    return flat.view(mx.uint8).astype(mx.uint32)


def _rows(chunks: Any) -> Any:
    import mlx.core as mx

    w1, w2 = _weights_for(chunks.shape[1])
    first = mx.sum(chunks * w1, axis=1).astype(mx.uint64)
    return mx.stack([first, mx.sum(chunks.astype(mx.uint64) * w2, axis=1)], axis=1)


def checksum(arrays: dict[str, Any]) -> str:
    """The sum of `arrays` (name to MLX array), computed where they are, as hex."""
    return checksums([arrays])[0]


GROUP_BYTES = 32 << 20  # bytes of arrays summed in one pass at most (temporaries: ~6x)


def checksums(files: list[dict[str, Any]]) -> list[str]:
    """`checksum` of each of `files`, computed together. Files laid out alike (the
    same names, dtypes and shapes: a model's block files) are summed in one pass
    per `GROUP_BYTES` with one copy back: one file at a time costs ten-odd MLX
    operations and a wait for the device, and a restore checks hundreds of files."""
    out: list[str] = [""] * len(files)
    alike: dict[tuple, list[int]] = {}
    for i, arrays in enumerate(files):
        layout = tuple((n, arrays[n].dtype, tuple(arrays[n].shape)) for n in sorted(arrays))
        alike.setdefault(layout, []).append(i)
    for layout, members in alike.items():
        head = orjson.dumps([[n, str(dtype), list(shape)] for n, dtype, shape in layout])
        first = files[members[0]]
        names = [n for n, _, _ in layout if first[n].size]
        step = max(1, GROUP_BYTES // max(1, sum(first[n].nbytes for n in names)))
        for start in range(0, len(members), step):
            group = members[start:start + step]
            rows = _file_lanes([files[i] for i in group], names) if names else None
            for j, i in enumerate(group):
                h = xxhash.xxh3_64(head)
                if rows is not None:
                    h.update(np.ascontiguousarray(rows[j]).tobytes())
                out[i] = h.hexdigest()
    return out


def _file_lanes(files: list[dict[str, Any]], names: list[str]) -> np.ndarray:
    """The lanes of files laid out alike: uint64 of shape (files, chunks, 2), each
    file's words (its arrays in name order) chunked from its own start."""
    import mlx.core as mx

    words = mx.concatenate([_words(mx.stack([f[n] for f in files])) for n in names], axis=1)
    count, n = words.shape
    whole = n // CHUNK * CHUNK
    parts = []
    if whole:
        parts.append(_rows(words[:, :whole].reshape(-1, CHUNK)).reshape(count, -1, 2))
    if whole < n:
        parts.append(_rows(words[:, whole:]).reshape(count, 1, 2))
    return np.array(mx.concatenate(parts, axis=1) if len(parts) > 1 else parts[0])

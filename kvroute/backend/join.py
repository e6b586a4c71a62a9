"""A cache hit's blocks joined into one array, on CUDA by one kernel per 256 blocks.

A hit on a stored conversation assembles its keys and values from 32-token blocks
(paged.py). `mx.concatenate` copies each input with a launch of its own: a 31k-token
conversation of a 7B model is ~980 blocks, two arrays each, and the joins took 16-25 ms
of a ~100 ms second turn on an H100/H200 (a copy of the joined array takes ~1.7 ms).
Here one kernel copies up to `CHUNK` same-shaped blocks at once, 16 bytes a thread,
and the few chunk outputs are then concatenated. Elsewhere (CPU, Metal, a shape the
kernel does not take) and after the kernel fails once, `mx.concatenate` does it.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx

log = logging.getLogger("kvroute.backend.paged")

CHUNK = 256  # blocks one launch joins (their pointers are the kernel's arguments: 2 KB)
MIN_PARTS = 16  # fewer parts than this: concatenate's launches cost less than ours
WORD = 16  # bytes a thread moves (uint4)


class _Kernel:
    def __init__(self) -> None:
        self.failed = not (hasattr(mx, "cuda") and mx.cuda.is_available()
                           and hasattr(mx.fast, "cuda_kernel"))
        self._kernel: Any = None
        self.checked = False

    def warm(self) -> None:
        """Build the kernel and check it against `mx.concatenate` once, before any hit
        uses it (its build errors would otherwise surface in a batch step)."""
        if self.failed or self.checked:
            return
        try:
            parts = [mx.random.normal((2, 3, 32, 8)).astype(mx.bfloat16) for _ in range(MIN_PARTS + 1)]
            ok = mx.array_equal(self.join(parts), mx.concatenate(parts, axis=2)).item()
            why = "it gave other bytes than concatenating"
        except Exception as exc:
            ok, why = False, f"it failed ({exc!r})"
        self.failed, self.checked = not ok, True
        if not ok:
            log.warning("joining cache blocks by kernel: %s; concatenating them", why)

    def works(self) -> bool:
        return self.checked and not self.failed

    def takes(self, parts: list[mx.array]) -> bool:
        """Same-shaped 4-d parts [layers, heads, tokens, dims] whose rows are whole
        16-byte words, enough of them to be worth a launch."""
        if not self.works() or len(parts) < MIN_PARTS:
            return False
        first = parts[0]
        return (first.ndim == 4 and (first.shape[3] * first.dtype.size) % WORD == 0
                and all(p.shape == first.shape and p.dtype == first.dtype for p in parts))

    def join(self, parts: list[mx.array]) -> mx.array:
        chunks = [self._launch(parts[i:i + CHUNK]) for i in range(0, len(parts), CHUNK)]
        return chunks[0] if len(chunks) == 1 else mx.concatenate(chunks, axis=2)

    def _launch(self, parts: list[mx.array]) -> mx.array:
        lead, heads, tokens, dims = parts[0].shape
        words = dims * parts[0].dtype.size // WORD
        total = lead * heads * tokens * len(parts) * words
        meta = mx.array([tokens, len(parts) * tokens, words, total], dtype=mx.uint32)
        # Unused argument slots repeat the first part; no thread reads them.
        inputs = [meta, *parts, *[parts[0]] * (CHUNK - len(parts))]
        (out,) = self.kernel()(inputs=inputs, grid=(total, 1, 1), threadgroup=(256, 1, 1),
                               output_shapes=[(total * WORD // 4,)], output_dtypes=[mx.uint32])
        return out.view(parts[0].dtype).reshape(lead, heads, len(parts) * tokens, dims)

    def kernel(self) -> Any:
        if self._kernel is None:
            cases = "".join(f"        case {i}: src = reinterpret_cast<const uint4*>(b{i}); break;\n"
                            for i in range(CHUNK))
            self._kernel = mx.fast.cuda_kernel(
                name="kvroute_join_blocks", input_names=["meta", *(f"b{i}" for i in range(CHUNK))],
                output_names=["out"],
                source=f"""
    // out: [rows, meta[1] tokens, meta[2] words], meta[3] words in all; part p holds tokens
    // [p * meta[0], (p + 1) * meta[0]) of every row, each part [rows, meta[0], words].
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= meta[3]) return;
    size_t per = meta[0], all = meta[1], words = meta[2];
    size_t w = i % words, t = (i / words) % all, row = i / (words * all);
    size_t part = t / per, at = (row * per + t % per) * words + w;
    const uint4* src = nullptr;
    switch (part) {{
{cases}        default: return;
    }}
    reinterpret_cast<uint4*>(out)[i] = src[at];
""")
        return self._kernel


_kernel = _Kernel()
warm = _kernel.warm


def works() -> bool:
    """Whether hits join their blocks by kernel here (CUDA, warmed, checked)."""
    return _kernel.works()


def join(parts: list[mx.array]) -> mx.array:
    """`parts` concatenated along axis 2 (tokens), as `mx.concatenate` would: the run
    of same-shaped blocks by the kernel where it works, what follows it (a hit's last,
    partial block) after it."""
    run = next((i for i, p in enumerate(parts) if p.shape != parts[0].shape), len(parts))
    if not _kernel.takes(parts[:run]):
        return mx.concatenate(parts, axis=2)
    head = _kernel.join(parts[:run])
    return head if run == len(parts) else mx.concatenate([head, *parts[run:]], axis=2)

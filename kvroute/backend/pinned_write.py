"""Arrays off a CUDA device into safetensors files through page-locked host memory.

The disk writer saved copies of the store's arrays with `mx.save_safetensors`, which
reads them on the host. MLX's CUDA allocator moves a buffer the host reads into
managed memory for good, page by page, unmapping each page from the GPU as it goes;
the copies, managed memory by then, went back to MLX's buffer cache, to be handed to
the engine's next allocations of about their size, whose first GPU use pulled them
back page by page (~1.3 GB/s on an H200 host). Every block file of a write did this
twice, beside whatever the engine ran.

Here one small kernel per batch of arrays writes their bytes across the bus straight
into a page-locked, device-mapped buffer, and the file is written from there: the host
never reads an MLX buffer, none leaves the device, and there are no copies to
allocate. The buffer (`WRITE_BYTES`) belongs to the disk tier's one writer thread. It is
two halves: one half's bytes go to the file while the next part's copies fill the
other, so a file of any size goes through it. The xxh3 sums the file's final name
carries are taken from the buffer on the way: the file is not read back for them.

The file is what `mx.save_safetensors` writes (a JSON header, then the tensors in
order, without gaps) with its header padded so that the tensors start on a 16-byte
boundary, where a restore's copy kernel takes them (pinned.py). Where the path cannot
work (no CUDA runtime, a kernel MLX cannot build, a copy that does not give back the
bytes it was given) it fails once, and the caller saves the other way.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import xxhash

from .diskfile import DTYPES, Saved
from .pinned import ALIGN, Pinned, settle

WRITE_BYTES = 64 << 20  # page-locked host memory the writer keeps (two halves)
PIECES = 16  # array pieces one kernel launch copies


@dataclass
class Piece:
    array: int  # which of the file's arrays
    start: int  # its first byte
    nbytes: int
    at: int  # where it goes in the buffer


def header(arrays: dict[str, Any], metadata: dict[str, str]) -> bytes:
    """The safetensors header (its length, then its JSON) of `arrays` in order, padded
    with spaces so that the tensors start on an `ALIGN`-byte boundary."""
    import mlx.core as mx

    codes = {getattr(mx, name): code for code, name in DTYPES.items()}  # bfloat16 -> "BF16"
    table: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, a in arrays.items():
        dtype = codes.get(a.dtype)
        if dtype is None:
            raise ValueError(f"no safetensors dtype for {a.dtype}")
        table[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    raw = orjson.dumps(table)
    raw += b" " * (-(8 + len(raw)) % ALIGN)
    return struct.pack("<Q", len(raw)) + raw


class Writer(Pinned):
    """The writer thread's page-locked buffer and copy kernel."""

    failure = "disk cache: writes through pinned memory failed (%r); copies of the arrays are saved instead"

    def __init__(self, nbytes: int = WRITE_BYTES):
        super().__init__(nbytes)

    def warm(self) -> None:
        """The buffer and the kernel made now, and one copy checked byte for byte."""
        if self._host is not None or self.failed:
            return
        try:
            import mlx.core as mx
            import numpy as np

            with self._lock:
                self._open()
                probe = (mx.arange(3 * ALIGN + 5) % 251).astype(mx.uint8)
                pieces = [Piece(0, 0, probe.size, 0), Piece(0, 7, 9, 3 * ALIGN + 8)]
                mx.eval(self._launch([probe, probe], pieces))
                want = np.array(probe)
                got = self._host[:probe.size], self._host[3 * ALIGN + 8:3 * ALIGN + 17]
                if not (np.array_equal(got[0], want) and np.array_equal(got[1], want[7:16])):
                    raise RuntimeError("the copy kernel gave other bytes")
        except Exception as exc:  # whatever it is, files are saved the other way
            self.fail(exc)

    def save(self, path: Path, arrays: dict[str, Any], metadata: dict[str, str]) -> Saved | None:
        """`arrays` (evaluated) and `metadata` written to `path` as a safetensors file:
        its size and sums, taken from the buffer as it goes to the file. None where this
        path does not work here, or MLX could not run a copy now (no memory for it): the
        caller saves another way, over whatever was written. Raises OSError where the
        file cannot be written."""
        if not self.works():
            return None
        import mlx.core as mx

        head = header(arrays, metadata)
        whole = xxhash.xxh3_64(head)  # the file's sum, from its header on
        head_sum = whole.hexdigest()
        # One dimension of bytes: what the kernel copies (a copy only of an array
        # that is not row-contiguous, as the kernel would have made).
        flat = [a.reshape(-1).view(mx.uint8) for a in arrays.values()]
        with self._lock:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                _write_all(fd, head)
                waiting: list[tuple[list[Any], int, int]] = []  # launched parts: (outputs, start, bytes)
                for n, part in enumerate(self._parts(flat)):
                    base = (n % 2) * self.half
                    for p in part:
                        p.at += base
                    outs = self._launch(flat, part)
                    waiting.append((outs, base, sum(p.nbytes for p in part)))
                    if len(waiting) == 2:  # the other half: its copies done, then to the file
                        whole.update(self._flush(fd, *waiting.pop(0)))
                for item in waiting:
                    whole.update(self._flush(fd, *item))
            except RuntimeError:  # MLX's own failure (an allocation), not the file's
                settle()
                return None
            except BaseException:
                settle()
                raise
            finally:
                os.close(fd)
        return Saved(len(head) + sum(a.size for a in flat), head_sum, whole.hexdigest())

    def _parts(self, flat: list[Any]) -> list[list[Piece]]:
        """The arrays' bytes in order, cut into runs that fill a half each."""
        parts: list[list[Piece]] = [[]]
        at = 0
        for i, a in enumerate(flat):
            start = 0
            while start < a.size:
                if at == self.half:
                    parts.append([])
                    at = 0
                n = min(a.size - start, self.half - at)
                parts[-1].append(Piece(i, start, n, at))
                at += n
                start += n
        return [p for p in parts if p]

    def _flush(self, fd: int, outs: list[Any], start: int, nbytes: int) -> memoryview:
        """A half's bytes to the file, once its copies are over; the bytes written."""
        import mlx.core as mx

        mx.eval(outs)
        view = memoryview(self._host[start:start + nbytes])
        _write_all(fd, view)
        return view

    def _launch(self, flat: list[Any], part: list[Piece]) -> list[Any]:
        """The copies of `part`, launched, not waited for: the outputs to wait for."""
        import mlx.core as mx

        outs = []
        for i in range(0, len(part), PIECES):
            batch = part[i:i + PIECES]
            pad = PIECES - len(batch)
            plan = ([self._device + p.at for p in batch] + [0] * pad
                    + [p.start for p in batch] + [0] * pad
                    + [p.nbytes for p in batch] + [0] * pad)
            inputs = [flat[p.array] for p in batch]
            inputs += [inputs[0]] * pad  # no thread reads them
            (done,) = self.kernel()(
                inputs=[mx.array(plan, dtype=mx.uint64), *inputs],
                grid=(-(-max(p.nbytes for p in batch) // ALIGN), PIECES, 1),
                threadgroup=(256, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.uint32])
            outs.append(done)
        mx.async_eval(outs)
        return outs

    def kernel(self) -> Any:
        if self._kernel is None:
            import mlx.core as mx

            cases = "".join(f"        case {i}: src = reinterpret_cast<const unsigned char*>(a{i}); break;\n"
                            for i in range(PIECES))
            self._kernel = mx.fast.cuda_kernel(
                name="kvroute_to_pinned", input_names=["plan", *(f"a{i}" for i in range(PIECES))],
                output_names=["done"],
                source=f"""
    // plan: {PIECES} destinations (device addresses of the pinned buffer), then each
    // piece's first byte in its array, then its length in bytes (0: no piece).
    size_t at = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) * {ALIGN};
    unsigned int y = blockIdx.y;
    size_t n = plan[{2 * PIECES} + y];
    if (at >= n) return;
    const unsigned char* src = nullptr;
    switch (y) {{
{cases}        default: return;
    }}
    src += plan[{PIECES} + y] + at;
    unsigned char* dst = reinterpret_cast<unsigned char*>(plan[y]) + at;
    if (at + {ALIGN} <= n && ((reinterpret_cast<size_t>(src) | reinterpret_cast<size_t>(dst)) & {ALIGN - 1}) == 0) {{
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    }} else {{
        for (size_t k = 0; k < {ALIGN} && at + k < n; ++k) dst[k] = src[k];
    }}
""")
        return self._kernel


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


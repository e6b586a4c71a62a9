"""Block files onto a CUDA device through page-locked host memory.

MLX's reader (`mx.load`) copies every tensor it loads from pageable host memory: on
an H200 host that is ~5 GB/s in all however many threads read, while the same files
come off the page cache at 15-22 GB/s. A disk restore of an 8k-token conversation of
a 7B model (470 MB) spent ~0.16 s there, longer than the rest of its turn.

Here reader threads read the files' tensor bytes into one page-locked, device-mapped
buffer, and one small kernel per batch of tensors copies them into device arrays,
reading the host memory across the bus. The buffer (`STAGING_BYTES`) is made when the
disk tier opens, with the kernel, and reused restore after restore; a larger restore
goes through it in parts. A file it cannot take (a tensor whose size or offset is not
a multiple of 16 bytes, a file larger than the buffer) gets no plan: the caller loads
it with MLX's reader. Where the path cannot work at all (no CUDA runtime to ask for
pinned memory, a kernel MLX cannot build) it fails once and every file goes through
MLX's reader. The bytes are checked where they land, by the caller's device checksum,
exactly as for MLX's reader.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.accel import cuda_runtime
from .diskfile import DTYPES, pread_into

log = logging.getLogger("kvroute.backend.disk")

STAGING_BYTES = 256 << 20  # page-locked host memory a backend keeps for restores
BATCH = 16  # tensors one kernel launch copies
ALIGN = 16  # the kernel moves 16-byte words
_HOST_ALLOC_MAPPED = 3  # cudaHostAllocPortable | cudaHostAllocMapped


@dataclass
class Tensor:
    name: str
    dtype: str
    shape: list[int]
    start: int  # within the file
    nbytes: int


@dataclass
class File:
    path: Path
    tensors: list[Tensor]
    start: int  # of the file's tensor bytes
    nbytes: int
    at: int = 0  # where its bytes sit in the buffer


def plan(path: Path, header: dict, data_offset: int, limit: int = STAGING_BYTES) -> File | None:
    """A file's tensors as this path copies them, or None where it cannot (a tensor's
    size or place not a multiple of `ALIGN`, an empty one, a dtype it does not know,
    more than `limit` bytes: the buffer's size)."""
    tensors = []
    for name, t in header.items():
        a, b = t["data_offsets"]
        if b <= a or a % ALIGN or (b - a) % ALIGN or t["dtype"] not in DTYPES:
            return None
        tensors.append(Tensor(name, t["dtype"], list(t["shape"]), data_offset + a, b - a))
    if not tensors:
        return None
    start = min(t.start for t in tensors)
    nbytes = max(t.start + t.nbytes for t in tensors) - start
    if nbytes > limit:
        return None
    return File(path, tensors, start, nbytes)


class Staging:
    """One backend's page-locked buffer and copy kernel (one restore at a time)."""

    def __init__(self, nbytes: int = STAGING_BYTES):
        self.nbytes = nbytes
        self._lock = threading.Lock()
        self._host: Any = None  # numpy view of the pinned buffer
        self._device = 0  # its address as the device sees it
        self._kernel: Any = None
        self.failed = False

    def load(self, files: list[File], readers: ThreadPoolExecutor) -> list[dict[str, Any]]:
        """Each file's tensors as device arrays, in order. Raises BadRecord where a
        file ends early, OSError where it cannot be read, RuntimeError where this path
        does not work here (the caller falls back to MLX's reader)."""
        with self._lock:
            self._open()
            out: list[dict[str, Any]] = []
            for part in self._parts(files):
                out += self._load_part(part, readers)
            return out

    def warm(self) -> None:
        """The buffer and the copy kernel made now, not in the first restore's time
        (~0.3 s and ~1.7 s on an H100 host)."""
        try:
            with self._lock:
                self._open()
                f = File(Path(), [Tensor("w", "U32", [ALIGN // 4], 0, ALIGN)], 0, ALIGN)
                self._wait(self._copy([(f, f.tensors[0])]))
        except Exception as exc:  # whatever it is, restores fall back to MLX's reader
            self.fail(exc)

    def fail(self, exc: Exception) -> None:
        """This path does not work here: MLX's reader loads every file from now on."""
        if not self.failed:
            self.failed = True
            log.warning("disk cache: restores through pinned memory failed (%r); MLX's reader "
                        "loads block files instead", exc)

    def _open(self) -> None:
        if self._host is not None:
            return
        import numpy as np

        runtime = cuda_runtime()
        if runtime is None:
            raise RuntimeError("no CUDA runtime")
        host, device = ctypes.c_void_p(), ctypes.c_void_p()
        err = runtime.cudaHostAlloc(ctypes.byref(host), ctypes.c_size_t(self.nbytes),
                                    ctypes.c_uint(_HOST_ALLOC_MAPPED))
        if err or not host.value:
            raise RuntimeError(f"cudaHostAlloc failed ({err})")
        if runtime.cudaHostGetDevicePointer(ctypes.byref(device), host, ctypes.c_uint(0)) or not device.value:
            runtime.cudaFreeHost(host)
            raise RuntimeError("no device address for pinned memory")
        self._host = np.ctypeslib.as_array((ctypes.c_uint8 * self.nbytes).from_address(host.value))
        self._device = device.value

    def _parts(self, files: list[File]) -> list[list[File]]:
        """Files in runs that fit the buffer, each placed 16-byte aligned."""
        parts: list[list[File]] = [[]]
        at = 0
        for f in files:
            if f.nbytes > self.nbytes:  # `plan` with this buffer's size leaves it out
                raise ValueError(f"{f.path.name}: {f.nbytes} bytes, the buffer holds {self.nbytes}")
            if at + f.nbytes > self.nbytes:
                parts.append([])
                at = 0
            f.at = at
            parts[-1].append(f)
            at += -(-f.nbytes // ALIGN) * ALIGN
        return [p for p in parts if p]

    def _load_part(self, files: list[File], readers: ThreadPoolExecutor) -> list[dict[str, Any]]:
        import mlx.core as mx

        reads = [readers.submit(self._read, f) for f in files]
        wait(reads)  # every read is over before one's failure lets the buffer go
        for r in reads:
            r.result()
        tensors = [(f, t) for f in files for t in f.tensors]
        owner = [i for i, f in enumerate(files) for _ in f.tensors]
        try:
            words: list[Any] = []
            for i in range(0, len(tensors), BATCH):
                words += self._copy(tensors[i:i + BATCH])
            arrays: list[dict[str, Any]] = [{} for _ in files]
            for i, (_, t), w in zip(owner, tensors, words):
                arrays[i][t.name] = w.view(getattr(mx, DTYPES[t.dtype])).reshape(t.shape)
            self._wait([a for d in arrays for a in d.values()])
        except BaseException:
            try:  # copies launched before the failure may still read the buffer
                mx.synchronize()
            except Exception:
                pass
            raise
        return arrays

    def _wait(self, arrays: list[Any]) -> None:
        """Until the copies into `arrays` are done: the buffer is free again after."""
        import mlx.core as mx

        mx.eval(arrays)

    def _read(self, f: File) -> None:
        fd = os.open(f.path, os.O_RDONLY)
        try:
            pread_into(fd, memoryview(self._host[f.at:f.at + f.nbytes]), f.start)
        finally:
            os.close(fd)

    def _copy(self, batch: list[tuple[File, Tensor]]) -> list[Any]:
        """One launch: each tensor's bytes from the pinned buffer into a new device
        array of 32-bit words (slots past the batch's end copy nothing)."""
        import mlx.core as mx

        words = [t.nbytes // ALIGN for _, t in batch]
        plan_ = [self._device + f.at + (t.start - f.start) for f, t in batch] + [0] * (BATCH - len(batch))
        plan_ += words + [0] * (BATCH - len(batch))
        shapes = [(t.nbytes // 4,) for _, t in batch] + [(4,)] * (BATCH - len(batch))
        outs = self.kernel()(inputs=[mx.array(plan_, dtype=mx.uint64)], grid=(max(words), BATCH, 1),
                             threadgroup=(256, 1, 1), output_shapes=shapes,
                             output_dtypes=[mx.uint32] * BATCH)
        return outs[:len(batch)]

    def kernel(self) -> Any:
        if self._kernel is None:
            import mlx.core as mx

            cases = "".join(f"        case {i}: dst = reinterpret_cast<uint4*>(o{i}); break;\n"
                            for i in range(BATCH))
            self._kernel = mx.fast.cuda_kernel(
                name="kvroute_from_pinned", input_names=["plan"],
                output_names=[f"o{i}" for i in range(BATCH)],
                source=f"""
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    unsigned int y = blockIdx.y;
    if (i >= plan[{BATCH} + y]) return;
    uint4* dst = nullptr;
    switch (y) {{
{cases}    }}
    dst[i] = reinterpret_cast<const uint4*>(plan[y])[i];
""")
        return self._kernel

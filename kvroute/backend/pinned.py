"""Block files onto a CUDA device through page-locked host memory.

MLX's reader (`mx.load`) copies every tensor it loads from pageable host memory: on
an H200 host that is ~5 GB/s in all however many threads read, while the same files
come off the page cache at 15-22 GB/s. A disk restore of an 8k-token conversation of
a 7B model (470 MB) spent ~0.16 s there, longer than the rest of its turn.

Here reader threads read whole files, header and tensors in one read, into one
page-locked, device-mapped buffer, where the caller's `fill` checks them (the disk
tier: each file's xxh3, on the host, on the bytes the GPU will copy), and one small
kernel per batch of tensors copies them into device arrays, reading the host memory
across the bus. The buffer (`STAGING_BYTES`) is made when the disk tier opens, with
the kernel, and reused restore after restore. A restore goes through it in parts, a
slot of the buffer each (up to `SLOTS`): every slot's part is read at once, and a
part's slot is read into again once its copies are over (they run while the next
part is read), so the readers never wait for a launch, and only the last, small
part's copies are waited for alone. A file it cannot take (a dtype it does not know,
a file larger than half the buffer, more than `HOST_BYTES` of tensors not in 16-byte
words) comes back as None: the caller loads it another way. Where the path cannot
work at all (no CUDA runtime to ask for pinned memory, a kernel MLX cannot build) it
fails once and the caller loads every file another way.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import orjson

from ..core.accel import cuda_runtime, device_trouble
from .diskfile import DTYPES, pread_into

log = logging.getLogger("kvroute.backend.disk")

STAGING_BYTES = 256 << 20  # page-locked host memory a backend keeps for restores
OWN_BYTES = 32 << 20  # and for restores' own files (a record's last part-block, ...), beside
BATCH = 16  # tensors one kernel launch copies
# Parts in the buffer at once, each with room for `FILES_A_SLOT` of a restore's largest
# file (block files of a 7B model: 8 slots of 32 MB, ~17 files each). Two halves left
# an 8k-token restore's readers idle at each half's end and its last 115 MB of copies
# waited alone: 8 slots took 30.6 ms against 32.5 for the 459 MB (`bench_disk paths`,
# an H100 host, 8 readers).
SLOTS = 8
FILES_A_SLOT = 4
# A file's tensors made on the host (in managed memory on CUDA, which the GPU pulls
# page by page: fine for a record's scalars, not for its layers).
HOST_BYTES = 64 << 10
ALIGN = 16  # the kernel moves 16-byte words
_HOST_ALLOC_MAPPED = 3  # cudaHostAllocPortable | cudaHostAllocMapped


@dataclass
class File:
    path: Path
    size: int  # the bytes to read: the whole file, as the caller knows it
    owner: Any = None  # the caller's, for its `fill`


@dataclass
class Tensor:
    name: str
    dtype: str
    shape: list[int]
    at: int  # in the buffer
    nbytes: int
    host: bool = False  # made from the buffer on the host: empty, or not in 16-byte words


# Reads `file` into the view (exactly its size) and checks it; returns its tensor
# table (safetensors' header without `__metadata__`) and where its tensors start.
Fill = Callable[[File, memoryview], tuple[dict, int]]


def plain_fill(f: File, view: memoryview) -> tuple[dict, int]:
    """A safetensors file read as it is, unchecked (benchmarks, tests)."""
    fd = os.open(f.path, os.O_RDONLY)
    try:
        pread_into(fd, view, 0)
    finally:
        os.close(fd)
    offset = 8 + int.from_bytes(view[:8], "little")
    header = orjson.loads(view[8:offset])
    header.pop("__metadata__", None)
    return header, offset


def tensors(header: dict, base: int, nbytes: int) -> list[Tensor] | None:
    """A tensor table as the kernel copies it from `base` (where the `nbytes` bytes of
    tensors start in the buffer), or None where it cannot: a dtype it does not know, a
    tensor whose bytes are not where the table says (past the file's end, or not its
    shape's size: the kernel would read past the file, or the arrays would not match),
    no tensor at all. An empty tensor, or one whose size or place is not a multiple of
    `ALIGN` (a record's scalars: a cache's offset, say), is made on the host; a file
    with more than `HOST_BYTES` of those is left to the caller."""
    import mlx.core as mx

    out = []
    for name, t in header.items():
        try:
            (a, b), dtype, shape = t["data_offsets"], t["dtype"], [int(n) for n in t["shape"]]
        except (KeyError, TypeError, ValueError):
            return None
        if dtype not in DTYPES or not 0 <= a <= b <= nbytes:
            return None
        size = getattr(mx, DTYPES[dtype]).size
        for n in shape:
            size *= n
        if size != b - a:
            return None
        host = a == b or bool((base + a) % ALIGN or (b - a) % ALIGN)
        out.append(Tensor(name, dtype, shape, base + a, b - a, host))
    if not out or sum(t.nbytes for t in out if t.host) > HOST_BYTES:
        return None
    return out


def mapped_buffer(nbytes: int) -> tuple[Any, int]:
    """`nbytes` of page-locked host memory the device can address (kept for the
    process's life): a NumPy view of it and its device address. RuntimeError where
    CUDA cannot give it."""
    import numpy as np

    runtime = cuda_runtime()
    if runtime is None:
        raise RuntimeError("no CUDA runtime")
    host, device = ctypes.c_void_p(), ctypes.c_void_p()
    err = runtime.cudaHostAlloc(ctypes.byref(host), ctypes.c_size_t(nbytes),
                                ctypes.c_uint(_HOST_ALLOC_MAPPED))
    if err or not host.value:
        raise RuntimeError(f"cudaHostAlloc failed ({err})")
    if runtime.cudaHostGetDevicePointer(ctypes.byref(device), host, ctypes.c_uint(0)) or not device.value:
        runtime.cudaFreeHost(host)
        raise RuntimeError("no device address for pinned memory")
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(host.value)), device.value


def settle() -> None:
    """Until this process's launched copies are over (after a failure: they may still
    read or write a pinned buffer about to be reused)."""
    import mlx.core as mx

    try:
        mx.synchronize()
    except Exception:
        pass


class ReadersClosed(Exception):
    """The reader threads were shut down (the tier is closing): not this path's failure."""


def _slot(size: int) -> int:
    """Buffer bytes a file takes: room to move its tensors onto a 16-byte boundary."""
    return -(-(size + ALIGN) // ALIGN) * ALIGN


class Pinned:
    """A page-locked buffer of two halves (one copied through while the other fills)
    and the kernel that copies through it, used by one thread at a time; made by
    `_open` and, once it fails, failed for good (`failure` says so, once)."""

    failure = "disk cache: pinned memory failed (%r)"

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.half = nbytes // 2 // ALIGN * ALIGN
        self._lock = threading.Lock()
        self._host: Any = None  # numpy view of the pinned buffer
        self._device = 0  # its address as the device sees it
        self._kernel: Any = None
        self.failed = False

    def works(self) -> bool:
        """Made (`warm`) and not failed: this path is taken."""
        return self._host is not None and not self.failed

    def fail(self, exc: Exception) -> None:
        """This path does not work here: the caller goes another way from now on."""
        if not self.failed:
            self.failed = True
            log.warning(self.failure, exc)

    def _open(self) -> None:
        if self._host is None:
            self._host, self._device = mapped_buffer(self.nbytes)


class Staging(Pinned):
    """One backend's page-locked buffer and copy kernel for restores (one at a time)."""

    def __init__(self, nbytes: int = STAGING_BYTES, what: str = "block files"):
        super().__init__(nbytes)
        self.failure = (f"disk cache: restores through pinned memory failed (%r); MLX's reader "
                        f"loads {what} instead")
        self._header = 0  # where the last file's tensors started: the next likely the same
        self._timing = threading.local()

    def timing(self) -> dict[str, float]:
        """This thread's last `load`: seconds reading (and checking) files, launching the
        copies (the arrays made on the host, the kernels queued), and waiting for copies
        to end (they are hidden behind the reads but for the last part), and what the
        caller `add`ed."""
        return dict(getattr(self._timing, "last", {}))

    def add(self, phase: str, seconds: float) -> None:
        """Count `seconds` of the caller's own in this thread's last `load`'s timing."""
        last = getattr(self._timing, "last", None)
        if last is not None:
            last[phase] = last.get(phase, 0.0) + seconds

    def fits(self, size: int) -> bool:
        return _slot(size) <= self.half

    def load(self, files: list[File], readers: ThreadPoolExecutor | None, fill: Fill = plain_fill
             ) -> list[dict[str, Any] | None]:
        """Each file's tensors as device arrays, in order; None for a file this path
        cannot take. Files are read on `readers`, or on this thread where it is None.
        Raises what `fill` raises (after every read under way is over),
        ReadersClosed where `readers` are shut down, RuntimeError where this path does
        not work here."""
        timing = self._timing.last = {"pinned reads": 0.0, "launches": 0.0, "copies waited": 0.0}
        with self._lock:
            self._open()
            out: list[dict[str, Any] | None] = [None] * len(files)
            slots, size, parts = self._layout(files)
            reads: dict[int, list[Any]] = {}  # parts being read: futures, or tables read inline
            copying: dict[int, list[Any]] = {}  # parts whose copies are launched, not waited for
            try:
                for n in range(min(slots, len(parts))):  # every slot's part read at once
                    reads[n] = self._start_part(files, parts[n], n % slots * size, readers, fill)
                for n in range(len(parts)):
                    t0 = time.perf_counter()
                    planned = self._finish_part(reads.pop(n))
                    t1 = time.perf_counter()
                    timing["pinned reads"] += t1 - t0
                    # The slot the last part's copies read is read into next, before
                    # this part's copies are launched: the readers never wait for those.
                    refill = n - 1 + slots
                    if n >= 1 and refill < len(parts):
                        self._wait(copying.pop(n - 1))
                        timing["copies waited"] += time.perf_counter() - t1
                        reads[refill] = self._start_part(files, parts[refill], refill % slots * size,
                                                         readers, fill)
                    t2 = time.perf_counter()
                    words, made = self._launch([(i, t) for (i, _), ts in zip(parts[n], planned) if ts
                                                for t in ts])
                    timing["launches"] += time.perf_counter() - t2
                    copying[n] = words
                    for i, arrays in made.items():
                        out[i] = arrays
                t0 = time.perf_counter()
                self._wait([w for ws in copying.values() for w in ws])
                timing["copies waited"] += time.perf_counter() - t0
            except BaseException:
                wait([r for rs in reads.values() for r in rs if isinstance(r, Future)])
                settle()  # copies launched before the failure may still read the buffer
                raise
            return out

    def load_or_none(self, files: list[File], readers: ThreadPoolExecutor | None,
                     fill: Fill = plain_fill) -> list[dict[str, Any] | None] | None:
        """`load`, or None where this path turns out not to work here (it fails for
        good, said once: the caller loads these files and every later one another
        way). No device memory now is raised: the restore fails, the path stays."""
        try:
            return self.load(files, readers, fill)
        except (RuntimeError, ValueError) as exc:
            if device_trouble(exc):
                raise
            self.fail(exc)
            return None

    def warm(self) -> None:
        """The buffer and the copy kernel made now, not in the first restore's time
        (~0.3 s and ~1.7 s on an H100 host)."""
        try:
            with self._lock:
                self._open()
                words, _ = self._launch([(0, Tensor("w", "U32", [ALIGN // 4], 0, ALIGN))])
                self._wait(words)
        except Exception as exc:  # whatever it is, restores fall back to MLX's reader
            self.fail(exc)

    def _layout(self, files: list[File]) -> tuple[int, int, list[list[tuple[int, int]]]]:
        """How many parts the buffer holds at once (as many as leave each room for
        `FILES_A_SLOT` of the largest file that fits, at most `SLOTS`, at least two:
        small parts keep the readers busy, as each part's last reads, and the last
        part's copies, wait alone), the bytes of a slot, and the parts."""
        largest = max((_slot(f.size) for f in files if self.fits(f.size)), default=ALIGN)
        slots = max(2, min(SLOTS, self.nbytes // (FILES_A_SLOT * largest)))
        size = self.nbytes // slots // ALIGN * ALIGN
        return slots, size, self._parts(files, size)

    def _parts(self, files: list[File], size: int) -> list[list[tuple[int, int]]]:
        """The files that fit a half, in runs that fill a slot of `size` bytes (which
        `_layout` made room for the largest of them): (position, offset in the slot)."""
        parts: list[list[tuple[int, int]]] = [[]]
        at = 0
        for i, f in enumerate(files):
            if not self.fits(f.size):
                continue
            if at and at + _slot(f.size) > size:
                parts.append([])
                at = 0
            parts[-1].append((i, at))
            at += _slot(f.size)
        return [p for p in parts if p]

    def _start_part(self, files: list[File], part: list[tuple[int, int]], base: int,
                    readers: ThreadPoolExecutor | None, fill: Fill) -> list[Any]:
        """A part's files read into its slot at `base`: on `readers` (futures, for
        `_finish_part`), or here, now, where it is None (their tensor tables)."""
        if readers is None:
            return [self._read(files[i], base + at, fill) for i, at in part]
        reads: list[Any] = []
        try:
            for i, at in part:
                reads.append(readers.submit(self._read, files[i], base + at, fill))
        except RuntimeError as exc:  # "cannot schedule new futures after shutdown"
            wait(reads)
            raise ReadersClosed(str(exc))
        return reads

    @staticmethod
    def _finish_part(reads: list[Any]) -> list[list[Tensor] | None]:
        """A part's tensor tables once every read of it is over (one's failure must not
        let the buffer go while others still write into it)."""
        futures = [r for r in reads if isinstance(r, Future)]
        if not futures:
            return reads
        wait(futures)
        return [r.result() for r in reads]

    def _read(self, f: File, at: int, fill: Fill) -> list[Tensor] | None:
        """The file into its slot at `at`, checked by `fill`; its tensors where they
        landed, moved onto a 16-byte boundary if the guess of its header's length
        (the last file's: a model's block files have one) was wrong."""
        pad = (-self._header) % ALIGN
        header, offset = fill(f, memoryview(self._host[at + pad:at + pad + f.size]))
        if (at + pad + offset) % ALIGN:
            moved = (-offset) % ALIGN
            self._host[at + moved:at + moved + f.size] = self._host[at + pad:at + pad + f.size].copy()
            pad = moved
        self._header = offset
        return tensors(header, at + pad + offset, f.size - offset)

    def _launch(self, tensors_: list[tuple[int, Tensor]]) -> tuple[list[Any], dict[int, dict[str, Any]]]:
        """The copies of these tensors (each with its file's position), launched, not
        waited for: the arrays to wait for (kernel outputs and the views of them, to be
        evaluated on this thread, whose stream made them), and each file's arrays."""
        import mlx.core as mx

        copied = [(i, t) for i, t in tensors_ if not t.host]
        words: list[Any] = []
        for i in range(0, len(copied), BATCH):
            words += self._copy([t for _, t in copied[i:i + BATCH]])
        made: dict[int, dict[str, Any]] = {}
        views = []
        for (i, t), w in zip(copied, words):
            views.append(w.view(getattr(mx, DTYPES[t.dtype])).reshape(t.shape))
            made.setdefault(i, {})[t.name] = views[-1]
        for i, t in tensors_:
            if t.host:  # its bytes copied out now: the buffer is refilled after
                dtype = getattr(mx, DTYPES[t.dtype])
                views.append(mx.zeros(t.shape, dtype) if not t.nbytes else
                             mx.array(self._host[t.at:t.at + t.nbytes].copy()).view(dtype).reshape(t.shape))
                made.setdefault(i, {})[t.name] = views[-1]
        mx.async_eval(views)
        return words + views, made

    def _wait(self, arrays: list[Any]) -> None:
        """Until the copies into `arrays` are done: their bytes of the buffer are free after."""
        import mlx.core as mx

        mx.eval(arrays)

    def _copy(self, batch: list[Tensor]) -> list[Any]:
        """One launch: each tensor's bytes from the pinned buffer into a new device
        array of 32-bit words (slots past the batch's end copy nothing)."""
        import mlx.core as mx

        pad = BATCH - len(batch)
        words = [t.nbytes // ALIGN for t in batch]
        plan_ = [self._device + t.at for t in batch] + [0] * pad + words + [0] * pad
        shapes = [(t.nbytes // 4,) for t in batch] + [(4,)] * pad
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

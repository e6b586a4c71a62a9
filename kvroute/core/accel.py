"""The accelerator MLX runs on, and its memory: the budget weights and caches share.

On a CUDA GPU the budget is the card's memory, not the host's RAM; on Apple
silicon it is the GPU's recommended working set (unified memory); on the CPU
it is physical memory. The launcher asks in a child process (`python -m
kvroute.core.accel`), so that it never holds a GPU context of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Any, Iterator, NoReturn


@dataclass
class Accelerator:
    kind: str  # "cuda", "metal" or "cpu"
    name: str
    memory: int  # bytes the backends' weights and caches may share


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cuda_runtimes() -> Iterator[Any]:
    """The CUDA runtime libraries here (ctypes), the ones this process has loaded
    already (MLX's) first, each once."""
    import ctypes

    names = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")
    seen: set[int] = set()
    for mode in (os.RTLD_NOLOAD | os.RTLD_LAZY, ctypes.DEFAULT_MODE):
        for name in names:
            try:
                lib = ctypes.CDLL(name, mode=mode)
            except OSError:
                continue
            if lib._handle not in seen:  # one library by several names or both passes
                seen.add(lib._handle)
                yield lib


def cuda_runtime() -> Any:
    """The CUDA runtime MLX has loaded (else the first one here); None where none is."""
    return next(cuda_runtimes(), None)


def cuda_memory() -> int:
    """The CUDA card's own memory in bytes (0: unknown). MLX 0.32 reports the host's
    RAM as a CUDA device's `memory_size` (its allocator can use managed memory): on an
    80 GB H100 in a 128 GB host it said 125.8 GiB, and two replicas sized by it ran
    out of device memory mid-request. Asked of the CUDA runtime, else of nvidia-smi."""
    for runtime in cuda_runtimes():
        _, total = _mem_info(runtime)
        if total:
            return total
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits",
                              "-i", os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return int(float(out.split()[0]) * (1 << 20))  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return 0


def _mem_info(runtime: Any) -> tuple[int, int]:
    """The card's free and total bytes as `runtime` (a CUDA runtime library) counts
    them; (0, 0) where it cannot say."""
    import ctypes

    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    if runtime.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)) != 0:
        return 0, 0
    return int(free.value), int(total.value)


def detect() -> Accelerator:
    """In this process (imports MLX, and on a GPU creates its context)."""
    import mlx.core as mx

    info = mx.device_info()
    name = str(info.get("device_name", ""))
    if mx.cuda.is_available():
        known = [m for m in (int(info.get("memory_size") or 0), cuda_memory()) if m]
        return Accelerator("cuda", name, min(known, default=physical_memory()))
    if mx.metal.is_available():
        memory = info.get("max_recommended_working_set_size") or info.get("memory_size")
        return Accelerator("metal", name, int(memory or physical_memory()))
    return Accelerator("cpu", name, physical_memory())


def probe(timeout: float = 120.0) -> Accelerator:
    """As `detect`, from a child process; the CPU with physical memory if it fails."""
    try:
        out = subprocess.run([sys.executable, "-m", "kvroute.core.accel"], capture_output=True,
                             text=True, timeout=timeout, check=True).stdout
        return Accelerator(**json.loads(out.strip().splitlines()[-1]))
    except (OSError, subprocess.SubprocessError, ValueError, TypeError, IndexError):
        return Accelerator("cpu", "", physical_memory())


# CUDA errors after which a process's GPU context is unusable: every later call fails
# the same way (seen on an H100: "an illegal memory access was encountered" from every
# step and every allocation after the first).
DEVICE_LOST = ("illegal memory access", "unspecified launch failure", "misaligned address",
               "device-side assert", "illegal instruction", "hardware stack error",
               "uncorrectable ecc error", "device has fallen off the bus")


def device_lost(exc: BaseException) -> bool:
    """Whether `exc` says this process's GPU context is gone for good."""
    text = str(exc).lower()
    return any(s in text for s in DEVICE_LOST)


def device_trouble(exc: BaseException) -> bool:
    """Whether `exc` is the device's trouble rather than its input's: out of memory
    now, or the context lost."""
    text = str(exc).lower()
    return device_lost(exc) or "out of memory" in text or "unable to allocate" in text


def memory() -> dict[str, int]:
    """This process's MLX memory (arrays in use, its buffer cache, the peak since
    start, its cap) and, on a CUDA card, the card's free and total bytes as the driver
    counts them (every process on it, and what MLX does not allocate: contexts,
    library workspaces), with what CUDA's memory pool holds for this process
    (`pool_memory`). Cheap enough for every health check."""
    import mlx.core as mx

    out = {"active": int(mx.get_active_memory()), "cache": int(mx.get_cache_memory()),
           "peak": int(mx.get_peak_memory()), "limit": int(mx.get_memory_limit())}
    card = card_memory() if mx.cuda.is_available() else None
    if card is not None:
        out["device_free"], out["device_total"] = card
        pool = pool_memory()
        if pool is not None:
            out["pool_reserved"], out["pool_used"] = pool
    return out


def card_memory() -> tuple[int, int] | None:
    """The CUDA card's free and total bytes as the driver counts them (every process
    on it); None where there is no CUDA card to ask. A call takes microseconds."""
    runtime = cuda_runtime()
    if runtime is None:
        return None
    free, total = _mem_info(runtime)
    return (free, total) if total else None


# cudaMemPoolAttr: bytes a pool holds from the driver, and of them in allocations now.
_POOL_RESERVED, _POOL_USED = 5, 7


def _default_pool(runtime: Any) -> Any:
    """This thread's device's default memory pool (a ctypes pointer), or None."""
    import ctypes

    device, pool = ctypes.c_int(), ctypes.c_void_p()
    try:
        if runtime.cudaGetDevice(ctypes.byref(device)) or \
                runtime.cudaDeviceGetDefaultMemPool(ctypes.byref(pool), device):
            return None
    except AttributeError:  # a runtime without memory pools (before CUDA 11.2)
        return None
    return pool


def pool_memory() -> tuple[int, int] | None:
    """CUDA's default memory pool on this process's device: the bytes it holds from
    the driver and, of them, those in allocations not yet freed. MLX frees into this
    pool; what it holds beyond the second figure is on the card for this process only.
    None where there is no CUDA runtime to ask."""
    import ctypes

    runtime = cuda_runtime()
    pool = _default_pool(runtime) if runtime is not None else None
    if pool is None:
        return None
    got = []
    for attr in (_POOL_RESERVED, _POOL_USED):
        value = ctypes.c_uint64()
        if runtime.cudaMemPoolGetAttribute(pool, ctypes.c_int(attr), ctypes.byref(value)):
            return None
        got.append(value.value)
    return got[0], got[1]


def apply_limits(memory_limit: int, cache_limit: int) -> dict[str, int]:
    """Cap this process's MLX memory (0: leave MLX's default) and the buffer cache
    it keeps for reuse (0: a tenth of the memory limit, when there is one).
    Returns what was set, for the log and /health."""
    import mlx.core as mx

    applied: dict[str, int] = {}
    if memory_limit > 0:
        mx.set_memory_limit(memory_limit)
        applied["memory_limit"] = memory_limit
        cache_limit = cache_limit or memory_limit // 10
        if mx.metal.is_available():
            # Wired memory is never paged out: replicas sharing the GPU must not
            # each wire the whole recommended working set.
            global _wired
            _wired = min(memory_limit, detect().memory)
            mx.set_wired_limit(_wired)
            applied["wired_limit"] = _wired
    if cache_limit > 0:
        mx.set_cache_limit(cache_limit)
        applied["cache_limit"] = cache_limit
    return applied


_wired = 0  # the wired limit apply_limits chose (Metal), 0: none


def keep_wired_limit() -> None:
    """mlx-lm's BatchGenerator raises the wired limit to the whole recommended
    working set when it is made; put this process's share back."""
    if _wired:
        import mlx.core as mx

        mx.set_wired_limit(_wired)


def exit_skipping_teardown(code: int = 0) -> NoReturn:
    """End a process that ran MLX now, its output flushed: MLX's CUDA destructors run at
    the interpreter's exit in no defined order and at times abort ("terminate called
    without an active exception", rc 134) after the work is done."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    print(json.dumps(asdict(detect())))

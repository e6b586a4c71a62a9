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


@dataclass
class Accelerator:
    kind: str  # "cuda", "metal" or "cpu"
    name: str
    memory: int  # bytes the backends' weights and caches may share


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def detect() -> Accelerator:
    """In this process (imports MLX, and on a GPU creates its context)."""
    import mlx.core as mx

    info = mx.device_info()
    name = str(info.get("device_name", ""))
    if mx.cuda.is_available():
        return Accelerator("cuda", name, int(info.get("memory_size") or physical_memory()))
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


if __name__ == "__main__":
    print(json.dumps(asdict(detect())))

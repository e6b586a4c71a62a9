"""Where kvroute changes how mlx-lm runs, kept in one place: each patch says what it
changes and why, so an mlx-lm upgrade knows what to check."""

from __future__ import annotations

import contextlib
import importlib
import threading
import types
from typing import Any, Iterator

import mlx.core as mx


class _KeepingBuffers(types.ModuleType):
    """`mlx.core` as mlx-lm's generator sees it, except that `clear_cache` keeps MLX's
    buffer cache (see `keep_buffer_cache`)."""

    def __init__(self, module: types.ModuleType):
        super().__init__(module.__name__)
        self._module = module

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        setattr(self, name, value)  # looked up once
        return value

    def clear_cache(self) -> None:
        pass


def keep_buffer_cache() -> None:
    """mlx-lm empties MLX's buffer cache after every prefill chunk, which keeps a
    laptop's memory low but makes each chunk and each cache hit allocate its memory
    afresh: on an H200 a 70-token turn on a 31k-token cached prompt spent ~20 ms of
    its ~100 ms re-allocating. A backend on a GPU with a cache limit (set per
    replica, kvroute/core/accel.py) keeps the cache, which that limit bounds; MLX also
    empties it itself before an allocation would pass the memory limit."""
    # importlib: the package's attribute `mlx_lm.generate` is its generate() function.
    generate = importlib.import_module("mlx_lm.generate")
    if not isinstance(generate.mx, _KeepingBuffers):
        generate.mx = _KeepingBuffers(mx)


_prefill = threading.local()


@contextlib.contextmanager
def prefilling() -> Iterator[None]:
    """Marks this thread as running a prompt's prefill (see `mark_prefill`)."""
    before = getattr(_prefill, "on", False)
    _prefill.on = True
    try:
        yield
    finally:
        _prefill.on = before


def in_prefill() -> bool:
    return getattr(_prefill, "on", False)


def mark_prefill() -> None:
    """mlx-lm's generator calls the model for prefill chunks and for decode steps alike,
    and a chunk can be one token wide (the tail of a segment). The vision step
    (backend/vision.py) must look at a prefill chunk's ids, which come from a list and
    cost nothing to read, but never at a decode step's, whose reading would wait for
    the device every step: `PromptProcessingBatch.prompt` runs inside `prefilling()`."""
    generate = importlib.import_module("mlx_lm.generate")
    cls = generate.PromptProcessingBatch
    if getattr(cls.prompt, "kvroute_prefill", False):
        return
    original = cls.prompt

    def prompt(self, tokens):
        with prefilling():
            return original(self, tokens)

    prompt.kvroute_prefill = True
    cls.prompt = prompt

"""Where kvroute changes how mlx-lm runs, kept in one place: each patch says what it
changes and why, so an mlx-lm upgrade knows what to check."""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import threading
import types
from typing import Any, Iterator

import mlx.core as mx
import numpy as np

log = logging.getLogger("kvroute.backend")


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


def chunked_gated_delta() -> float | None:
    """mlx-lm's gated-delta recurrence (Qwen3-Next's and Qwen3.5's linear layers) has a
    fused kernel on Metal only; elsewhere it runs a Python loop of small operations per
    prompt token (on an H200 a 7B-class hybrid prefilled ~500 tokens/s that way, and
    MLX's own `mx.fast.gated_delta_update` was slower still). This runs prompts by
    chunks instead (chunked_delta.py), after checking on this device that the chunked
    form agrees with the loop on a small random input (float32 rounding apart; a
    matrix unit that rounds coarser would show here). Returns the relative error
    measured, None where the check failed and the loop stays."""
    from mlx_lm.models import gated_delta

    from .chunked_delta import gated_delta_chunked, ops_with_chunks

    loop = gated_delta.gated_delta_ops
    if getattr(loop, "kvroute_chunked", False):
        return 0.0
    error = _chunked_error(loop, gated_delta_chunked)
    if error is None or error > 2e-2:
        log.warning("the chunked gated-delta recurrence disagreed with mlx-lm's loop on "
                    "this device (relative error %s); linear layers keep the loop", error)
        return None
    gated_delta.gated_delta_ops = ops_with_chunks(loop)
    log.info("gated-delta layers prefill by chunks (relative error against mlx-lm's "
             "loop %.1e)", error)
    return error


def uses_gated_delta(model: Any) -> bool:
    """Whether `model`'s mlx-lm module runs the gated-delta recurrence."""
    module = sys.modules.get(type(model).__module__)
    return getattr(module, "gated_delta_update", None) is not None


def _chunked_error(loop: Any, chunked: Any) -> float | None:
    """The largest difference between the loop's and the chunked outputs and states on
    a small random prompt, over the largest magnitude; None if the chunked form fails."""
    from mlx_lm.models.gated_delta import normalize_qk

    # numpy's generator, not MLX's: the engine may be built off the main thread, and
    # MLX's random ops first run on another thread abort the process at exit (0.32).
    rng = np.random.default_rng(7)
    b, t, hk, hv, d = 2, 150, 2, 4, 32  # three chunks, the last one padded

    def normal(*shape: int) -> mx.array:
        return mx.array(rng.standard_normal(shape, dtype=np.float32))

    # The second row's keys are near-identical with steps near 1 and slow decay (a run
    # of one token): the chunk's triangular inverse is at its worst conditioned there.
    k = mx.concatenate([normal(1, t, hk, d), normal(1, 1, hk, d) + 0.01 * normal(1, t, hk, d)])
    q, k = normalize_qk(normal(b, t, hk, d), k, inv_scale=d ** -0.5, eps=1e-6)
    v = normal(b, t, hv, d)
    g = mx.concatenate([mx.exp(-0.3 * mx.exp(0.5 * normal(1, t, hv))), mx.full((1, t, hv), 0.999)])
    beta = mx.concatenate([mx.sigmoid(normal(1, t, hv)), mx.full((1, t, hv), 0.95)])
    state = 0.1 * normal(b, hv, d, d)
    mask = mx.arange(t)[None, :] >= mx.array([[0], [9]])  # the second row left-padded
    y0, s0 = loop(q, k, v, g, beta, state, mask)
    try:
        y1, s1 = chunked(q, k, v, g, beta, state, mask)
        mx.eval(y1, s1)
    except Exception:
        return None
    kept = mask[..., None, None]
    errors = [mx.max(mx.where(kept, mx.abs(y0 - y1), 0.0)) / mx.max(mx.abs(y0)),
              mx.max(mx.abs(s0 - s1)) / mx.max(mx.abs(s0))]
    error = max(e.item() for e in errors)
    return None if error != error else error  # NaN: failed

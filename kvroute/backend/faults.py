"""Faults a test injects through a request's `kvroute_fault` field, honoured only by a
backend started with --enable-faults:

- `decode_error[:N]`: the batched decode step fails after N steps (default 3);
- `device_lost[:N]`: it fails after N steps as a CUDA step does once the GPU context is
  gone ("an illegal memory access was encountered"): the backend exits to be restarted;
- `out_of_memory[:N]`: it fails after N steps as a CUDA allocation does when the card
  is full (the request fails with a 500; the backend logs its memory and serves on);
- `force:TEXT`: the model replies TEXT then EOS;
- `slow_prefill[:SECONDS]`: each prefill chunk takes that much longer (default 0.05).
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Callable, Iterable

import mlx.core as mx

from .jobs import Job


def logits_processors(fault: str | None, tokenizer: Any) -> list[Callable]:
    """The processors that inject `fault` into a sequence's decode steps."""
    processors = []
    if fault and fault.startswith("decode_error"):
        processors.append(_fault_processor(fault))
    if fault and fault.startswith("device_lost"):
        processors.append(_fault_processor(fault, "cudaStreamSynchronize(stream_) failed: "
                                                  "an illegal memory access was encountered"))
    if fault and fault.startswith("out_of_memory"):
        processors.append(_fault_processor(fault, "cudaMallocAsync(&data, size, stream) failed: "
                                                  "out of memory"))
    if fault and fault.startswith("force:"):
        processors.append(_forcing_processor(fault.partition(":")[2], tokenizer))
    return processors


def _forcing_processor(text: str, tokenizer: Any) -> Callable:
    # Test-only: make a random-weight model reply `text` then EOS, so that the
    # exit paths that depend on what a model says (a tool call, a stop string,
    # EOS) run with every model family's real caches.
    forced = list(tokenizer.encode(text, add_special_tokens=False)) + [min(tokenizer.eos_token_ids)]
    calls = itertools.count()

    def processor(tokens, logits):
        target = forced[min(next(calls), len(forced) - 1)]
        return mx.where(mx.arange(logits.shape[-1]) == target, logits, -mx.inf)

    return processor


def _fault_processor(spec: str, message: str = "injected decode fault") -> Callable:
    # Test-only (enabled by --enable-faults): fail inside the batched decode step,
    # the path a real Metal/CUDA error or OOM would take.
    after = int(spec.partition(":")[2] or 3)
    calls = itertools.count()

    def processor(tokens, logits):
        if next(calls) >= after:
            raise RuntimeError(message)
        return logits

    return processor


def delay_prefill(jobs: Iterable[Job]) -> None:
    # Test-only: "slow_prefill:SECONDS" stretches each prefill chunk so a test
    # can reliably disconnect while a prompt is still being prefilled.
    delays = [
        float(j.fault.partition(":")[2] or 0.05)
        for j in jobs
        if j.phase == "prefill" and j.fault and j.fault.startswith("slow_prefill")
    ]
    if delays:
        time.sleep(max(delays))

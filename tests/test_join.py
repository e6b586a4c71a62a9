"""Joining a hit's blocks (kvroute/backend/join.py): the same bytes as concatenating
them, whichever way it runs. The kernel runs on CUDA only; on this CPU `join` takes
MLX's concatenate, and the GPU-only test checks the kernel against it."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kvroute.backend import join


def blocks(n: int, shape=(2, 4, 32, 64), dtype=mx.bfloat16) -> list[mx.array]:
    return [mx.random.normal(shape).astype(dtype) for _ in range(n)]


def test_join_gives_the_concatenation_with_a_partial_last_block():
    parts = blocks(40) + [mx.random.normal((2, 4, 7, 64)).astype(mx.bfloat16)]
    assert mx.array_equal(join.join(parts), mx.concatenate(parts, axis=2)).item()
    assert mx.array_equal(join.join(parts[:1]), parts[0]).item()


@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs a CUDA GPU (the join kernel)")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_on_a_gpu_the_join_kernel_gives_concatenates_bytes(dtype):
    join.warm()
    assert join.works()
    for n in (16, 255, 256, 257, 600):  # one launch, a full one, and several
        parts = blocks(n, (3, 4, 32, 128), dtype)
        tail = [mx.random.normal((3, 4, 5, 128)).astype(dtype)]
        for case in (parts, parts + tail):
            assert mx.array_equal(join.join(case), mx.concatenate(case, axis=2)).item(), (n, dtype)

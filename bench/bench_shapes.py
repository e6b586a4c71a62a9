"""What a shape the process has not seen costs on first use, piece by piece.

On a GPU the first call of a model at a new prompt length takes longer than the
next one at that length. This times, in one process, each first call and then the
same call again, for: the model's forward at new lengths (cold, and a short suffix
after a cached prefix; mlx-lm's attention, i.e. the fused kernel), the MLP's two
matmuls alone at new row counts, a fresh allocation, and the fused causal attention
alone; then it runs the matmuls at every 8th row count up to 2048 and times new row
counts again. Run it under different settings (e.g. `MLX_USE_CUDA_GRAPHS=0`,
`CUDA_MODULE_LOADING=EAGER`) to see which costs move. A first run on a fresh machine
also pays kernel compilation; compare later runs.

With --decode it times instead one decode step's attention (one query per
sequence against a KV cache of S tokens), the way mlx-lm's caches hand it over: a
slice of a buffer grown 256 tokens at a time, which MLX on CUDA sends to cuDNN
(a plan per batch size and buffer length, built on first use), and a buffer of a
length that is not a multiple of 256, which MLX's own vector kernel takes.

    python -m bench.bench_shapes MODEL_DIR [--decode [--batches 1,8] [--lengths 1000,4000]]
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from kvroute.backend.attention import CUDNN_DECODE_STEP, DECODE_SLACK


def timed(fn) -> float:
    """Milliseconds to evaluate `fn()` on an idle device."""
    mx.synchronize()
    t0 = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - t0) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_shapes", description=__doc__.splitlines()[0])
    ap.add_argument("model", help="model directory (python -m bench.models makes one)")
    ap.add_argument("--decode", action="store_true", help="time decode attention only")
    ap.add_argument("--batches", default="1,8", help="with --decode: rows of the batch")
    ap.add_argument("--lengths", default="1000,4000,16000,31000",
                    help="with --decode: cached tokens")
    args = ap.parse_args()
    model, _ = load(args.model)
    hidden, inter = model.args.hidden_size, model.args.intermediate_size
    heads, kv_heads = model.args.num_attention_heads, model.args.num_key_value_heads
    head_dim = hidden // heads
    if args.decode:
        decode_attention(heads, kv_heads, head_dim, [int(b) for b in args.batches.split(",")],
                         [int(n) for n in args.lengths.split(",")])
        return

    def tokens(n: int, salt: int) -> mx.array:
        return mx.array([[(i * 13 + salt) % 900 + 3 for i in range(n)]])

    def forward(n: int, prefix: int = 0) -> float:
        cache = make_prompt_cache(model)
        if prefix:
            model(tokens(prefix, 1), cache=cache)
            mx.eval([c.state for c in cache])
        x = tokens(n, 0)
        return timed(lambda: model(x, cache=cache))

    w1 = mx.random.normal((inter, hidden)).astype(mx.bfloat16)
    w2 = mx.random.normal((hidden, inter)).astype(mx.bfloat16)
    mx.eval(w1, w2)

    def mlp(m: int) -> float:
        x = mx.random.normal((1, m, hidden)).astype(mx.bfloat16)
        mx.eval(x)

        def run() -> mx.array:
            y = x @ w1.T
            return (y * mx.sigmoid(y)) @ w2.T

        return timed(run)

    def attention(n: int) -> float:
        q = mx.random.normal((1, heads, n, head_dim)).astype(mx.bfloat16)
        k = mx.random.normal((1, kv_heads, n, head_dim)).astype(mx.bfloat16)
        mx.eval(q, k)
        return timed(lambda: mx.fast.scaled_dot_product_attention(q, k, k, scale=head_dim ** -0.5,
                                                                  mask="causal"))

    def row(label: str, fn) -> None:
        first, again = fn(), fn()
        print(f"{label:44s} first {first:8.1f} ms  again {again:8.1f} ms  extra {first - again:7.1f}",
              flush=True)

    print(f"device {mx.default_device()}, mlx {mx.__version__}; ms")
    for _ in range(3):
        forward(2048)
    row("forward 2048 (seen)", lambda: forward(2048))
    row("forward 2022 (new length)", lambda: forward(2022))
    row("forward 1769 (new length)", lambda: forward(1769))
    row("forward 21 after a 2048 prefix", lambda: forward(21, 2048))
    row("forward 57 after a 2048 prefix", lambda: forward(57, 2048))
    row("forward 21 after a 1000 prefix", lambda: forward(21, 1000))
    mlp(2048)
    for m in (1999, 1777, 1500, 37, 23):
        row(f"MLP matmuls, {m} rows", lambda m=m: mlp(m))
    row(f"allocate and fill 1998 x {inter}", lambda: timed(lambda: mx.zeros((1998, inter), mx.bfloat16) + 1))
    attention(2048)
    for n in (1998, 1776):
        row(f"fused causal attention, {n}", lambda n=n: attention(n))
    t0 = time.perf_counter()
    for m in range(8, 2049, 8):
        mlp(m)
    print(f"MLP matmuls at every 8th row count to 2048: {time.perf_counter() - t0:.1f} s")
    for m in (1234, 45, 1001, 613, 77):
        row(f"after that: MLP matmuls, {m} rows", lambda m=m: mlp(m))
    row("after that: forward 1234 (new length)", lambda: forward(1234))


def decode_attention(heads: int, kv_heads: int, head_dim: int, batches: list[int],
                     lengths: list[int], steps: int = 50, layers: int = 28) -> None:
    """One decode step's attention against S cached tokens: the first call (which
    builds cuDNN's plan where cuDNN takes it) and the mean over `steps` steps of
    `layers` calls each (one evaluation per step, as a model's decode step runs)."""
    print(f"device {mx.default_device()}, mlx {mx.__version__}; decode attention, ms per call")
    print(f"{'batch':>5s} {'S':>6s} {'buffer':>7s}  {'first':>8s}  {'steady':>8s}")
    for batch in batches:
        for s in lengths:
            full = -(-s // CUDNN_DECODE_STEP) * CUDNN_DECODE_STEP  # as mlx-lm's caches grow
            for buffer in (full, full + DECODE_SLACK):
                q = mx.random.normal((batch, heads, 1, head_dim)).astype(mx.bfloat16)
                kv = mx.random.normal((batch, kv_heads, buffer, head_dim)).astype(mx.bfloat16)
                mx.eval(q, kv)
                k = kv[..., :s, :]

                def call() -> mx.array:
                    return mx.fast.scaled_dot_product_attention(q, k, k, scale=head_dim ** -0.5)

                first = timed(call)
                t0 = time.perf_counter()
                for _ in range(steps):
                    mx.eval([call() for _ in range(layers)])
                mx.synchronize()
                steady = (time.perf_counter() - t0) / (steps * layers) * 1000
                print(f"{batch:5d} {s:6d} {buffer:7d}  {first:8.2f}  {steady:8.3f}", flush=True)


if __name__ == "__main__":
    main()

"""The gated-delta recurrence alone: mlx-lm's per-token loop (what Qwen3-Next's and
Qwen3.5's linear layers run off Metal), MLX's fused `mx.fast.gated_delta_update` where
this MLX has it, and kvroute's chunked form (chunked_delta.py, what a CUDA backend
runs), on one linear layer of the 7B-class Qwen3-Next shape (16 key heads, 32 value
heads, 128 x 128 state), a prompt of each length with a state carried in. The
model's other layers are not timed: bench_families times the whole model through a
backend. Medians of --repeat after one warm-up run each; ratios against the loop.

    python -m bench.bench_gated_delta [--sizes 512,2048,8192] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import mlx.core as mx
from mlx_lm.models.gated_delta import gated_delta_ops, normalize_qk
from rich.console import Console
from rich.table import Table

from kvroute.backend.chunked_delta import gated_delta_chunked

HK, HV, D = 16, 32, 128


def inputs(t: int) -> tuple:
    keys = mx.random.split(mx.random.key(t), 6)
    q = mx.random.normal((1, t, HK, D), key=keys[0]).astype(mx.bfloat16)
    k = mx.random.normal((1, t, HK, D), key=keys[1]).astype(mx.bfloat16)
    q, k = normalize_qk(q, k, inv_scale=D ** -0.5, eps=1e-6)
    v = mx.random.normal((1, t, HV, D), key=keys[2]).astype(mx.bfloat16)
    g = mx.exp(-0.3 * mx.exp(0.5 * mx.random.normal((1, t, HV), key=keys[3])))
    beta = mx.sigmoid(mx.random.normal((1, t, HV), key=keys[4]))
    state = 0.1 * mx.random.normal((1, HV, D, D), key=keys[5])
    mx.eval(q, k, v, g, beta, state)
    return q, k, v, g, beta, state


def timed(fn, args: tuple, repeat: int) -> tuple[float, tuple]:
    out = fn(*args)
    mx.eval(out)  # warm-up
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn(*args)
        mx.eval(out)
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="512,2048", help="prompt lengths, tokens")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    ways = {"loop (mlx-lm)": gated_delta_ops, "chunked (kvroute)": gated_delta_chunked}
    if hasattr(mx.fast, "gated_delta_update"):
        ways["fused (mx.fast)"] = lambda q, k, v, g, beta, state: mx.fast.gated_delta_update(
            q, k, v, g, beta, state)
    console = Console(width=160)
    console.print(f"{platform.platform()}; {os.cpu_count()} cores; mlx {mx.__version__}, "
                  f"device {mx.default_device()}")
    table = Table(title=f"one gated-delta layer ({HK} key heads, {HV} value heads, {D}x{D} state)")
    for col in ("tokens", "way", "s", "tokens/s", "x loop", "state gap"):
        table.add_column(col, justify="right")
    for t in (int(x) for x in args.sizes.split(",")):
        data = inputs(t)
        base, (_, s0) = timed(gated_delta_ops, data, args.repeat)
        for name, fn in ways.items():
            seconds, (_, s) = (base, (None, s0)) if fn is gated_delta_ops else timed(fn, data, args.repeat)
            err = (mx.max(mx.abs(s - s0)) / mx.max(mx.abs(s0))).item()
            table.add_row(str(t), name, f"{seconds:.3f}", f"{t / seconds:,.0f}",
                          f"{base / seconds:.2f}", f"{err:.1e}")
    console.print(table)


if __name__ == "__main__":
    main()

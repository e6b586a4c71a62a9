"""Where decode time goes: the same model decoding, one layer of the stack at a time.

bench_hw.py compares the whole stack (HTTP, proxy, backend) with raw mlx-lm. When
decode falls short there, this tells which layer loses it, in one process:

- `generate_step`: mlx-lm's single-sequence loop (the baseline);
- `BatchGenerator`: mlx-lm's batched generator with its own caches;
- `BatchGenerator + fast caches`: the same with kvroute's caches (backend/attention.py);
- `Engine`: kvroute's engine thread (commit, detokenising, output parsing, events
  handed to an asyncio loop), without HTTP.

Each runs at 1 and at --streams sequences (not generate_step) after a warm-up, with
greedy sampling and random-token prompts of --prompt tokens. Tokens/s are aggregate
over the sequences, counted from the first token of any to the last of all.
With --profile, the Engine's single-stream run is profiled on its thread and the top
functions by own time are printed: whatever waits on the device shows up in
`tolist`/`eval`, Python work in everything else.

    python bench/bench_decode.py --model DIR [--tokens 256] [--streams 8] [--prompt 64] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import platform
import pstats
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import make_prompt_cache
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.attention import new_cache  # noqa: E402
from backend.engine import Delta, Engine, Finish, Job  # noqa: E402
from backend.metrics import BackendMetrics  # noqa: E402
from backend.store import Store  # noqa: E402
from kvroute.wire import SamplingParams  # noqa: E402


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    # Plain tokens from the middle of the vocabulary, different per sequence.
    lo, span = min(300, vocab // 4), max(vocab // 2, 1)
    return [[lo + (i * 131 + j * 17) % span for j in range(length)] for i in range(n)]


def rate(first: float, last: float, tokens: int) -> float:
    return tokens / (last - first) if last > first else 0.0


def run_generate_step(model, prompt: list[int], n: int) -> float:
    stamps = [time.perf_counter() for _ in generate_step(mx.array(prompt), model, max_tokens=n)]
    return rate(stamps[0], stamps[-1], len(stamps) - 1)


def run_batch(model, batch: list[list[int]], n: int, fast_caches: bool) -> float:
    gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=len(batch),
                         prefill_batch_size=len(batch))
    caches = [new_cache(model) if fast_caches else make_prompt_cache(model) for _ in batch]
    gen.insert(batch, max_tokens=[n] * len(batch), caches=caches)
    first = last = 0.0
    tokens = 0
    live = len(batch)
    try:
        while live:
            _, responses = gen.next()
            if not responses:
                continue
            now = time.perf_counter()
            if not first:
                first = now
            else:
                tokens += len(responses)
            last = now
            live -= sum(r.finish_reason is not None for r in responses)
    finally:
        gen.close()
    return rate(first, last, tokens)


async def _engine_run(engine: Engine, batch: list[list[int]], n: int) -> float:
    loop = asyncio.get_running_loop()
    stamps: list[list[float]] = [[] for _ in batch]

    async def one(i: int, prompt: list[int]) -> None:
        job = Job(prompt=prompt, params=SamplingParams(temperature=0.0), max_tokens=n, tools=None,
                  loop=loop, events=asyncio.Queue(), checkpoints={len(prompt) - 1: []})
        engine.submit(job)
        while True:
            event = await job.events.get()
            if isinstance(event, Delta):
                stamps[i].append(time.perf_counter())
            elif isinstance(event, Finish):
                return
            else:
                raise RuntimeError(f"engine answered {event!r}")

    await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))
    first = min(s[0] for s in stamps)
    last = max(s[-1] for s in stamps)
    return rate(first, last, sum(len(s) for s in stamps) - 1)


def run_engine(engine: Engine, batch: list[list[int]], n: int) -> float:
    return asyncio.run(_engine_run(engine, batch, n))


def profiled_engine(engine: Engine, batch: list[list[int]], n: int, top: int = 25) -> str:
    # cProfile is per thread: install it on the engine thread for one run.
    prof = cProfile.Profile()
    done = asyncio.run(_profile(engine, prof, batch, n))
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return f"Engine, {len(batch)} stream(s), {done:.1f} tok/s under the profiler\n" + out.getvalue()


async def _profile(engine: Engine, prof: cProfile.Profile, batch, n) -> float:
    await engine.call(prof.enable)
    try:
        return await _engine_run(engine, batch, n)
    finally:
        await engine.call(prof.disable)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="model directory (bench/models.py makes one)")
    ap.add_argument("--tokens", type=int, default=256, help="tokens decoded per sequence")
    ap.add_argument("--streams", type=int, default=8, help="sequences of the batched runs")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per sequence")
    ap.add_argument("--repeat", type=int, default=2, help="runs per row; the best is shown")
    ap.add_argument("--profile", action="store_true", help="profile the Engine's 1-stream run")
    args = ap.parse_args()

    model, tokenizer = load(args.model)
    vocab = len(tokenizer.vocab) if hasattr(tokenizer, "vocab") else 1000
    one = prompts(1, args.prompt, vocab)
    many = prompts(args.streams, args.prompt, vocab)
    store = Store(1 << 30)
    engine = Engine(model, tokenizer, "bench", store, BackendMetrics("bench", "bench"),
                    prefill_step=2048, max_batch=max(args.streams, 8))
    engine.start()
    warm = asyncio.run(_call(engine, engine.warm_up))

    rows: list[tuple[str, float, float]] = []
    best = lambda f: max(f() for _ in range(args.repeat))  # noqa: E731
    run_generate_step(model, one[0], 16)
    rows.append(("generate_step", best(lambda: run_generate_step(model, one[0], args.tokens)), 0.0))
    for name, fast_caches in (("BatchGenerator", False), ("BatchGenerator + fast caches", True)):
        run_batch(model, many, 8, fast_caches)
        rows.append((name, best(lambda: run_batch(model, one, args.tokens, fast_caches)),
                     best(lambda: run_batch(model, many, args.tokens, fast_caches))))
    run_engine(engine, many, 8)
    rows.append(("Engine", best(lambda: run_engine(engine, one, args.tokens)),
                 best(lambda: run_engine(engine, many, args.tokens))))
    profile = profiled_engine(engine, one, args.tokens) if args.profile else ""
    engine.stop()

    base = rows[0][1]
    table = Table(title=f"Decode tokens/s by layer ({args.tokens} tokens, prompt {args.prompt}, "
                        f"best of {args.repeat})")
    for col in ("layer", "1 stream", "vs generate_step", f"{args.streams} streams (aggregate)"):
        table.add_column(col, justify="left" if col == "layer" else "right")
    for name, single, batched in rows:
        table.add_row(name, f"{single:.1f}", f"{single / base:.2f}x",
                      f"{batched:.1f}" if batched else "")
    console = Console(width=120)
    console.print(f"command: python {' '.join(sys.argv)}")
    console.print(f"machine: {platform.machine()} {platform.system()}, device {mx.default_device()}, "
                  f"mlx {mx.__version__}; engine warm-up {warm:.1f} s")
    console.print(table)
    if profile:
        console.print(profile, markup=False, highlight=False)


async def _call(engine: Engine, fn):
    return await engine.call(fn)


if __name__ == "__main__":
    main()

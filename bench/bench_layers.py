"""Where the time goes: decode and cached turns, one layer of the stack at a time.

bench_hw.py compares the whole stack (HTTP, proxy, backend) with raw mlx-lm. When a
row falls short there, this tells which layer loses it, in one process. Decode:

- `generate_step`: mlx-lm's single-sequence loop (the baseline);
- `BatchGenerator`: mlx-lm's batched generator with its own caches;
- `BatchGenerator + fast caches`: the same with kvroute's caches (backend/attention.py);
- `Engine`: kvroute's engine thread (commit, detokenising, output parsing, events
  handed to an asyncio loop), without HTTP.

Each runs at 1 and at --streams sequences (not generate_step) after a warm-up, with
greedy sampling and random-token prompts of --prompt tokens. Tokens/s are aggregate
over the sequences, counted from the first token of any to the last of all.
With --profile, the Engine's batched run (and a last second turn) is profiled on its thread and the top
functions by own time are printed: whatever waits on the device shows up in
`tolist`/`eval`, Python work in everything else.

Cold prompts (--cold N): the time to first token of prompts of about N tokens right
after the Engine's warm-up, at new lengths and again at lengths already seen, for the
Engine and generate_step (its rows come after the Engine's and reuse what it compiled).

Cached turns (--turn2 N): a first turn of about N tokens, then a second that extends
it by --suffix tokens; the time to the second turn's first token, for raw
`generate_step` (the first turn's cache trimmed to the common prefix) and for the
Engine (turn 1 committed, turn 2 a hit), over conversations of a few lengths, each
twice: a second turn at a length already seen shows the steady state, one at a new
length also what compiling kernels for new shapes costs.

Restored turns (--restore N): a first turn of about N tokens committed and written to
a disk tier, the store emptied and the tier reopened (a restart), then the second
turn restored from disk (`DiskTier.prefetch`, as the server does before the engine)
and run with the Engine's steps traced; twice, at two lengths, so that what a
process pays the first time stands apart; and a RAM hit of the same size traced beside.

With --trace, a last cold prompt and the last second turn are run with each of the Engine's steps
timed (the device synchronised after each, so its work is counted where it was
queued): admission (lookup, insert), every generator step, the checkpoint commit
and the first token's handling, in milliseconds from the submit; and the cost of
copying a cache of the first turn's size into fresh memory and into reused memory.

    python -m bench.bench_layers --model DIR [--tokens 256] [--streams 8] [--prompt 64] [--profile]
                                 [--turn2 31000 --suffix 70] [--trace]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import platform
import pstats
import time
from typing import Any

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import make_prompt_cache
from rich.console import Console
from rich.table import Table

from bench.command import command_line
from kvroute.backend.attention import new_cache
from kvroute.backend.engine import Engine
from kvroute.backend.jobs import Delta, Finish, Job
from kvroute.backend.metrics import BackendMetrics
from kvroute.backend.requests import SamplingParams
from kvroute.backend.store import Store
from kvroute.core.accel import exit_skipping_teardown
from kvroute.core.sizes import parse_bytes


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


# -- cached turns ----------------------------------------------------------------------


def raw_turn2(model, first: list[int], second: list[int]) -> float:
    """Seconds to the second turn's first token with generate_step, from the first
    turn's cache trimmed to what the two share."""
    common = next((i for i, (a, b) in enumerate(zip(first, second)) if a != b),
                  min(len(first), len(second)))
    cache = make_prompt_cache(model)
    next(generate_step(mx.array(first), model, max_tokens=1, prompt_cache=cache,
                       prefill_step_size=2048))
    for c in cache:
        c.trim(c.offset - common)
    mx.eval([c.state for c in cache])
    t0 = time.perf_counter()
    next(generate_step(mx.array(second[common:]), model, max_tokens=1, prompt_cache=cache,
                       prefill_step_size=2048))
    return time.perf_counter() - t0


async def _engine_turn(engine: Engine, prompt: list[int], n: int,
                       restored=None) -> tuple[float, int]:
    loop = asyncio.get_running_loop()
    job = Job(prompt=prompt, params=SamplingParams(temperature=0.0), max_tokens=n, tools=None,
              loop=loop, events=asyncio.Queue(), checkpoints={len(prompt) - 1: []})
    job.restored = restored
    t0 = time.perf_counter()
    engine.submit(job)
    first = 0.0
    while True:
        event = await job.events.get()
        if isinstance(event, Delta) and not first:
            first = time.perf_counter() - t0
        elif isinstance(event, Finish):
            return first, event.cached_tokens
        elif not isinstance(event, Delta):
            raise RuntimeError(f"engine answered {event!r}")


def engine_turn2(engine: Engine, first: list[int], second: list[int]) -> tuple[float, int]:
    asyncio.run(_engine_turn(engine, first, 1))
    return asyncio.run(_engine_turn(engine, second, 1))


def turn2_rows(model, engine: Engine, vocab: int, n: int, suffix: int,
               profile: bool, trace: bool = False) -> tuple[list[tuple], str]:
    rows = []
    for length in (n, n, n - 97, n - 97, n - 211):
        first = prompts(1, length, vocab)[0]
        second = first + prompts(1, suffix, vocab)[0][::-1]
        # The Engine first: kernels compiled for a new shape then count against it,
        # not against generate_step.
        mine, cached = engine_turn2(engine, first, second)
        raw = raw_turn2(model, first, second)
        rows.append((len(first), len(second), cached, raw, mine))
        engine.store.clear()  # the engine is idle between turns; the next length starts cold
        mx.clear_cache()
    if not (profile or trace):
        return rows, ""
    first = prompts(1, n, vocab)[0]
    second = first + prompts(1, suffix, vocab)[0][::-1]
    out = []
    if trace:
        asyncio.run(_engine_turn(engine, first, 1))
        out.append(traced(engine, lambda: _engine_turn(engine, second, 1)))
        engine.store.clear()
        out.append(copy_costs(model, n))
    if profile:
        asyncio.run(_engine_turn(engine, first, 1))
        out.append(profiled(engine, "Engine, second turn (TTFT s, cached tokens)",
                            lambda: _engine_turn(engine, second, 1)))
    return rows, "\n".join(out)


def traced(engine: Engine, run) -> str:
    """`run()` (a coroutine function) with the engine's steps timed one by one."""
    marks: list[tuple[str, float, float]] = []

    def timed(name: str, fn):
        def wrapper(*a, **kw):
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                mx.synchronize()
                marks.append((name, start - t0, time.perf_counter() - t0))
        return wrapper

    originals = {name: getattr(engine, name) for name in ("_admit", "_checkpoint", "_on_token")}
    gen_next = engine._gen.next
    for name, fn in originals.items():
        setattr(engine, name, timed(name.strip("_"), fn))
    engine._gen.next = timed("generator step", gen_next)
    try:
        t0 = time.perf_counter()
        result = asyncio.run(run())
        total = time.perf_counter() - t0
    finally:
        for name in originals:
            delattr(engine, name)
        del engine._gen.next
    lines = [f"traced: {result}, {total * 1e3:.1f} ms to the end"]
    lines += [f"  {a * 1e3:8.1f} -> {b * 1e3:8.1f} ms  {b * 1e3 - a * 1e3:7.1f} ms  {name}"
              for name, a, b in marks[:16]]
    return "\n".join(lines)


def copy_costs(model, tokens: int) -> str:
    """Seconds to copy every layer's keys and values of a `tokens`-long cache, into
    memory just released to the device (after `mx.clear_cache`) and into memory the
    allocator still holds."""
    cache = make_prompt_cache(model)
    args = model.args
    heads = getattr(args, "num_key_value_heads", None) or args.num_attention_heads
    dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    layers = [mx.zeros((1, heads, tokens, dim), mx.bfloat16) for _ in range(2 * len(cache))]
    mx.eval(layers)
    rows = []
    for fresh in (True, False, True, False):
        if fresh:
            mx.clear_cache()
        else:
            mx.eval([mx.contiguous(a[..., 1:, :]) for a in layers])  # leaves freed buffers cached
        t = time.perf_counter()
        copies = [mx.contiguous(a[..., : tokens - 3, :]) for a in layers]
        mx.eval(copies)
        rows.append((fresh, time.perf_counter() - t))
        del copies
    gb = sum(a.nbytes for a in layers) / 1e9
    return "\n".join(f"copy of a {tokens}-token cache ({gb:.2f} GB) into "
                     f"{'fresh' if fresh else 'reused'} memory: {secs * 1e3:.1f} ms"
                     for fresh, secs in rows)


def profiled(engine: Engine, what: str, run, top: int = 25) -> str:
    """`run()` (a coroutine function) with cProfile on the engine thread (it is per
    thread), and the top functions by own time."""
    prof = cProfile.Profile()

    async def go():
        await engine.call(prof.enable)
        try:
            return await run()
        finally:
            await engine.call(prof.disable)

    result = asyncio.run(go())
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return f"{what}: {result} under the profiler\n" + out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_layers", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="model directory (python -m bench.models makes one)")
    ap.add_argument("--tokens", type=int, default=256, help="tokens decoded per sequence")
    ap.add_argument("--streams", type=int, default=8, help="sequences of the batched runs")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per sequence")
    ap.add_argument("--repeat", type=int, default=2, help="runs per row; the best is shown")
    ap.add_argument("--profile", action="store_true", help="profile the Engine's batched run")
    ap.add_argument("--turn2", type=int, default=0, help="first-turn tokens of the cached-turn "
                    "runs (0: skip them)")
    ap.add_argument("--suffix", type=int, default=70, help="tokens the second turn adds")
    ap.add_argument("--trace", action="store_true", help="time each Engine step of a second turn")
    ap.add_argument("--cold", type=int, default=0, help="tokens of the cold-prompt runs right "
                    "after warm-up (0: skip them)")
    ap.add_argument("--restore", type=int, default=0, help="first-turn tokens of the traced "
                    "disk-restored second turns (0: skip them)")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--no-hot", action="store_true", help="turn 2 assembles its blocks: no hot "
                    "copy of turn 1 (the store's keep_hot), for an A/B")
    ap.add_argument("--cache-bytes", default="16GiB", help="the engine's prompt-cache budget")
    args = ap.parse_args()

    model, tokenizer = load(args.model)
    vocab = len(tokenizer.vocab) if hasattr(tokenizer, "vocab") else 1000
    one = prompts(1, args.prompt, vocab)
    many = prompts(args.streams, args.prompt, vocab)
    store = Store(parse_bytes(args.cache_bytes))
    if args.no_hot:
        store.keep_hot = lambda entry, cache: False
    engine = Engine(model, tokenizer, "bench", store, BackendMetrics("bench", "bench"),
                    prefill_step=2048, max_batch=max(args.streams, 8))
    engine.start()
    warm = asyncio.run(_call(engine, engine.warm_up))

    console = Console(width=120)
    console.print(f"command: {command_line()}")
    console.print(f"machine: {platform.machine()} {platform.system()}, device {mx.default_device()}, "
                  f"mlx {mx.__version__}; engine warm-up {warm:.1f} s")
    if args.cold:
        console.print(ttft_table("Cold prompts after warm-up: time to first token (s)",
                                 ("prompt tokens",), cold_rows(model, engine, vocab, args.cold)))
        if args.trace:  # one more, at a length not seen yet
            prompt = prompts(1, args.cold + 29, vocab + 7)[0]
            console.print(traced(engine, lambda: _engine_turn(engine, prompt, 1)),
                          markup=False, highlight=False)
            engine.store.clear()
    if args.turn2:
        rows, profile = turn2_rows(model, engine, vocab, args.turn2, args.suffix, args.profile,
                                   args.trace)
        console.print(ttft_table("Second turn of a conversation: time to first token (s)",
                                 ("turn 1 tokens", "turn 2 tokens", "cached"), rows))
        console.print(profile, markup=False, highlight=False)
    if args.restore:
        console.print(restored_turns(args, engine, vocab), markup=False, highlight=False)
    if not args.skip_decode:
        decode(args, console, model, engine, one, many)
    engine.stop()


def restored_turns(args, engine: Engine, vocab: int) -> str:
    """Second turns restored from a disk tier after a simulated restart, traced."""
    import shutil
    import tempfile

    from kvroute.backend.disk import DiskTier, restore_readers

    folder = tempfile.mkdtemp(prefix="kvr-layers-")
    out = []
    try:
        for i, n in enumerate((args.restore, args.restore - 97)):
            first = prompts(1, n, vocab + 11 * (i + 1))[0]
            second = first + prompts(1, args.suffix, vocab)[0][::-1]
            tier = DiskTier(folder, 1 << 33, "f" * 32, engine.metrics, queue_bytes=1 << 40)
            assert tier.open()
            engine.store.listeners.append(tier.on_store_event)
            asyncio.run(_engine_turn(engine, first, 1))
            deadline = time.monotonic() + 300
            while tier.stats()["write_queue"] or not tier.index:
                if time.monotonic() > deadline:
                    raise RuntimeError("the disk tier did not write turn 1")
                time.sleep(0.05)
            engine.store.listeners.remove(tier.on_store_event)
            tier.close()
            engine.store.clear()
            mx.clear_cache()
            again = DiskTier(folder, 1 << 33, "f" * 32, engine.metrics, queue_bytes=1 << 40,
                             read_parallel=restore_readers())
            assert again.open()
            t0 = time.perf_counter()
            restored = _result(again.prefetch("bench", second, None, lambda: 0))
            read = time.perf_counter() - t0
            out.append(f"restore {i + 1}: {n} + {args.suffix} tokens, {restored.tokens} read "
                       f"back in {read * 1e3:.1f} ms")
            out.append(traced(engine, lambda: _engine_turn(engine, second, 1, restored)))
            again.close()
            engine.store.clear()
            # The same second turn as a RAM hit (turn 1 just committed: its hot copy).
            asyncio.run(_engine_turn(engine, first, 1))
            out.append("the same turn, a RAM hit")
            out.append(traced(engine, lambda: _engine_turn(engine, second, 1)))
            engine.store.clear()
            shutil.rmtree(folder, ignore_errors=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return "\n".join(out)


def _result(coro) -> Any:
    """`coro`'s result, run by asyncio.run without being its main task's result: when
    it ends, Python 3.11's asyncio.run formats that task, result included, with repr()
    (signal.getsignal's enum lookup; fixed in later Pythons), and a restored state's
    repr reads every block on the host (on CUDA that moves each buffer to managed
    memory, which the engine's next read pulls back page by page)."""
    box: list = []

    async def main() -> None:
        box.append(await coro)

    asyncio.run(main())
    return box[0]


def cold_rows(model, engine: Engine, vocab: int, n: int) -> list[tuple]:
    """Cold prompts right after warm-up: the first at each new length, then again."""
    rows = []
    for i, length in enumerate((n, n, n - 47, n - 47, n - 301, n + 13)):
        prompt = prompts(1, length, vocab + i)[0]
        mine, _ = asyncio.run(_engine_turn(engine, prompt, 1))
        engine.store.clear()
        t0 = time.perf_counter()
        next(generate_step(mx.array(prompt[::-1]), model, max_tokens=1, prefill_step_size=2048))
        rows.append((length, time.perf_counter() - t0, mine))
    return rows


def ttft_table(title: str, head: tuple[str, ...], rows: list[tuple]) -> Table:
    """Rows of (*head values, generate_step seconds, Engine seconds)."""
    table = Table(title=title)
    for col in (*head, "generate_step", "Engine", "ratio"):
        table.add_column(col, justify="right")
    for *values, raw, mine in rows:
        table.add_row(*map(str, values), f"{raw:.3f}", f"{mine:.3f}", f"{mine / raw:.2f}x")
    return table


def decode(args, console: Console, model, engine: Engine, one, many) -> None:
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
    profile = profiled(engine, f"Engine, {len(many)} streams, tok/s",
                       lambda: _engine_run(engine, many, args.tokens)) if args.profile else ""

    base = rows[0][1]
    table = Table(title=f"Decode tokens/s by layer ({args.tokens} tokens, prompt {args.prompt}, "
                        f"best of {args.repeat})")
    for col in ("layer", "1 stream", "vs generate_step", f"{args.streams} streams (aggregate)"):
        table.add_column(col, justify="left" if col == "layer" else "right")
    for name, single, batched in rows:
        table.add_row(name, f"{single:.1f}", f"{single / base:.2f}x",
                      f"{batched:.1f}" if batched else "")
    console.print(table)
    if profile:
        console.print(profile, markup=False, highlight=False)


async def _call(engine: Engine, fn):
    return await engine.call(fn)


if __name__ == "__main__":
    main()
    exit_skipping_teardown()  # as `kvroute backend` does

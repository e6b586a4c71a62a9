"""Batched decode with sampling against greedy: N streams on one backend, streamed over
HTTP, greedy (temperature 0) and sampled (temperature 0.7, top_p 0.95, what agent
clients send), the two interleaved so that a busy machine slows them alike.

mlx-lm's generator samples the whole batch in one call only when every row has the
same sampler, and otherwise row by row; unseeded requests with the same settings share
one sampler (sampling.py). This prints both rates and sampled / greedy. A random-weight
model gives its masked tokens (end-of-sequence among them) logits of 0, which greedy
decoding never picks and sampling sometimes does: the sampled streams that ended before
their tokens are counted and shown (a batch that thins out decodes fewer tokens a step).

    python -m bench.models /tmp/mtiny --preset cpu --hidden 128 --layers 2 --intermediate 256 \\
        --heads 4 --kv-heads 2
    python -m bench.bench_sampling --model /tmp/mtiny [--streams 8,32] [--tokens 300] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench import bench_hw
from tests.harness import BackendProcess

SAMPLED = {"temperature": 0.7, "top_p": 0.95}
GREEDY = {"temperature": 0}


async def decode_rate(url: str, tok, streams: int, n: int, seed: int,
                      params: dict) -> tuple[float, int]:
    """Aggregate tokens/s of `streams` concurrent streamed completions, from the first
    token of any to the last of all (prefill excluded), as bench_hw counts them; and how
    many streams ended before `n` tokens."""
    async def one(s, i: int):
        try:
            return await bench_hw.stream(s, url, "/v1/completions",
                                         {"model": "m", "prompt": bench_hw.text_of(tok, 64, seed + i),
                                          "max_tokens": n, **params})
        except RuntimeError as exc:  # ended at its first token, with no text
            if "no tokens" not in str(exc):
                raise
            return None

    async with bench_hw.http_session() as s:
        got = await asyncio.gather(*(one(s, i) for i in range(streams)))
    results = [r for r in got if r and len(r[1]) > 1]
    if not results:
        raise RuntimeError(f"{streams} streams: none decoded more than one token")
    early = sum(r is None or r[2].get("completion_tokens", n) < n for r in got)
    return bench_hw.aggregate_rate(results), early


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="model directory (python -m bench.models makes one)")
    ap.add_argument("--streams", default="8,32")
    ap.add_argument("--tokens", type=int, default=300, help="tokens each stream decodes")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    streams = [int(s) for s in args.streams.split(",")]

    backend = BackendProcess(args.model, model_id="m", log_dir=Path(tempfile.mkdtemp()),
                             extra=["--max-batch", str(max(streams))])
    backend.start(timeout=300)
    tok = bench_hw.Tokenizer(args.model)
    rates: dict[tuple[int, str], list[float]] = {}
    early: dict[int, int] = {}
    try:
        asyncio.run(decode_rate(backend.url, tok, max(streams), 16, 1, SAMPLED))  # warm up
        for r in range(args.repeat):
            for n in streams:
                for k, (name, params) in enumerate((("greedy", GREEDY), ("sampled", SAMPLED))):
                    seed = 1000 + 10_000 * r + 100 * n + 50 * k  # prompts never sent before
                    rate, ended = asyncio.run(decode_rate(backend.url, tok, n, args.tokens, seed,
                                                          params))
                    rates.setdefault((n, name), []).append(rate)
                    if name == "sampled":
                        early[n] = early.get(n, 0) + ended
    finally:
        backend.stop()

    table = Table(title=f"decode on one backend, {args.tokens} tokens a stream, medians of "
                        f"{args.repeat} ({platform.machine()}, {platform.system()})")
    for col in ("streams", "greedy", "sampled (T 0.7, top_p 0.95)", "sampled / greedy",
                "sampled streams that ended early"):
        table.add_column(col, justify="right")
    for n in streams:
        g = statistics.median(rates[(n, "greedy")])
        s = statistics.median(rates[(n, "sampled")])
        table.add_row(str(n), f"{g:,.0f} tok/s", f"{s:,.0f} tok/s", f"{s / g:.2f}x",
                      f"{early[n]} of {n * args.repeat}")
    Console().print(table)


if __name__ == "__main__":
    main()

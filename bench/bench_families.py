"""Cold vs cached time to first token for every model family, and what its
checkpoints cost in bytes per token.

For each architecture of `kvroute demo-model --arch` (tiny random-weight models,
built locally), starts a real backend process, then for each prompt length sends
a never-seen prompt (cold) and the same prompt again (cached from the prompt-end
checkpoint), timing the first streamed token on the client side. Medians over
--repeat runs. Bytes per token are those of the entry the repeat used, as `GET /debug/cache`
reports them (the models are tiny: compare families, not absolute sizes).

    python -m bench.bench_families [--arches qwen3,gemma3_text] [--sizes 1024,4096] [--repeat 3]

On an accelerator, 7B-class shapes of a sliding-window and a hybrid family:

    python -m bench.bench_families --model-size 7b --arches gemma3_text,qwen3_next \
        --sizes 8192,32768 --backend-args="--prefill-step 2048"
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.bench_ttft import prompt_of, ttft
from bench.command import command_line, machine
from kvroute.devtools import arch_models
from tests.harness import BackendProcess


def measure(backend: BackendProcess, size: int, repeat: int) -> dict:
    colds, hots, per_token, n_prompt, cached = [], [], [], 0, 0
    for _ in range(repeat):
        prompt = prompt_of(backend, size)
        before = {e["id"] for e in backend.cache()}
        t_cold, n_prompt, c0 = ttft(backend, prompt)
        assert c0 < 8, f"a cold prompt hit the cache ({c0} tokens)"
        t_hot, _, cached = ttft(backend, prompt)
        # The entry the repeat used: the prompt-end checkpoint, or for full attention
        # the longer entry (prompt + reply) that superseded it and was trimmed.
        new = [e for e in backend.cache() if e["id"] not in before and e["tokens"] >= cached]
        new = [min(new, key=lambda e: e["tokens"])] if new else []
        colds.append(t_cold)
        hots.append(t_hot)
        per_token += [e["nbytes"] / e["tokens"] for e in new]
    return {"prompt": n_prompt, "cached": cached, "cold": statistics.median(colds),
            "hot": statistics.median(hots),
            "bytes_per_token": statistics.median(per_token) if per_token else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_families", description=__doc__.splitlines()[0])
    ap.add_argument("--arches", default=",".join(arch_models.ARCHES))
    ap.add_argument("--sizes", default="1024,4096")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--model-size", default="tiny", choices=arch_models.SIZES)
    ap.add_argument("--models-dir", help="where models are built (default: a temporary folder)")
    ap.add_argument("--backend-args", default="", help="more `kvroute backend` flags")
    args = ap.parse_args()
    longest = max(int(s) for s in args.sizes.split(","))
    table = Table(title=f"Cold vs cached TTFT per family, {args.model_size} models "
                  f"(median of {args.repeat}, client side)")
    for col in ("arch", "prompt tokens", "cached tokens", "cold TTFT (ms)", "cached TTFT (ms)",
                "cold / cached", "checkpoint bytes/token"):
        table.add_column(col, justify="right")
    # Progress goes out as it happens (a 7B model's build or a slow kernel path can take
    # minutes): a run stopped early still says where its time went.
    say = lambda *a: print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.arches.split(","):
            t0 = time.perf_counter()
            model = arch_models.ensure(arch, cache_dir=Path(args.models_dir or Path(tmp) / "models"),
                                       size=args.model_size)
            say(f"{arch}: model ready in {time.perf_counter() - t0:.1f} s")
            backend = BackendProcess(model, model_id=arch, log_dir=Path(tmp),
                                     extra=["--cache-bytes", "16GiB", "--max-prompt-tokens",
                                            str(2 * longest), *args.backend_args.split()])
            t0 = time.perf_counter()
            try:
                backend.start(timeout=600)
                say(f"{arch}: backend ready in {time.perf_counter() - t0:.1f} s")
                # Which gated-delta path a hybrid's backend chose (and why), for the row.
                for line in backend.log().splitlines():
                    if "gated-delta" in line:
                        say(f"{arch}: {line.strip()[-200:]}")
                ttft(backend, prompt_of(backend, 64))  # warm-up
                for size in (int(s) for s in args.sizes.split(",")):
                    r = measure(backend, size, args.repeat)
                    row = (arch, str(r["prompt"]), str(r["cached"]), f"{r['cold'] * 1000:.1f}",
                           f"{r['hot'] * 1000:.1f}", f"{r['cold'] / r['hot']:.1f}x",
                           f"{r['bytes_per_token']:.0f}")
                    table.add_row(*row)
                    say(" | ".join(row))
            except BaseException:
                say(f"{arch}: stopped; the backend's log ends:\n{backend.log()[-3000:]}")
                raise
            finally:
                backend.stop()
    console = Console(width=160)
    console.print(f"command: {command_line()}")
    console.print(machine())
    console.print(table)


if __name__ == "__main__":
    main()

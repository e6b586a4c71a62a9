"""n choices of one prompt: one request with `n` (one prefill, the later choices start
from the first one's prompt commit) against n concurrent requests that cannot share a
prefill (each in a cache scope of its own), end to end on one backend.

Starts a real backend process (the demo model unless --model is given); each run uses a
never-seen prompt of about --tokens tokens and --max-tokens per choice. Medians over
--repeat runs, the two ways interleaved so that a busy machine slows them alike.

    python -m bench.bench_choices [--model PATH] [--tokens 6000] [--n 4] [--repeat 3]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.bench_ttft import prompt_of
from kvroute.devtools import demo_model
from tests.harness import BackendProcess, post_json


def one_request(backend: BackendProcess, prompt: str, n: int, max_tokens: int) -> float:
    t0 = time.perf_counter()
    status, body = post_json(backend.url + "/v1/completions",
                             {"model": backend.model_id, "prompt": prompt, "n": n,
                              "max_tokens": max_tokens, "temperature": 1.0}, timeout=600)
    assert status == 200 and len(body["choices"]) == n, body
    return time.perf_counter() - t0


def separate(backend: BackendProcess, prompt: str, n: int, max_tokens: int) -> float:
    def one(_: int) -> None:
        status, body = post_json(backend.url + "/v1/completions",
                                 {"model": backend.model_id, "prompt": prompt,
                                  "max_tokens": max_tokens, "temperature": 1.0},
                                 headers={"x-kvroute-scope": uuid.uuid4().hex}, timeout=600)
        assert status == 200, body

    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(one, range(n)))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model path (default: the demo model)")
    ap.add_argument("--tokens", type=int, default=6000)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or demo_model.ensure("text", cache_dir=Path(tmp))
        backend = BackendProcess(model, "bench", Path(tmp),
                                 extra=["--max-prompt-tokens", str(args.tokens * 2)])
        backend.start()
        try:
            shared, apart = [], []
            for _ in range(args.repeat):
                shared.append(one_request(backend, prompt_of(backend, args.tokens), args.n,
                                          args.max_tokens))
                apart.append(separate(backend, prompt_of(backend, args.tokens), args.n,
                                      args.max_tokens))
        finally:
            backend.stop()
    table = Table(title=f"{args.n} choices of a {args.tokens}-token prompt, {args.max_tokens} "
                        f"tokens each ({platform.machine()}, {platform.python_version()})")
    for col in ("how", "median s", "runs s"):
        table.add_column(col, justify="left" if col == "how" else "right")
    table.add_row(f"one request, n={args.n} (one prefill)", f"{statistics.median(shared):.2f}",
                  " ".join(f"{x:.2f}" for x in shared))
    table.add_row(f"{args.n} requests, no shared cache", f"{statistics.median(apart):.2f}",
                  " ".join(f"{x:.2f}" for x in apart))
    console.print(table)


if __name__ == "__main__":
    main()

"""Cold vs cached time to first token of one backend, at several prompt lengths.

Starts a real backend process (the demo model unless --model is given), then for
each prompt length sends a never-seen prompt (cold) and the same prompt again
(cached: everything but its last token comes from the prompt cache), measuring
the time to the first streamed token on the client side. Medians over --repeat
runs; the ratio cold/cached is what the cache saves.

    python -m bench.bench_ttft [--model PATH] [--sizes 256,1024,2048] [--repeat 5]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.command import command_line
from kvroute.devtools import demo_model
from tests.harness import BackendProcess, SSEStream, post_json


def prompt_of(backend: BackendProcess, n_tokens: int) -> str:
    """A never-seen prompt of about n_tokens tokens (calibrated through the backend's usage)."""
    text = " ".join(f"w{i % 97}" for i in range(n_tokens))
    # Calibrate on a quarter: words take several tokens, and the whole text could
    # exceed the model's context.
    sample = text[: len(text) // 4]
    status, body = post_json(backend.url + "/v1/completions",
                             {"model": backend.model_id, "prompt": sample, "max_tokens": 1})
    assert status == 200, body
    chars = int(n_tokens * len(sample) / body["usage"]["prompt_tokens"])
    return f"{uuid.uuid4().hex[:8]} {text[:chars]}"


def ttft(backend: BackendProcess, prompt: str) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    stream = SSEStream(backend.url + "/v1/completions",
                       {"model": backend.model_id, "prompt": prompt, "max_tokens": 2,
                        "stream_options": {"include_usage": True}})
    first = None
    usage = None
    for event in stream.events():
        if event == "[DONE]":
            break
        if first is None and event["choices"]:
            first = time.perf_counter() - t0
        if event.get("usage"):
            usage = event["usage"]
    stream.close()
    return first, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_ttft", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model path (default: the demo model)")
    ap.add_argument("--sizes", default="256,1024,2048")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    console = Console()
    model = args.model or str(demo_model.ensure("text"))
    with tempfile.TemporaryDirectory() as logs:
        backend = BackendProcess(model, model_id="bench", log_dir=Path(logs),
                                 extra=["--cache-bytes", "4GiB"])
        backend.start()
        try:
            ttft(backend, prompt_of(backend, 64))  # warm-up: compile kernels, fill allocators
            table = Table(title="Time to first token: cold vs cached (median of "
                          f"{args.repeat}, client side, streaming)")
            for col in ("prompt tokens", "cached tokens", "cold TTFT (ms)", "cached TTFT (ms)",
                        "cold / cached"):
                table.add_column(col, justify="right")
            for size in (int(s) for s in args.sizes.split(",")):
                colds, hots, cached = [], [], 0
                n_prompt = 0
                for _ in range(args.repeat):
                    prompt = prompt_of(backend, size)
                    t_cold, n_prompt, c0 = ttft(backend, prompt)
                    # Only the nonce's first characters can match an earlier prompt.
                    assert c0 < 8, f"a cold prompt hit the cache ({c0} tokens)"
                    t_hot, _, cached = ttft(backend, prompt)
                    colds.append(t_cold)
                    hots.append(t_hot)
                cold, hot = statistics.median(colds), statistics.median(hots)
                table.add_row(str(n_prompt), str(cached), f"{cold * 1000:.1f}", f"{hot * 1000:.1f}",
                              f"{cold / hot:.1f}x")
        finally:
            backend.stop()
    console.print(f"command: {command_line()}")
    console.print(f"machine: {platform.machine()} {platform.system()} {platform.release()}, "
                  f"python {platform.python_version()}, model {model}")
    console.print(table)


if __name__ == "__main__":
    main()

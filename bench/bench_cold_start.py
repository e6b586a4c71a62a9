"""Time to first token of a model that is not loaded (load + prefill) vs a loaded one.

Starts one `kvroute serve` per model under test with the model twice: `warm`
(preloaded) and `cold` (preload = false, idle_unload = 3s, so it unloads between
rounds). Each round sends a never-seen prompt to the warm alias (a loaded model's
cold prefill) and to the cold alias once it is unloaded again (process start, weight
load, prefill), streaming through the proxy and timing the first content chunk on
the client (the `: loading` keep-alives do not count). Medians over --repeat rounds.

    python -m bench.bench_cold_start [--repeat 3] [--words 200] [--large | --large-only] [--model PATH]

--large adds a random-weight qwen3 model with larger shapes (about 0.5 GB of
weights), built locally.

--disk measures what the disk tier brings to a model that comes back: the demo model
as `disk` (disk tier on) and `ram` (disk_cache_bytes = 0), both loaded on demand.
Each round sends a never-seen prompt (load + prefill + commit), waits for the model
to be unloaded, then sends the same conversation again: with the disk tier the
reloaded backend restores the prompt's cache from disk, without it prefills again.

    python -m bench.bench_cold_start --disk [--words 1000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvroute.core.sizes import format_bytes
from kvroute.devtools import demo_model
from kvroute.serve.capacity import weights_bytes
from tests.harness import ServeProcess, SSEStream, get_json, wait_until

# Loaded on the first request, unloaded again between rounds.
ON_DEMAND = {"preload": False, "idle_unload": "3s"}


def model(path: Path, alias: str, **settings) -> dict:
    return {"path": str(path), "alias": alias, "cache_bytes": "256MiB", "max_batch": 4, **settings}


def cold_config(path: Path) -> dict:
    return {"models": [model(path, "warm", max_prompt_tokens=2048),
                       model(path, "cold", **ON_DEMAND, max_prompt_tokens=2048)]}


def disk_config(path: Path, disk: Path) -> dict:
    return {"models": [
        model(path, "disk", **ON_DEMAND, disk_cache_bytes="2GiB", disk_cache_dir=str(disk)),
        model(path, "ram", **ON_DEMAND, disk_cache_bytes=0),
    ]}


def build_large(out: Path) -> Path:
    """A random-weight qwen3 with 8 layers of width 1024 (about 1 GB in float32)."""
    if (out / "config.json").exists():
        return out
    from kvroute.devtools import arch_models

    tokenizer = demo_model.train_tokenizer()
    config = arch_models.model_config("qwen3", tokenizer)
    config.update(hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                  num_attention_heads=16, num_key_value_heads=4, head_dim=64)
    model = arch_models.build_model(config)
    out.mkdir(parents=True, exist_ok=True)
    demo_model.write_checkpoint(out, model, config, tokenizer)
    return out


def prompt_of(words: int) -> str:
    return uuid.uuid4().hex + " " + " ".join(f"w{i % 89}" for i in range(words))


def ttft(url: str, model: str, words: int) -> float:
    return ttft_cached(url, model, prompt_of(words))[0]


def ttft_cached(url: str, model: str, prompt: str) -> tuple[float, int]:
    """Seconds to the first content chunk, and the cached prompt tokens reported."""
    t0 = time.perf_counter()
    s = SSEStream(url + "/v1/chat/completions",
                  {"model": model, "messages": [{"role": "user", "content": prompt}],
                   "max_tokens": 2, "stream_options": {"include_usage": True}}, timeout=600)
    first, cached = None, 0
    for event in s.events():
        if event == "[DONE]":
            break
        if "error" in event:
            raise RuntimeError(event)
        if first is None and event.get("choices") and event["choices"][0]["delta"].get("content") is not None:
            first = time.perf_counter() - t0
        if event.get("usage"):
            cached = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    s.close()
    return (first if first is not None else time.perf_counter() - t0), cached


def state(url: str, model: str) -> str:
    return {m["id"]: m["state"] for m in get_json(url + "/v1/models")["data"]}[model]


def start(config: dict, tmp: Path) -> ServeProcess:
    # Every run of one invocation shares `tmp`: a name of its own keeps each run's files.
    return ServeProcess(config, tmp, name=f"bench-{uuid.uuid4().hex[:6]}")


def measure(path: Path, repeat: int, words: int, tmp: Path) -> dict:
    serve = start(cold_config(path), tmp)
    url = serve.url
    try:
        serve.wait_ready(lambda: state(url, "warm") == "loaded", 600, 0.5, "the warm model")
        ttft(url, "warm", 16)  # first request of a process: compile and allocate once
        warm, cold = [], []
        for _ in range(repeat):
            wait_until(lambda: state(url, "cold") == "unloaded", 120, 0.2, "the cold model to unload")
            warm.append(ttft(url, "warm", words))
            cold.append(ttft(url, "cold", words))
        stats = {m["model"]: m for m in get_json(url + "/stats")["model_states"]}
        loads = stats["cold"]["load_seconds"] / max(1, stats["cold"]["loads"])
        return {"warm": statistics.median(warm), "cold": statistics.median(cold), "load": loads}
    finally:
        serve.stop()


def measure_disk(path: Path, repeat: int, words: int, tmp: Path) -> dict:
    serve = start(disk_config(path, tmp / "disk"), tmp)
    url = serve.url
    out: dict = {}
    try:
        serve.wait_ready(lambda: state(url, "disk") == "unloaded", 600, 0.5, "the deployment")
        for alias in ("disk", "ram"):
            first, again, cached = [], [], []
            for _ in range(repeat):
                prompt = prompt_of(words)
                first.append(ttft_cached(url, alias, prompt)[0])
                wait_until(lambda: state(url, alias) == "unloaded", 120, 0.2, f"{alias} to unload")
                t, c = ttft_cached(url, alias, prompt)
                again.append(t)
                cached.append(c)
                wait_until(lambda: state(url, alias) == "unloaded", 120, 0.2, f"{alias} to unload")
            out[alias] = {"first": statistics.median(first), "again": statistics.median(again),
                          "cached": statistics.median(cached)}
        return out
    finally:
        serve.stop()


def disk_table(args, tmp: Path) -> Table:
    path = Path(args.model) if args.model else demo_model.ensure("text")
    r = measure_disk(path, args.repeat, args.words, tmp)
    table = Table(title=f"a model reloaded on demand, with and without its disk tier "
                        f"({platform.machine()}, {os.cpu_count()} cores, {args.words} words, "
                        f"median of {args.repeat})")
    for col in ("disk tier", "first TTFT s (load + prefill)", "reloaded TTFT s",
                "cached tokens on reload", "first / reloaded"):
        table.add_column(col, justify="left" if col == "disk tier" else "right")
    for alias, label in (("disk", "on"), ("ram", "off")):
        x = r[alias]
        table.add_row(label, f"{x['first']:.3f}", f"{x['again']:.3f}", f"{x['cached']:.0f}",
                      f"{x['first'] / x['again']:.2f}x")
    return table


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_cold_start", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a local model directory (default: the demo model)")
    ap.add_argument("--large", action="store_true", help="also a larger random-weight qwen3")
    ap.add_argument("--large-only", action="store_true", help="only the larger model")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--words", type=int, default=200, help="prompt length in words")
    ap.add_argument("--disk", action="store_true", help="instead: a reloaded model with its "
                    "disk tier vs without (needs the disk tier's settings)")
    args = ap.parse_args()
    if args.disk:
        Console().print(disk_table(args, Path(tempfile.mkdtemp(prefix="kvroute-bench-disk-"))))
        return 0
    models = [] if args.large_only else [
        ("demo model", Path(args.model) if args.model else demo_model.ensure("text"))]
    tmp = Path(tempfile.mkdtemp(prefix="kvroute-bench-cold-"))
    if args.large or args.large_only:
        models.append(("random qwen3 8x1024", build_large(demo_model.default_cache_dir()
                                                          / "bench-qwen3-large")))
    table = Table(title=f"cold model vs loaded model TTFT ({platform.machine()}, "
                        f"{os.cpu_count()} cores, {args.words} words, median of {args.repeat})")
    for col in ("model", "weights", "loaded TTFT s", "cold TTFT s", "cold / loaded",
                "load s (serve)"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for name, path in models:
        r = measure(path, args.repeat, args.words, tmp)
        table.add_row(name, format_bytes(weights_bytes(str(path)) or 0), f"{r['warm']:.3f}",
                      f"{r['cold']:.3f}", f"{r['cold'] / r['warm']:.1f}x", f"{r['load']:.2f}")
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Cold vs cached time to first token of an image conversation, with one and with four
images.

Starts a real backend serving a vision-language model (by default the small
random-weight Gemma 3 VLM of kvroute/devtools/vision_models.py: 224x224 images, a
4-layer encoder, 64 tokens an image), then for each image count sends a never-seen
conversation (cold: encoder and prefill), the same request again (cached: all but its
last token), turn 2 of the conversation (cached turn 1, images included, plus the
reply and a question) and turn 1 with its last image changed (cached up to that image:
the encoder and the prefill from there run). Client-side time to the first streamed
token, medians over --repeat runs; `encoder runs` counts the images the backend
encoded for the row (GET /health).

    python -m bench.bench_vision [--model PATH] [--images 1,4] [--repeat 3]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
from PIL import Image
from rich.console import Console
from rich.table import Table

from bench.command import command_line, machine
from kvroute.devtools import vision_models
from tests.harness import BackendProcess, SSEStream, get_json

SYSTEM = ("You read screenshots for an operations team: name the application, quote any "
          "error message exactly, and say what the user should try next. ") * 4


def image_url(rng: np.random.Generator, side: int) -> str:
    pixels = rng.integers(0, 255, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def turn1(urls: list[str]) -> list[dict]:
    return [{"role": "system", "content": f"{uuid.uuid4().hex[:8]} {SYSTEM}"},
            {"role": "user", "content": [
                {"type": "text", "text": "What do these screenshots show?"},
                *({"type": "image_url", "image_url": {"url": u}} for u in urls)]}]


def ttft(backend: BackendProcess, messages: list[dict]) -> tuple[float, str, dict]:
    """Seconds to the first streamed token, the reply, the usage."""
    t0 = time.perf_counter()
    stream = SSEStream(backend.url + "/v1/chat/completions",
                       {"model": backend.model_id, "messages": messages, "max_tokens": 4,
                        "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}})
    first, text, usage = None, [], {}
    for event in stream.events():
        if event == "[DONE]":
            break
        if event["choices"]:
            first = first or time.perf_counter() - t0
            text.append(event["choices"][0]["delta"].get("content") or "")
        if event.get("usage"):
            usage = event["usage"]
    stream.close()
    return first, "".join(text), usage


def encoded(backend: BackendProcess) -> int:
    return get_json(backend.url + "/health")["vision"]["encoded"]


def measure(backend: BackendProcess, n_images: int, repeat: int, side: int) -> dict:
    rng = np.random.default_rng()  # images no earlier request had
    rows: dict[str, list[float]] = {"cold": [], "repeat": [], "turn2": [], "changed": []}
    runs: dict[str, int] = dict.fromkeys(rows, 0)
    cached: dict[str, int] = {}
    prompt: dict[str, int] = {}
    for _ in range(repeat):
        messages = turn1([image_url(rng, side) for _ in range(n_images)])
        changed = [messages[0], {**messages[1], "content": [
            *messages[1]["content"][:-1],
            {"type": "image_url", "image_url": {"url": image_url(rng, side)}}]}]
        steps = {"cold": messages, "repeat": messages, "turn2": None, "changed": changed}
        reply = ""
        for name, msgs in steps.items():
            if name == "turn2":
                msgs = messages + [{"role": "assistant", "content": reply},
                                   {"role": "user", "content": "Which one shows the error?"}]
            before = encoded(backend)
            seconds, text, usage = ttft(backend, msgs)
            runs[name] += encoded(backend) - before
            reply = reply or text
            rows[name].append(seconds)
            cached[name] = usage["prompt_tokens_details"]["cached_tokens"]
            prompt[name] = usage["prompt_tokens"]
    return {name: {"ttft": statistics.median(v), "cached": cached[name], "prompt": prompt[name],
                   "encoded": runs[name] / repeat} for name, v in rows.items()}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_vision",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a VLM's path (default: the small random-weight Gemma 3)")
    ap.add_argument("--images", default="1,4")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--backend-args", default="", help="more `kvroute backend` flags")
    args = ap.parse_args()
    table = Table(title=f"Image conversations: TTFT (median of {args.repeat}, client side)")
    for col in ("images", "request", "prompt tokens", "cached tokens", "encoder runs",
                "TTFT (ms)", "cold / this"):
        table.add_column(col, justify="right")
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else vision_models.ensure(
            "gemma3", cache_dir=Path(tmp) / "models", size="small")
        side = int(json.loads((model / "config.json").read_text())["vision_config"]["image_size"])
        backend = BackendProcess(model, model_id="bench-vlm", log_dir=Path(tmp),
                                 extra=["--cache-bytes", "4GiB", *args.backend_args.split()])
        backend.start(timeout=600)
        try:
            measure(backend, 1, 1, side)  # warm-up: the encoder's shapes
            for n in (int(x) for x in args.images.split(",")):
                r = measure(backend, n, args.repeat, side)
                cold = r["cold"]["ttft"]
                for name, row in r.items():
                    table.add_row(str(n), name, str(row["prompt"]), str(row["cached"]),
                                  f"{row['encoded']:g}", f"{row['ttft'] * 1000:.1f}",
                                  f"{cold / row['ttft']:.1f}x")
        finally:
            backend.stop()
    console = Console(width=160)
    console.print(f"command: {command_line()}")
    console.print(machine())
    console.print(table)


if __name__ == "__main__":
    main()

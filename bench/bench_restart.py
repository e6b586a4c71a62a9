"""Where a cache hit's time goes around the disk tier, request by request: a turn 2 with
the tier's writes running beside it and after they settled, and conversations restored
from disk after a restart of the whole stack (the first request a backend serves after
it, and one after cold traffic), beside cold prompts of their length before and after.

`bench_hw` reports the medians; this prints each request of such a sequence with the
backend that served it and where its time went there, from the backends' metrics:
the time before its engine (body, template, tokens, the disk tier's lookup and read),
of that the disk read, its wait in the engine's queue, the engine's time to the first
token, and the disk writers' activity while it ran.

    python -m bench.models /tmp/m7b
    python -m bench.bench_restart --model /tmp/m7b                       # GPU
    python -m bench.bench_restart --model /tmp/mcpu --size 1500 --turn2 2500 \\
        --cache-bytes 2GiB                                                 # CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shutil
import time
from pathlib import Path

import aiohttp

from bench.bench_hw import TOKEN, Stack, Tokenizer, conversation, fresh, get, settle_disk
from bench.command import command_line
from tests.harness import metric_sum

# Backend metric sums read before and after each request (name, labels).
SUMS = {
    "ttft": ("kvroute_backend_ttft_seconds_sum", {}),
    "prepare": ("kvroute_backend_prepare_seconds_sum", {}),
    "queue": ("kvroute_backend_queue_seconds_sum", {}),
    "restore": ("kvroute_backend_disk_restore_seconds_sum", {}),
    "restored": ("kvroute_backend_disk_restore_seconds_count", {}),
    "written": ("kvroute_backend_disk_writes_total", {"result": "ok"}),
    "paced": ("kvroute_backend_disk_write_paced_seconds_total", {}),
}


def sums(stack: Stack) -> dict[str, float]:
    out = {k: 0.0 for k in SUMS}
    out["queued"] = out["hot"] = 0.0
    for b in stack.backends():
        text = get(b + "/metrics", {"x-kvroute-token": TOKEN}).decode()
        for key, (name, labels) in SUMS.items():
            out[key] += metric_sum(text, name, **labels)
        out["queued"] += metric_sum(text, "kvroute_backend_disk_write_queue")
        health = json.loads(get(b + "/health", {"x-kvroute-token": TOKEN}))
        out["hot"] += (health.get("cache") or {}).get("hot_hits", 0)
    return out


async def _chat(url: str, messages: list[dict], max_tokens: int) -> tuple[float, dict, str, str]:
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    usage: dict = {}
    text: list[str] = []
    first = None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as s:
        t0 = time.perf_counter()
        async with s.post(url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{resp.status} {(await resp.text())[:300]}")
            backend = resp.headers.get("x-kvroute-backend", "?")
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                usage = event.get("usage") or usage
                for choice in event.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        first = first or time.perf_counter()
                        text.append(piece)
    if first is None:
        raise RuntimeError("no tokens")
    return first - t0, usage, "".join(text), backend


class Log:
    def __init__(self, stack: Stack):
        self.stack, self.rows = stack, []

    def chat(self, what: str, messages: list[dict], max_tokens: int = 1) -> str:
        before = sums(self.stack)
        t, usage, text, backend = asyncio.run(_chat(self.stack.url, messages, max_tokens))
        after = sums(self.stack)
        d = {k: after[k] - before[k] for k in [*SUMS, "hot"]}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        self.rows.append({
            "what": what, "ttft": t, "backend": backend, "prompt": usage.get("prompt_tokens"),
            "cached": cached, "backend_ttft": d["ttft"], "prepare": d["prepare"],
            "restore": d["restore"] if d["restored"] else None, "queue": d["queue"],
            "engine": d["ttft"] - d["prepare"] - d["queue"], "writes_queued": before["queued"],
            "written": d["written"], "paced": d["paced"], "hot": d["hot"]})
        print(json.dumps(self.rows[-1]), flush=True)
        return text


def sequence(args, tok, stack: Stack, log: Log) -> None:
    size, part = args.size, 8
    convs = {k: conversation(tok, fresh(size, i, part), 700 + i) for i, k in enumerate("AB")}
    replies = {k: log.chat(f"{k} turn 1 (cold, {size})", m) for k, (m, _) in convs.items()}
    for r in range(2):
        log.chat(f"cold {size} before the restart", conversation(tok, fresh(size, 2 + r, part),
                                                                 720 + r)[0])
    for label, settle in (("writes beside it", False), ("after writes settled", True)):
        turn2_probe(args, tok, log, f"T turn 2, {label}", 1 + settle,
                    lambda: settle_disk(stack) if settle else None)
    settle_disk(stack)
    stack.stop()
    print(f"restarted, ready in {stack.start():.1f}s", flush=True)

    def turn2(k: str) -> list[dict]:
        messages, follow = convs[k]
        return messages + [{"role": "assistant", "content": replies[k]},
                           {"role": "user", "content": follow}]
    log.chat("A turn 2 after the restart (first request)", turn2("A"))
    for r in range(3):
        log.chat(f"cold {size} after the restart", conversation(tok, fresh(size, 4 + r, part),
                                                                760 + r)[0])
    log.chat("B turn 2 after the restart (after cold traffic)", turn2("B"))


def turn2_probe(args, tok, log: Log, label: str, seed: int, between=None) -> None:
    messages, follow = conversation(tok, fresh(args.turn2, seed, 8), 740 + seed)
    reply = log.chat(f"turn 1 (cold, {args.turn2})", messages)
    if between:
        between()
    log.chat(label, messages + [{"role": "assistant", "content": reply},
                                {"role": "user", "content": follow}])


def baseline(args, tok, logs: Path, rows: list[dict]) -> None:
    """Turn 2 on a stack with the disk tier off: what the tier's turn 2s compare with."""
    stack = Stack(args, logs, "restart-no-disk", "")
    log = Log(stack)
    try:
        print(f"tier off: ready in {stack.start():.1f}s", flush=True)
        for r in range(2):
            turn2_probe(args, tok, log, "T turn 2, disk tier off", 3 + r)
    finally:
        stack.stop()
        rows.extend(log.rows)


def table(rows: list[dict]) -> str:
    def ms(v) -> str:
        return "-" if v is None else f"{v * 1000:.0f}"
    out = ["| request | backend | prompt / cached | TTFT ms | backend ms | before engine ms "
           "| of it disk read ms | queue ms | engine ms | hot copy | writes queued / done / paced s |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        out.append(f"| {r['what']} | {r['backend']} | {r['prompt']} / {r['cached']} "
                   f"| {ms(r['ttft'])} | {ms(r['backend_ttft'])} | {ms(r['prepare'])} "
                   f"| {ms(r['restore'])} | {ms(r['queue'])} | {ms(r['engine'])} | {r['hot']:.0f} "
                   f"| {r['writes_queued']:.0f} / {r['written']:.0f} / {r['paced']:.2f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--size", type=int, default=8000, help="restored conversation (tokens)")
    ap.add_argument("--turn2", type=int, default=31300, help="turn 1 before the turn-2 probe")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--cache-bytes", default="16GiB")
    ap.add_argument("--logs", default="/tmp/kvroute-bench-restart")
    ap.add_argument("--skip-baseline", action="store_true", help="no tier-off stack first")
    ap.add_argument("--out", help="also write the report (markdown) here")
    args = ap.parse_args()
    # Stack's config knobs this bench leaves at kvroute's defaults.
    args.max_batch = args.max_prompt_tokens = args.prefill_step = 0
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    disk = logs / "disk-tier"
    shutil.rmtree(disk, ignore_errors=True)
    stack = Stack(args, logs, "restart", str(disk))
    log = Log(stack)
    t0 = time.perf_counter()
    tok = Tokenizer(args.model)
    try:
        if not args.skip_baseline:
            baseline(args, tok, logs, log.rows)
        print(f"ready in {stack.start():.1f}s", flush=True)
        sequence(args, tok, stack, log)
    finally:
        stack.stop()
        shutil.rmtree(disk, ignore_errors=True)
    text = (f"command: {command_line()}\nmachine: {platform.machine()} {platform.system()}, "
            f"python {platform.python_version()}; {time.strftime('%Y-%m-%d %H:%M')}; "
            f"{time.perf_counter() - t0:.0f}s\n\n{table(log.rows)}")
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()

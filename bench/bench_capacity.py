"""Capacity under rising load: cache-aware routing against round-robin and least-loaded,
with 1, 2 and 4 proxies in front of the same backends.

Modelled on llm-d's prefix-cache benchmark, scaled to a small machine: G groups, each
with a long shared system prompt; U users per group; each user holds a conversation of
T turns (every turn resends the whole conversation so far). Conversations arrive as a
Poisson process at each rate in turn; within a conversation the turns follow one
another. Every request goes to a proxy picked at random (a load balancer in front of
several proxy replicas). Content carries a fresh nonce per step, so no step starts
with another step's cache.

Per policy, proxy count and rate it reports output tokens/s, TTFT p50/p90 (to the
first streamed content), the share of requests shed with 429, and the token hit ratio
(cached / prompt tokens, from each answer's usage).

    python -m bench.bench_capacity [--rates 0.25,0.5,1] [--proxies 1,2,4]
        [--policies cache-aware,round-robin,least-loaded] [--groups 3] [--users 4] [--turns 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson
from rich.console import Console
from rich.table import Table

from kvroute.devtools import demo_model
from kvroute.serve.redis_server import RedisServer
from tests.harness import ROOT, BackendProcess, free_port, request, wait_until

SECRET = "capacity"
MODEL = "demo"
TOPICS = ["the harbour", "the orchard", "the library", "the workshop", "the station", "the market"]


@dataclass
class Step:
    policy: str
    proxies: int
    rate: float
    ttft: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    requests: int = 0
    shed: int = 0
    errors: int = 0
    seconds: float = 0.0

    def row(self) -> list[str]:
        pct = lambda q: statistics.quantiles(self.ttft, n=10)[q] if len(self.ttft) > 1 else 0  # noqa: E731
        return [self.policy, str(self.proxies), f"{self.rate:g}",
                f"{self.output_tokens / self.seconds:.1f}" if self.seconds else "-",
                f"{statistics.median(self.ttft) * 1000:.0f}" if self.ttft else "-",
                f"{pct(8) * 1000:.0f}" if self.ttft else "-",
                f"{self.shed / max(1, self.requests):.1%}",
                f"{self.cached_tokens / max(1, self.prompt_tokens):.3f}",
                str(self.errors)]


HEADERS = ["policy", "proxies", "conv/s", "output tok/s", "TTFT p50 ms", "TTFT p90 ms",
           "429 shed", "hit ratio", "errors"]


def system_prompt(group: int, nonce: str, chars: int) -> str:
    text = (f"[{nonce}] You are the assistant of team {group}. Their handbook follows. "
            + " ".join(f"Rule {i}: keep {TOPICS[(group + i) % len(TOPICS)]} tidy and note "
                       f"every change in the log book before the end of the day." for i in range(400)))
    return text[:chars]


async def stream(session: aiohttp.ClientSession, url: str, body: dict, step: Step) -> str | None:
    """One streamed turn; returns the reply text (None when shed or failed)."""
    t0 = time.perf_counter()
    first = None
    text = []
    step.requests += 1
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            if resp.status == 429:
                step.shed += 1
                return None
            if resp.status != 200:
                step.errors += 1
                return None
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = orjson.loads(line[6:])
                for choice in chunk.get("choices") or []:
                    delta = (choice.get("delta") or {}).get("content")
                    if delta:
                        if first is None:
                            first = time.perf_counter() - t0
                        text.append(delta)
                usage = chunk.get("usage")
                if usage:
                    step.output_tokens += usage["completion_tokens"]
                    step.prompt_tokens += usage["prompt_tokens"]
                    step.cached_tokens += (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens", 0)
    except (aiohttp.ClientError, asyncio.TimeoutError):
        step.errors += 1
        return None
    if first is not None:
        step.ttft.append(first)
    return "".join(text)


async def conversation(session, urls: list[str], system: str, user: int, turns: int,
                       max_tokens: int, step: Step, rng: random.Random) -> None:
    messages = [{"role": "system", "content": system}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"User {user}, question {turn}: what should "
                         f"we do about {TOPICS[(user + turn) % len(TOPICS)]} this week?"})
        reply = await stream(session, rng.choice(urls), {
            "model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}, step)
        if reply is None:
            return
        messages.append({"role": "assistant", "content": reply})


async def run_step(urls: list[str], step: Step, args, seed: int) -> None:
    rng = random.Random(seed)
    nonce = f"{step.policy}-{step.proxies}-{step.rate}-{seed}"
    pool = [(g, u) for g in range(args.groups) for u in range(args.users)]
    rng.shuffle(pool)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        tasks = []
        t0 = time.perf_counter()
        for g, u in pool:
            system = system_prompt(g, nonce, args.system_chars)
            tasks.append(asyncio.create_task(conversation(
                session, urls, system, g * args.users + u, args.turns, args.max_tokens, step, rng)))
            await asyncio.sleep(rng.expovariate(step.rate))
        await asyncio.gather(*tasks)
        step.seconds = time.perf_counter() - t0


class Fleet:
    def __init__(self, workdir: Path, args):
        self.workdir = workdir
        self.args = args
        self.redis = RedisServer()
        self.backends: list[BackendProcess] = []
        self.proxies: list[subprocess.Popen] = []

    def start_backends(self) -> None:
        self.redis.start()
        model = demo_model.ensure("text", cache_dir=self.workdir / "models")
        for i in range(self.args.backends):
            b = BackendProcess(model, MODEL, self.workdir, backend_id=f"cap-{i}", extra=[
                "--redis-url", self.redis.url, "--secret", SECRET, "--cache-bytes", "1GiB",
                "--max-batch", str(self.args.max_batch), "--max-queue", str(self.args.max_queue),
                "--prefill-step", "256", "--log-level", "warning"])
            b.start(timeout=180)
            self.backends.append(b)

    def start_proxies(self, n: int, policy: str) -> list[str]:
        self.stop_proxies()
        urls = []
        for i in range(n):
            port = free_port()
            log = open(self.workdir / f"proxy-{policy}-{n}-{i}.log", "wb")
            self.proxies.append(subprocess.Popen(
                [sys.executable, "-m", "kvroute.cli", "proxy", "--redis-url", self.redis.url,
                 "--port", str(port), "--secret", SECRET, "--policy", policy, "--log-level",
                 "warning"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
            url = f"http://127.0.0.1:{port}"
            wait_until(lambda: self._ready(url), 60, interval=0.1, what=f"proxy {url}")
            urls.append(url)
        return urls

    def _ready(self, url: str) -> bool:
        status, _, data = request(url + "/health", timeout=2)
        return status == 200 and len(orjson.loads(data)["backends"]) == len(self.backends)

    def stop_proxies(self) -> None:
        for p in self.proxies:
            p.terminate()
            p.wait(15)
        self.proxies = []

    def stop(self) -> None:
        self.stop_proxies()
        for b in self.backends:
            b.stop()
        self.redis.close()


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_capacity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="0.25,0.5,1", help="conversations started per second")
    ap.add_argument("--proxies", default="1,2,4")
    ap.add_argument("--policies", default="cache-aware,round-robin,least-loaded")
    ap.add_argument("--backends", type=int, default=2)
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--users", type=int, default=4, help="users (conversations) per group")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-chars", type=int, default=3000, help="shared system prompt length")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-queue", type=int, default=16)
    args = ap.parse_args()
    console = Console()
    steps: list[Step] = []
    with tempfile.TemporaryDirectory(prefix="kvroute-capacity-") as tmp:
        fleet = Fleet(Path(tmp), args)
        try:
            fleet.start_backends()
            # Proxy count outermost and policies next: the runs compared with each other
            # are close in time on a shared machine.
            for n in [int(x) for x in args.proxies.split(",")]:
                for policy in args.policies.split(","):
                    urls = fleet.start_proxies(n, policy)
                    for i, rate in enumerate(float(x) for x in args.rates.split(",")):
                        step = Step(policy, n, rate)
                        asyncio.run(run_step(urls, step, args, seed=i))
                        steps.append(step)
                        console.print(" | ".join(step.row()))
        finally:
            fleet.stop()
    table = Table(title=f"capacity: {args.backends} backends, {args.groups} groups x {args.users} "
                        f"users x {args.turns} turns ({platform.machine()}, {os.cpu_count()} cores)")
    for h in HEADERS:
        table.add_column(h)
    for s in steps:
        table.add_row(*s.row())
    console.print(table)
    print("| " + " | ".join(HEADERS) + " |")
    print("|" + "---|" * len(HEADERS))
    for s in steps:
        print("| " + " | ".join(s.row()) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

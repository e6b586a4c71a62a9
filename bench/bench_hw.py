"""kvroute at the speed of the hardware, measured from outside: `kvroute serve` against raw
mlx-lm and mlx-lm's own server, in one run on one machine and model.

Parts (each a fresh set of processes, one after the other; `--parts` picks them):

- raw: mlx-lm `generate_step`, one sequence, in a child process, warmed up the way a
  kvroute backend is (kernels, then one prompt as long as the longest measured):
  cold time to first token at each size, the second turn on a cached prompt (the new
  suffix's prefill plus one step), single-stream decode; and mlx-lm's `BatchGenerator`
  decoding 8 and 32 prompts together with no server around it: the ceiling a server's
  batched decode measures against (whether a target "x times mlx-lm's server" is
  reachable at all on that machine, and how near kvroute's one backend comes to it).
- mlx-server: `python -m mlx_lm server`, warmed up: cold TTFT, turn 2, decode at 1, 8
  and 32 streams.
- kvroute: `kvroute serve --config` (an embedded Redis, --replicas backends capped to
  share the device, the proxy) with its disk tier on; a streaming client through the
  proxy: the first request after ready against the tenth, cold TTFT, turn 2, decode at
  1/8/32 streams (through the proxy, spread over the replicas, and on one backend as
  mlx-lm's server batches them in one process), the agent workload (8 agents x 4 turns,
  shared system prompts); then a conversation restored from disk after a restart of the
  whole stack against the cold prefill of a prompt of its size. The report ends with
  each backend's memory after each phase (MLX's active, cache, peak and cap, the card's
  free bytes, the prompt cache and the disk writers' queue), from its /health.
- no-disk: the same stack with the disk tier off and the same requests but the
  restore (the first ten, cold TTFT at each size, turn 2, decode at 1/8/32 streams, the
  agent workload), for the disk tier's cost on each.
- defaults: plain `kvroute serve --model M --replicas N` (no config: every default,
  its disk tier under a temporary cache folder): whether it starts, how long until the
  model answers, its memory check and disk budget lines, one answer, the exit code.
- paired: decode at 1, 8 and 32 streams with raw mlx-lm (a child process serving
  decodes on request), mlx-lm's server and kvroute (one replica, through the proxy and
  its backend alone) loaded on the device at once, each capped, their samples taken in
  turns (the order rotating each round, the same fresh prompts for each in a round):
  a GPU's speed drifted by a fifth within minutes on the same work, so parts measured
  one after the other compare samples taken at different speeds; the ratios within
  each round do not. A 7B model's three fit an 80 GB card. The raw child also decodes
  into kvroute's working caches (its generator with no engine, HTTP or proxy around
  it): how near the whole stack comes to its own building blocks. On Linux it also
  reports the CPU each kvroute sample took per generated token (the backend, its event
  loop, the proxy) and each one's share of a core: whether a many-stream decode waits
  on a loop that has a core to itself.
- tier: the disk tier's cost, paired: two stacks of one replica each, the tier on and
  off, loaded at once, their samples taken in turns with the same fresh prompts (a
  turn 2, the agents' turns 2-4, 1- and 8-stream decodes); the tier-on stack's writes
  finish before every sample, so neither stack's sample runs beside them. Three to
  eight samples a part, parts minutes apart, put the tier's cost anywhere from 0.74x
  to 1.36x on the same code: 5% needs this. The kvroute and no-disk parts measure it
  with a backlog of writes beside the work.

Every prompt is a length no process has seen (sizes shift by a few tokens per repeat and
per part): what a user's prompts are, and what a warmed-up server has not compiled yet.
Prompts are random words of the model's tokenizer; a random-weight model never stops.

    python -m bench.models /tmp/m7b                        # a 7B-class random model (GPU)
    python -m bench.bench_hw --model /tmp/m7b --out BENCH.md
    python -m bench.bench_hw --model /tmp/m7b --cache-bytes 4GiB    # an 80 GB card: two
        # replicas pass serve's memory check there with 4 GiB caches (not 16, nor 6)
    python -m bench.models /tmp/mcpu --preset cpu          # CPU: a smaller one
    python -m bench.bench_hw --model /tmp/mcpu --sizes 900,1900,3900 --turn2 3900 \\
        --restore 2000 --decode 48 --agent-system 600 --cache-bytes 2GiB

Parts save their numbers under --results (JSON), so a run can be split over several
calls (`--parts raw,mlx-server` then `--parts kvroute,no-disk`); the report uses every
part found there. `--profile DIR` samples each kvroute backend's threads with py-spy
while the turns 2, the decodes and the agents run, two collapsed-stack files per
backend and part (every thread, idle ones too; the GIL's holder): where the engine
thread's time goes beside the disk writers, against the tier-off part
(`python -m bench.profile_summary DIR` sums them up by thread).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Callable

import aiohttp

from bench.command import command_line
from kvroute.core.accel import exit_skipping_teardown
from kvroute.core.sizes import format_bytes
from kvroute.serve.redis_server import free_port
from tests.harness import metric_sum

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("raw", "mlx-server", "kvroute", "no-disk", "defaults", "paired", "tier")
TOKEN = "bench-hw-token"


# -- prompts ---------------------------------------------------------------------------


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    syll = ["ka", "lo", "mi", "ren", "to", "sa", "vel", "nor", "qu", "di", "pa", "zu"]
    return " ".join("".join(rng.choice(syll) for _ in range(rng.randint(1, 3))) for _ in range(n))


def text_of(tokenizer, n_tokens: int, seed: int) -> str:
    """About n_tokens tokens of never-seen text (seed makes it unique)."""
    text = f"[{seed}] " + words(seed, n_tokens)
    ids = tokenizer.encode(text)
    while len(ids) < n_tokens:
        text += " " + words(seed + len(ids), n_tokens)
        ids = tokenizer.encode(text)
    return tokenizer.decode(ids[:n_tokens])


def fresh(size: int, repeat: int, part: int) -> int:
    """A length near `size` that no other measurement of the run uses."""
    return size - 97 * repeat - 13 * part - 7


class Tokenizer:
    def __init__(self, model: str):
        from tokenizers import Tokenizer as T

        self.tok = T.from_file(str(Path(model) / "tokenizer.json"))

    def encode(self, s: str) -> list[int]:
        return self.tok.encode(s, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


def conversation(tok, size: int, seed: int) -> tuple[list[dict], str]:
    """Turn 1's messages (one user message of ~size tokens) and turn 2's new message."""
    return [{"role": "user", "content": text_of(tok, size, seed)}], text_of(tok, 60, seed + 1)


# -- raw mlx-lm ----------------------------------------------------------------------------


def raw_main(args) -> None:
    """In a child process: raw generate_step numbers, one JSON line on stdout."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = load(args.model)
    tok = Tokenizer(args.model)
    step = args.raw_prefill_step

    def first_token(ids: list[int], cache=None) -> float:
        t0 = time.perf_counter()
        gen = generate_step(mx.array(ids), model, max_tokens=1, prompt_cache=cache,
                            prefill_step_size=step)
        next(gen)
        return time.perf_counter() - t0

    def template(messages: list[dict]) -> list[int]:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    # Warm up as a kvroute backend does: kernels, then one prompt as long as the longest.
    first_token(tok.encode(text_of(tok, 300, 1)))
    first_token(tok.encode(text_of(tok, max(args.sizes + [args.turn2]) + 200, 2)))
    mx.clear_cache()
    out: dict = {"cold": {}}
    for size in args.sizes:
        times = [first_token(tok.encode(text_of(tok, fresh(size, r, 0), 100 + size + r)))
                 for r in range(args.repeat)]
        out["cold"][size] = statistics.median(times)
        mx.clear_cache()
    times = []
    for r in range(args.turn2_repeat):
        messages, follow = conversation(tok, fresh(args.turn2, r, 0), 70 + r)
        a = template(messages)
        cache = make_prompt_cache(model)
        first_token(a, cache)  # the cache now holds turn 1's prompt
        b = template(messages + [{"role": "assistant", "content": "ok"},
                                 {"role": "user", "content": follow}])
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        for c in cache:
            c.trim(c.offset - common)
        times.append(first_token(b[common:], cache))
        del cache
        mx.clear_cache()
    out["turn2"] = statistics.median(times)
    out["decode1"] = single_decode(model, tok, args.decode, 9)
    warm_batches(model, tokenizer, tok, step)
    for n in (8, 32):
        out[f"decode{n}"] = statistics.median(
            batch_decode(model, tokenizer, tok, n, args.decode, step, 500 + 10_000 * r + 100 * n)
            for r in range(args.decode_repeat))
    print("RAW " + json.dumps(out), flush=True)


def single_decode(model, tok, n: int, seed: int, fast: bool = False) -> float:
    """mlx-lm's `generate_step` decoding `n` tokens after a 64-token prompt: tokens/s
    from the first token to the last; `fast`: into kvroute's working cache."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from kvroute.backend.attention import new_cache

    cache = new_cache(model) if fast else None
    gen = generate_step(mx.array(tok.encode(text_of(tok, 64, seed))), model, max_tokens=n,
                        prompt_cache=cache)
    stamps = [time.perf_counter() for _ in gen]
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def raw_serve(args) -> None:
    """In a child process beside the servers (the paired part): raw decodes on request,
    one line in (`STREAMS TOKENS SEED [fast]`), one rate out (`RATE x`), so that each raw
    sample is taken between the servers' own, on the card as it is then. `fast`: the
    same decode into kvroute's working caches (`attention.new_cache`), the generator its
    engine drives with nothing around it."""
    import mlx.core as mx
    from mlx_lm import load

    mx.set_memory_limit(args.raw_memory_limit)
    mx.set_cache_limit(1 << 30)
    model, tokenizer = load(args.model)
    tok = Tokenizer(args.model)
    for fast in (False, True):
        single_decode(model, tok, 16, 9, fast)
        warm_batches(model, tokenizer, tok, args.raw_prefill_step, fast)
    print("READY", flush=True)
    for line in sys.stdin:
        streams, n, seed, *mode = line.split()
        streams, n, seed, fast = int(streams), int(n), int(seed), mode == ["fast"]
        rate = (single_decode(model, tok, n, seed, fast) if streams == 1 else
                batch_decode(model, tokenizer, tok, streams, n, args.raw_prefill_step, seed, fast))
        print(f"RATE {rate}", flush=True)


def warm_batches(model, tokenizer, tok, step: int, fast: bool = False) -> None:
    """Each batch size raw decodes at (8, 32) once, as the servers are warmed up: the
    first batch of a size pays for its kernels' shapes."""
    for n in (8, 32):
        batch_decode(model, tokenizer, tok, n, 8, step, 400, fast)


def batch_decode(model, tokenizer, tok, streams: int, n: int, step: int, seed: int,
                 fast: bool = False) -> float:
    """mlx-lm's own continuous batching, no server: `streams` prompts of 64 tokens (as
    the servers get) decode `n` tokens each together; tokens/s from the first token of
    any to the last of all, as `decode_rate` counts through HTTP. What batched decode
    costs on this machine with nothing around it: the ceiling a server's 8 streams
    measure against. `fast`: into kvroute's working caches, as its engine decodes."""
    from mlx_lm.generate import BatchGenerator

    from kvroute.backend.attention import new_cache

    # Prompts prefill 8 at a time, as a kvroute backend batches them.
    gen = BatchGenerator(model, stop_tokens=[[t] for t in tokenizer.eos_token_ids],
                         completion_batch_size=max(streams, 32), prefill_batch_size=8,
                         prefill_step_size=step)
    gen.insert([tok.encode(text_of(tok, 64, seed + i)) for i in range(streams)], [n] * streams,
               caches=[new_cache(model) for _ in range(streams)] if fast else None)
    stamps, tokens = [], 0
    while responses := gen.next_generated():
        stamps.append(time.perf_counter())
        tokens += len(responses)
    gen.close()
    if tokens <= streams:
        raise RuntimeError(f"raw batched decode of {streams} streams: one token each at most")
    return (tokens - streams) / (stamps[-1] - stamps[0])  # each stream's first token starts it


def run_raw(args, tok, logs: Path) -> dict:
    cmd = [sys.executable, "-m", "bench.bench_hw", "--raw-child", "--model", args.model,
           "--sizes", ",".join(map(str, args.sizes)), "--turn2", str(args.turn2),
           "--repeat", str(args.repeat), "--turn2-repeat", str(args.turn2_repeat),
           "--decode", str(args.decode), "--decode-repeat", str(args.decode_repeat),
           "--raw-prefill-step", str(args.raw_prefill_step)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RAW ")]
    if proc.returncode or not line:
        raise RuntimeError(f"raw mlx-lm run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(line[-1][4:])


# -- HTTP measurements -----------------------------------------------------------------


def http_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800))


async def stream(session: aiohttp.ClientSession, url: str, path: str, body: dict,
                 headers: dict | None = None, route: dict | None = None
                 ) -> tuple[float, list[float], dict, str]:
    """(time to first token, token arrival times, usage, text) of one streamed request;
    `route`, when given, gets the backend and the reason kvroute's proxy chose it."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps: list[float] = []
    usage: dict = {}
    text: list[str] = []
    async with session.post(url + path, json=body, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}{path}: {resp.status} {(await resp.text())[:300]}")
        if route is not None:
            route.update(backend=resp.headers.get("x-kvroute-backend", ""),
                         reason=resp.headers.get("x-kvroute-route-reason", ""))
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("error"):  # a stream cut short is a failure, not a shorter reply
                raise RuntimeError(f"{url}{path}: error event: {str(event['error'])[:300]}")
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or []:
                piece = choice.get("text") or (choice.get("delta") or {}).get("content")
                if piece:
                    stamps.append(time.perf_counter())
                    text.append(piece)
    if not stamps:
        raise RuntimeError(f"{url}{path}: no tokens")
    return stamps[0] - t0, stamps, usage, "".join(text)


def cached_tokens(usage: dict) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


async def decode_rate(url: str, model: str, tok, streams: int, n: int, seed: int,
                      headers: dict | None = None) -> float:
    """Aggregate generated tokens/s of `streams` concurrent requests, from the first token
    of any to the last of all (prefill excluded)."""
    async with http_session() as s:
        results = await asyncio.gather(*(
            stream(s, url, "/v1/completions",
                   {"model": model, "prompt": text_of(tok, 64, seed + i), "max_tokens": n,
                    "temperature": 0}, headers)
            for i in range(streams)))
    return aggregate_rate(results)


def aggregate_rate(results: list[tuple[float, list[float], dict, str]]) -> float:
    """Generated tokens/s of streams (`stream`'s answers) that ran together, from the
    first token of any to the last of all: each stream's first token starts it."""
    first = min(r[1][0] for r in results)
    last = max(r[1][-1] for r in results)
    # Tokens, not events: a server may send several tokens in one event.
    return sum(r[2].get("completion_tokens", len(r[1])) - 1 for r in results) / (last - first)


def decode_median(url: str, model: str, tok, streams: int, n: int, seed: int, repeat: int,
                  headers: dict | None = None) -> float:
    """`decode_rate`'s median over `repeat` runs of several streams, each with prompts of
    its own (one run of 8 streams moved 1.18x-1.56x of mlx-lm's server between two
    machines); a single stream runs once."""
    runs = repeat if streams > 1 else 1
    return statistics.median(run(decode_rate(url, model, tok, streams, n, seed + 10_000 * r,
                                             headers)) for r in range(runs))


async def completion_ttft(url: str, model: str, prompt: str) -> float:
    async with http_session() as s:
        t, _, _, _ = await stream(s, url, "/v1/completions",
                                  {"model": model, "prompt": prompt, "max_tokens": 2,
                                   "temperature": 0})
    return t


async def chat(url: str, model: str, messages: list[dict], max_tokens: int
               ) -> tuple[float, dict, str]:
    async with http_session() as s:
        t, _, usage, text = await stream(s, url, "/v1/chat/completions",
                                         {"model": model, "messages": messages,
                                          "max_tokens": max_tokens, "temperature": 0})
    return t, usage, text


def run(coro):
    return asyncio.run(coro)


def cold_ttfts(url: str, model: str, tok, sizes: list[int], repeat: int, part: int) -> dict:
    return {size: statistics.median(
        run(completion_ttft(url, model, text_of(tok, fresh(size, r, part), 100 + size + r)))
        for r in range(repeat)) for size in sizes}


def turn2_ttft(url: str, model: str, tok, size: int, repeat: int, part: int,
               probe: Callable[[], dict[str, float]] | None = None) -> dict:
    """Turn 2 of a conversation whose turn 1 (~size tokens) was just answered: its median
    TTFT and the last one's prompt and cached tokens; with `probe` (sums of metrics), also
    where turn 2's time went: the backend's TTFT (from the request's arrival there), of it
    the part before the engine, and the proxy's work before forwarding, each the mean
    over the turn-2 requests."""
    times, usage, split = [], {}, {}
    for r in range(repeat):
        messages, follow = conversation(tok, fresh(size, r, part), 70 + r + 10 * part)
        _, _, reply = run(chat(url, model, messages, 1))
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": follow}]
        before = probe() if probe else {}
        t, usage, _ = run(chat(url, model, messages, 2))
        for k, v in (probe() if probe else {}).items():
            # A gauge is read as it stood before turn 2; counters as what turn 2 added.
            split[k] = split.get(k, 0.0) + (before[k] if k == "disk_queue" else v - before[k])
        times.append(t)
    out = {"ttft": statistics.median(times), "ttfts": times, "ttft_mean": statistics.mean(times),
           "prompt_tokens": usage.get("prompt_tokens"), "cached_tokens": cached_tokens(usage)}
    out.update(means_between({}, split))
    for name in ("disk_writes", "disk_paced", "disk_queue"):  # per turn 2
        if name in split:
            out[name] = split[name] / repeat
    if "hot_hits" in split:
        out["hot_hits"], out["repeat"] = split["hot_hits"], repeat
    if "card_low" in split:
        out["card_low"] = split["card_low"]
    return out


SPLIT_MEANS = ("engine_ttft", "backend_prepare", "backend_prompt", "backend_queue",
               "proxy_overhead", "backend_send")


def means_between(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per-request means of `Stack.split`'s sums over what happened between two probes
    (`before` empty: since the start)."""
    out = {}
    for name in SPLIT_MEANS:
        n = after.get(name + "_n", 0.0) - before.get(name + "_n", 0.0)
        if n:
            out[name] = (after[name] - before.get(name, 0.0)) / n
    return out


async def agents(url: str, model: str, tok, seed: int, system: int) -> dict:
    """8 agents x 4 turns; 4 system prompts of `system` tokens, each shared by two agents."""
    systems = [text_of(tok, system + k, seed + k) for k in range(4)]
    ttfts: list[float] = []
    totals = {"prompt": 0, "cached": 0}
    routes: dict[str, list[float]] = {}  # turns 2-4's TTFTs by the proxy's reason

    async def agent(i: int, s: aiohttp.ClientSession) -> None:
        messages = [{"role": "system", "content": systems[i % 4]}]
        for turn in range(4):
            messages.append({"role": "user", "content": text_of(tok, 120, seed + 100 * i + turn)})
            route: dict = {}
            t, _, usage, text = await stream(s, url, "/v1/chat/completions",
                                             {"model": model, "messages": messages,
                                              "max_tokens": 48, "temperature": 0}, route=route)
            if turn:
                ttfts.append(t)
                routes.setdefault(route.get("reason") or "?", []).append(t)
            totals["prompt"] += usage.get("prompt_tokens", 0)
            totals["cached"] += cached_tokens(usage)
            messages.append({"role": "assistant", "content": text})

    t0 = time.perf_counter()
    async with http_session() as s:
        await asyncio.gather(*(agent(i, s) for i in range(8)))
    return {"hit_ratio": totals["cached"] / max(totals["prompt"], 1),
            "ttft_turns_2_4": statistics.mean(ttfts), "wall_s": time.perf_counter() - t0,
            "routes": {k: [len(v), statistics.mean(v)] for k, v in sorted(routes.items())}}


# -- processes ---------------------------------------------------------------------------


def get(url: str, headers: dict | None = None) -> bytes:
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read()


class Proc:
    def __init__(self, name: str, cmd: list[str], url: str, logs: Path, env: dict | None = None):
        self.name, self.url = name, url
        self.log = logs / f"{name}.log"
        # Logs append across runs: where this process's lines begin.
        self.log_from = self.log.stat().st_size if self.log.exists() else 0
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, cwd=ROOT)
        self.started = time.perf_counter()

    def wait_ready(self, ready, timeout: float = 900.0) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}: "
                                   f"{self.log.read_text(errors='replace')[-3000:]}")
            try:
                if ready():
                    return time.perf_counter() - self.started
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f}s")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def run_mlx_server(args, tok, logs: Path) -> dict:
    port = free_port()
    server = Proc("mlx-lm-server", [sys.executable, "-m", "mlx_lm", "server", "--model",
                                    args.model, "--port", str(port), "--max-tokens", "4096"],
                  f"http://127.0.0.1:{port}", logs)
    url, model = server.url, args.model
    try:
        server.wait_ready(lambda: get(url + "/health"))
        # Warm-up as for the others: kernels, then one long prompt.
        run(decode_rate(url, model, tok, 8, 16, 5000))
        run(completion_ttft(url, model, text_of(tok, max(args.sizes + [args.turn2]) + 200, 2)))
        out = {"cold": cold_ttfts(url, model, tok, args.sizes, args.repeat, 1),
               "turn2": turn2_ttft(url, model, tok, args.turn2, args.turn2_repeat, 1)}
        for n in (1, 8, 32):
            out[f"decode{n}"] = decode_median(url, model, tok, n, args.decode, 5100 + 100 * n,
                                              args.decode_repeat)
    finally:
        server.stop()
    return out


class Stack:
    """One `kvroute serve` with its own config file."""

    def __init__(self, args, logs: Path, name: str, disk_dir: str, replicas: int = 0,
                 extra: str = ""):
        """`replicas` (0: --replicas) and `extra`, more lines of the model's table."""
        self.replicas = replicas or args.replicas
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = logs / f"{name}.toml"
        disk = (f'disk_cache_dir = "{disk_dir}"\n' if disk_dir else 'disk_cache_bytes = "0"\n')
        self.config.write_text(
            f'secret = "bench-hw"\n\n[proxy]\nport = {self.port}\n\n'
            f'[backends]\nport_base = {free_port()}\n\n'
            f'[[models]]\npath = "{args.model}"\nalias = "m"\nreplicas = {self.replicas}\n'
            f'cache_bytes = "{args.cache_bytes}"\n' + extra
            + (f"max_batch = {args.max_batch}\n" if args.max_batch else "")
            + (f"max_prompt_tokens = {args.max_prompt_tokens}\n" if args.max_prompt_tokens else "")
            + disk
            + (f"prefill_step = {args.prefill_step}\n" if args.prefill_step else ""))
        self.args, self.logs, self.name, self.runs = args, logs, name, 0
        self.disk_dir = disk_dir
        self.proc: Proc | None = None
        self.started: list[Proc] = []  # every start's process, restarts included

    def start(self) -> float:
        self.runs += 1
        env = {"KVROUTE_INTERNAL_TOKEN": TOKEN}
        self.proc = Proc(f"{self.name}-{self.runs}", [sys.executable, "-m", "kvroute.cli", "serve",
                                                       "--config", str(self.config)],
                         self.url, self.logs, env)
        self.started.append(self.proc)
        return self.proc.wait_ready(self._ready)

    def _ready(self) -> bool:
        health = json.loads(get(self.url + "/health"))
        backends = [b for b in health.get("backends", []) if "m" in (b.get("models") or [])]
        models = json.loads(get(self.url + "/v1/models"))["data"]
        return len(backends) >= self.replicas and any(m["id"] == "m" for m in models)

    def backends(self) -> list[str]:
        health = json.loads(get(self.url + "/health"))
        return sorted(b["url"] for b in health["backends"])

    def metric(self, name: str, **labels: str) -> float:
        return sum(metric_sum(get(b + "/metrics", {"x-kvroute-token": TOKEN}).decode(), name, **labels)
                   for b in self.backends())

    def split(self) -> dict[str, float]:
        """Sums behind turn 2's split: the backends' engine TTFT of cache hits, the
        proxy's time before forwarding."""
        backends = [get(b + "/metrics", {"x-kvroute-token": TOKEN}).decode()
                    for b in self.backends()]
        caches = [h["cache"] for h in self.healths()]
        proxy = get(self.url + "/metrics").decode()
        hit = {"cached": "true"}

        def histogram(key: str, name: str, **labels: str) -> dict[str, float]:
            """A histogram's sum over the backends, and its count as `key`_n."""
            return {key: sum(metric_sum(t, name + "_sum", **labels) for t in backends),
                    key + "_n": sum(metric_sum(t, name + "_count", **labels) for t in backends)}

        return {**histogram("engine_ttft", "kvroute_backend_ttft_seconds", **hit),
                **histogram("backend_prepare", "kvroute_backend_prepare_seconds"),
                # Of it, the body, chat template and tokens.
                **histogram("backend_prompt", "kvroute_backend_prompt_seconds"),
                **histogram("backend_queue", "kvroute_backend_queue_seconds"),
                # The first chunk's way from the engine's token to the client's connection.
                **histogram("backend_send", "kvroute_backend_first_chunk_send_seconds"),
                "proxy_overhead": metric_sum(proxy, "kvroute_proxy_overhead_seconds_sum"),
                "proxy_overhead_n": metric_sum(proxy, "kvroute_proxy_overhead_seconds_count"),
                # What the disk writers did around turn 2 (the tier's cost on a hit).
                "disk_writes": sum(metric_sum(t, "kvroute_backend_disk_writes_total",
                                              result="ok") for t in backends),
                "disk_paced": sum(metric_sum(t, "kvroute_backend_disk_write_paced_seconds_total")
                                  for t in backends),
                "disk_queue": sum(metric_sum(t, "kvroute_backend_disk_write_queue")
                                  for t in backends),
                # Times a backend's card guard emptied its buffer cache (its next
                # steps allocate anew: slower).
                "card_low": sum(metric_sum(t, "kvroute_backend_card_low_total") for t in backends),
                # Hits that started from a finished turn's contiguous copy, not its blocks.
                "hot_hits": sum(c.get("hot_hits", 0) for c in caches),
                # The disk restores' own time (files read and checked).
                "restore_read": sum(metric_sum(t, "kvroute_backend_disk_restore_seconds_sum")
                                    for t in backends)}

    def memory(self) -> list[dict]:
        """Each backend's memory now (its /health): MLX's active, cache, peak and cap,
        the card's free bytes, what its process holds on the card as nvidia-smi counts
        it (MLX's arrays and cache, and what MLX does not count), and its card guard's
        count (its /metrics)."""
        on_card = card_use()
        guard = [metric_sum(get(b + "/metrics", {"x-kvroute-token": TOKEN}).decode(),
                            "kvroute_backend_card_low_total") for b in self.backends()]
        return [{**h.get("memory", {}), "store": h["cache"]["bytes"],
                 "hot": h["cache"].get("hot_bytes", 0),
                 "queued": (h.get("disk") or {}).get("write_queue_bytes", 0), "card_low": low,
                 **({"process": on_card[h["pid"]]} if h.get("pid") in on_card else {})}
                for h, low in zip(self.healths(), guard)]

    def healths(self) -> list[dict]:
        """Each backend's own /health."""
        return [json.loads(get(b + "/health", {"x-kvroute-token": TOKEN})) for b in self.backends()]

    def stop(self) -> int | None:
        return self.proc.stop() if self.proc else None

    def log_count(self, text: str) -> int:
        """Lines that say `text` in what this stack's starts logged (every process of
        the stack): a backend that ran out of device memory recovers and serves on, slower."""
        count = 0
        for proc in self.started:
            with open(proc.log, "rb") as f:
                f.seek(proc.log_from)
                count += sum(text in line for line in f.read().decode(errors="replace").splitlines())
        return count


def page_cache_share(folder: str) -> float | None:
    """The share of `folder`'s bytes in the OS page cache (mincore; None where it cannot
    tell): a restore reads from memory or from the drive, two different rates."""
    try:
        import ctypes
        import mmap

        import numpy as np
        libc = ctypes.CDLL(None, use_errno=True)
        held = total = 0
        for path in Path(folder).rglob("*"):
            if not path.is_file() or not path.stat().st_size:
                continue
            size = path.stat().st_size
            with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
                pages = np.zeros((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE, np.uint8)
                view = np.frombuffer(m, np.uint8)
                failed = libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size),
                                      ctypes.c_void_p(pages.ctypes.data))
                del view  # before the map closes
            if failed:
                return None
            held += min(int((pages & 1).sum()) * mmap.PAGESIZE, size)
            total += size
        return held / total if total else None
    except (OSError, AttributeError, ValueError):
        return None


def backend_pids(parent: int, role: bytes = b"backend") -> list[int]:
    """The `kvroute backend` processes `parent` (a `kvroute serve`) started (`role`
    b"proxy": its proxy)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and role in cmd:
            pids.append(int(entry.name))
    return sorted(pids)


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User and system CPU seconds of a process, or of one of its threads (Linux)."""
    stat = Path(f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat").read_text()
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stack_pids(stack: "Stack") -> tuple[int, int] | None:
    """A one-replica stack's backend and proxy processes; None where /proc cannot tell
    (not Linux)."""
    try:
        serve = stack.proc.proc.pid
        return backend_pids(serve)[0], backend_pids(serve, b"proxy")[0]
    except (OSError, IndexError, AttributeError):
        return None


def stack_cpu(pids: tuple[int, int]) -> dict[str, float] | None:
    """CPU seconds so far of a stack's backend, of its event loop (the main thread:
    handlers, SSE chunks, socket writes) and of its proxy (`stack_pids`)."""
    backend, proxy = pids
    try:
        return {"loop": cpu_seconds(backend, backend), "backend": cpu_seconds(backend),
                "proxy": cpu_seconds(proxy)}
    except (OSError, ValueError):
        return None


def with_cpu(pids: tuple[int, int] | None, take: Callable[[], float], tokens: int,
             sample: dict, name: str) -> float:
    """`take()`'s rate, with the stack's CPU per generated token (µs) and each part's
    share of a core over the same time in `sample[name + "_cpu"]`: whether the event
    loop or the proxy, each on one core, is what a many-stream decode waits for."""
    if pids is None:
        return take()
    before, t0 = stack_cpu(pids), time.perf_counter()
    rate = take()
    wall, after = time.perf_counter() - t0, stack_cpu(pids)
    if before is not None and after is not None:
        sample[name + "_cpu"] = {k: {"us_token": (after[k] - before[k]) / tokens * 1e6,
                                     "core": (after[k] - before[k]) / wall} for k in before}
    return rate


class Profile:
    """py-spy sampling every backend of a stack while a `with` block runs (`--profile`):
    each thread's stacks in py-spy's raw (collapsed) format, two files per backend
    (every thread, idle ones too; the GIL's holder only). Sampling does not stop the
    process (`--nonblocking`)."""

    def __init__(self, folder: str, stack: "Stack", label: str):
        self.folder, self.stack, self.label = folder, stack, label
        self.procs: list[subprocess.Popen] = []
        self.logs: list = []

    def __enter__(self) -> "Profile":
        if not self.folder:
            return self
        spy = shutil.which("py-spy")
        if spy is None:
            raise SystemExit("--profile needs py-spy on PATH (pip install py-spy)")
        Path(self.folder).mkdir(parents=True, exist_ok=True)
        for pid in backend_pids(self.stack.proc.proc.pid):
            # Every thread's stack, waiting or not; and only the thread holding the
            # GIL: a thread's samples in the first but not the second at a line of
            # Python are its waits for the GIL.
            for kind, flag in (("all", "--idle"), ("gil", "--gil")):
                out = Path(self.folder) / f"{self.stack.name}-{self.label}-{pid}-{kind}.txt"
                log = open(out.with_suffix(".log"), "wb")
                self.logs.append(log)
                self.procs.append(subprocess.Popen(
                    [spy, "record", "--pid", str(pid), "--rate", "200", flag, "--threads",
                     "--nonblocking", "--format", "raw", "--output", str(out)],
                    stdout=log, stderr=subprocess.STDOUT))
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        for log in self.logs:
            log.close()


def settle_disk(stack: Stack, timeout: float = 300.0) -> None:
    """Wait until every backend's disk writes are done (what a restart would find)."""
    deadline = time.monotonic() + timeout
    while stack.metric("kvroute_backend_disk_write_queue") > 0:
        if time.monotonic() > deadline:
            raise RuntimeError("disk writes still queued")
        time.sleep(0.2)


def run_kvroute(args, tok, logs: Path, disk: bool) -> dict:
    part = 2 if disk else 3
    disk_dir = str(logs / "disk-tier") if disk else ""
    if disk_dir:
        shutil.rmtree(disk_dir, ignore_errors=True)
    stack = Stack(args, logs, "kvroute" if disk else "kvroute-no-disk", disk_dir)
    url = stack.url
    out: dict = {"exit_codes": []}
    try:
        out["ready_s"] = round(stack.start(), 1)
        # Both parts run the same requests up to turn 2: the prompt cache (and, with the
        # tier on, the writers' queue) then holds the same conversations, so the
        # difference is the tier's. (A no-disk part that ran one cold size before turn 2
        # had an emptier cache: its turn 2 was not the same turn.)
        firsts = [run(completion_ttft(url, "m", text_of(tok, 2000 + i, 9000 + i)))
                  for i in range(10)]
        if disk:
            out["first_vs_tenth"] = (firsts[0], firsts[-1])
        out["cold"] = cold_ttfts(url, "m", tok, args.sizes, args.repeat, part)
        with Profile(args.profile, stack, "turn2"):
            out["turn2"] = turn2_ttft(url, "m", tok, args.turn2, args.turn2_repeat, part, stack.split)
        out["memory"] = {"turn2": stack.memory()}
        progress(out)
        one = stack.backends()[0]
        run(decode_rate(url, "m", tok, 8, 16, 6000))
        before = stack.split()
        # Both parts run every decode: the agents after them then meet the same cache
        # (and, with the tier on, the writes those prompts queued), so the difference is
        # the tier's. (The tier-off part once ran only 8 streams: its agents met a cache
        # and card the 1- and 32-stream runs had not touched.)
        with Profile(args.profile, stack, "decodes"):
            for n in (1, 8, 32):
                out[f"decode{n}"] = decode_median(url, "m", tok, n, args.decode, 6000 + 100 * n,
                                                  args.decode_repeat)
                if n > 1:
                    # mlx-lm's server batches every stream in one process: so does one backend.
                    out[f"decode{n}_one"] = decode_median(one, "m", tok, n, args.decode,
                                                          6050 + 100 * n, args.decode_repeat,
                                                          {"x-kvroute-token": TOKEN})
        # What the disk writers (and the card guard) did beside the decodes: the tier's
        # cost on them, where writes queued before them still run.
        after = stack.split()
        out["decode_beside"] = {k: after[k] - before[k] for k in ("disk_writes", "disk_paced", "card_low")}
        out["decode_beside"]["disk_queue"] = before["disk_queue"]
        progress(out)
        out["memory"]["decode"] = stack.memory()
        before = stack.split()
        try:
            with Profile(args.profile, stack, "agents"):
                out["agents"] = run(agents(url, "m", tok, 20000 + 1000 * part, args.agent_system))
        except RuntimeError as exc:  # recorded, and the restore still measured
            out["agents_error"] = str(exc)[-400:]
        else:  # what the disk writers did beside the agents, and where their time went
            after = stack.split()
            out["agents"].update({k: after[k] - before[k] for k in ("disk_writes", "disk_paced")})
            out["agents"].update(means_between(before, after))
        out["memory"]["agents"] = stack.memory()
        progress(out)
        if disk and args.restore:
            out["restore"] = restore(stack, tok, args)
            seconds = stack.metric("kvroute_backend_disk_restore_seconds_sum")
            out["disk_read_rate"] = (stack.metric("kvroute_backend_disk_restore_bytes_total")
                                     / seconds if seconds else None)
            out["disk_restores_skipped"] = stack.metric(
                "kvroute_backend_disk_restores_skipped_total")
            out["memory"]["restore"] = stack.memory()
    finally:
        out["exit_codes"].append(stack.stop())
        out["device_oom"] = stack.log_count("out of device memory")
        if disk_dir:
            out["disk_bytes_written"] = sum(p.stat().st_size for p in Path(disk_dir).rglob("*")
                                            if p.is_file())
            shutil.rmtree(disk_dir, ignore_errors=True)
    return out


def run_defaults(args, logs: Path) -> dict:
    """`kvroute serve --model M --replicas N` as a newcomer types it."""
    import tempfile

    port = free_port()
    cache = tempfile.mkdtemp(prefix="kvr-defaults-")
    (logs / "serve-defaults.log").unlink(missing_ok=True)
    proc = Proc("serve-defaults", [sys.executable, "-m", "kvroute.cli", "serve", "--model", args.model,
                                   "--replicas", str(args.replicas), "--port", str(port),
                                   "--backend-port-base", str(free_port())],
                f"http://127.0.0.1:{port}", logs, {"KVROUTE_CACHE_DIR": cache})
    out: dict = {}
    try:
        def state(want: str) -> bool:
            listed = json.loads(get(proc.url + "/v1/models"))["data"]
            if listed:
                out["model"] = listed[0]["id"]
            return bool(listed) and listed[0].get("state") == want
        out["listed_loading_s"] = round(proc.wait_ready(lambda: state("loading") or state("loaded"),
                                                        timeout=600), 1)
        out["ready_s"] = round(proc.wait_ready(lambda: state("loaded"), timeout=600), 1)
        out["ttft"] = run(completion_ttft(proc.url, out["model"], "Say hi."))
    except RuntimeError as exc:
        out["error"] = str(exc)[-500:]
    finally:
        out["exit_code"] = proc.stop()
        shutil.rmtree(cache, ignore_errors=True)
    # serve's start-up notes: the memory check and the disk budgets, with their detail lines.
    notes = proc.log.read_text(errors="replace").split("\n")
    out["notes"] = [line for i, line in enumerate(notes) if line.startswith("note:") or (
        line.startswith("  ") and "│" not in line and i and notes[i - 1].startswith(("note:", "  ")))][:12]
    return out


# mlx-lm's server with a memory cap: two or more MLX processes on one card must each
# be capped (each otherwise assumes most of the card is its own).
CAPPED_MLX_SERVER = ("import sys, mlx.core as mx; mx.set_memory_limit(int(sys.argv[1])); "
                     "mx.set_cache_limit(1 << 30); sys.argv = ['mlx_lm.server'] + sys.argv[2:]; "
                     "from mlx_lm.server import main; main()")


# Memory a capped MLX process gets beside others on one card: its weights and a few
# GiB for the decodes' KV and buffers (a kvroute replica also its prompt cache).
HEADROOM = 6 << 30


def capped_replica(args) -> tuple[int, str]:
    """The memory cap of a one-replica stack that shares the card with other processes
    (the paired parts), and its lines of the model's table."""
    from kvroute.core.sizes import parse_bytes
    from kvroute.serve.capacity import weights_bytes

    cap = (weights_bytes(args.model) or 0) + parse_bytes(args.cache_bytes) + HEADROOM
    return cap, f'memory_limit = "{cap}"\nmax_running_tokens = 65536\n'


def run_paired(args, tok, logs: Path) -> dict:
    """Decode with raw mlx-lm, mlx-lm's server and kvroute (one replica, its disk tier
    on; through the proxy, and its backend alone) all loaded on the card at once, their
    samples taken in turns (the order rotating each round): a GPU's speed drifts by a
    fifth within minutes, so parts run one after the other compare samples taken at
    different speeds. Each round's ratios are taken within the round; the report gives
    their medians."""
    from kvroute.serve.capacity import weights_bytes

    # A 7B model's three come to ~60 GiB: an 80 GB card holds them.
    base_cap = (weights_bytes(args.model) or 0) + HEADROOM
    kv_cap, extra = capped_replica(args)
    disk_dir = str(logs / "paired-disk-tier")
    shutil.rmtree(disk_dir, ignore_errors=True)
    stack = Stack(args, logs, "kvroute-paired", disk_dir, replicas=1, extra=extra)
    raw_log = open(logs / "raw-paired.log", "ab")
    raw = server = None
    out: dict = {"caps": {"kvroute": kv_cap, "baselines": base_cap}}
    try:
        stack.start()  # first: its memory check sees the card as it is
        raw = subprocess.Popen(
            [sys.executable, "-m", "bench.bench_hw", "--raw-serve", "--model", args.model,
             "--raw-memory-limit", str(base_cap), "--raw-prefill-step", str(args.raw_prefill_step)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=raw_log, text=True, cwd=ROOT)
        port = free_port()
        server = Proc("mlx-lm-server-paired", [sys.executable, "-c", CAPPED_MLX_SERVER, str(base_cap),
                                               "--model", args.model, "--port", str(port),
                                               "--max-tokens", "4096"],
                      f"http://127.0.0.1:{port}", logs)
        if raw.stdout.readline().strip() != "READY":
            raise RuntimeError(f"raw decode child exited {raw.wait()}: see {raw_log.name}")
        server.wait_ready(lambda: get(server.url + "/health"))

        def raw_rate(streams: int, seed: int, mode: str = "") -> float:
            raw.stdin.write(f"{streams} {args.decode} {seed} {mode}\n")
            raw.stdin.flush()
            line = raw.stdout.readline()
            if not line.startswith("RATE "):
                raise RuntimeError(f"raw decode child: {line!r}: see {raw_log.name}")
            return float(line[5:])

        takers = {"raw": raw_rate,
                  # kvroute's own generator and caches with no engine, HTTP or proxy
                  # around them: what the engine could reach (bench_layers measured it
                  # 1.24-1.40x of plain mlx-lm on the H200; the engine 1.13-1.19x).
                  "generator": lambda n, seed: raw_rate(n, seed, "fast"),
                  "server": lambda n, seed: run(decode_rate(server.url, args.model, tok, n,
                                                            args.decode, seed)),
                  "kvroute": lambda n, seed: run(decode_rate(stack.url, "m", tok, n,
                                                             args.decode, seed)),
                  # The same backend without the proxy: what the proxy's hop costs.
                  "backend": lambda n, seed: run(decode_rate(stack.backends()[0], "m", tok, n,
                                                             args.decode, seed,
                                                             {"x-kvroute-token": TOKEN}))}
        for n in (1, 8, 32):  # warm-up: each batch's shapes, in the servers as in raw
            run(decode_rate(server.url, args.model, tok, n, 16, 7000 + n))
            run(decode_rate(stack.url, "m", tok, n, 16, 7100 + n))
        names = list(takers)
        pids = stack_pids(stack)  # the processes whose CPU each kvroute sample reads
        rounds: dict[str, list[dict]] = {str(n): [] for n in (1, 8, 32)}
        for r in range(args.paired_repeat):
            for n in (1, 8, 32):
                sample: dict = {"clock": gpu_clock()}
                for name in names[r % len(names):] + names[:r % len(names)]:
                    # The same prompts for each, new ones (and lengths) each round.
                    seed = 8000 + 1000 * r + 100 * n
                    if name in ("kvroute", "backend"):
                        sample[name] = with_cpu(pids, lambda: takers[name](n, seed),
                                                n * args.decode, sample, name)
                    else:
                        sample[name] = takers[name](n, seed)
                rounds[str(n)].append(sample)
            progress(rounds)
        out["rounds"] = rounds
    finally:
        if raw is not None:
            try:
                raw.stdin.close()  # its loop ends, and the process with it
                raw.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                raw.kill()
                raw.wait(10)
        raw_log.close()
        if server is not None:
            server.stop()
        out["exit_code"] = stack.stop()
        shutil.rmtree(disk_dir, ignore_errors=True)
    return out


def run_tier(args, tok, logs: Path) -> dict:
    """The disk tier's cost, paired: two stacks of one replica each, the tier on and
    off, loaded on the card at once, their samples taken in turns (the order rotating
    each round) with the same fresh prompts: a turn 2 on a --turn2-token conversation,
    1- and 8-stream decodes, and the agents' turns 2-4. Before every sample the tier-on
    stack's writes are let finish: a write waits for its engine to be idle, which is
    when the other stack's sample runs, and on the same card it would slow that one.
    So this measures the tier with its writer caught up (what a load with pauses
    gives); the one-after-another parts measure it with a backlog of writes beside
    the work."""
    cap, extra = capped_replica(args)
    disk_dir = str(logs / "tier-disk-tier")
    shutil.rmtree(disk_dir, ignore_errors=True)
    stacks = {"on": Stack(args, logs, "kvroute-tier-on", disk_dir, replicas=1, extra=extra),
              "off": Stack(args, logs, "kvroute-tier-off", "", replicas=1, extra=extra)}
    out: dict = {"cap": cap, "exit_codes": {}}
    try:
        for stack in stacks.values():
            stack.start()

        def sample(stack: Stack, r: int) -> dict:
            settle_disk(stacks["on"])
            # A new conversation each round (the same for both stacks in it).
            t2 = turn2_ttft(stack.url, "m", tok, args.turn2, 1, 10 + r, stack.split)
            got = {"turn2": t2["ttft"], "turn2_before_engine": t2.get("backend_prepare", 0.0),
                   "turn2_engine": t2.get("engine_ttft", 0.0), "turn2_cached": t2["cached_tokens"],
                   "agents": run(agents(stack.url, "m", tok, 50000 + 1000 * r,
                                        args.agent_system))["ttft_turns_2_4"]}
            for n in (1, 8):
                got[f"decode{n}"] = run(decode_rate(stack.url, "m", tok, n, args.decode,
                                                    9000 + 1000 * r + 100 * n))
            return got

        for name in stacks:  # warm-up: an 8-stream decode on each (its batch's shapes)
            run(decode_rate(stacks[name].url, "m", tok, 8, 16, 7800))
        rounds = []
        for r in range(args.paired_repeat):
            order = ["on", "off"] if r % 2 == 0 else ["off", "on"]
            rounds.append({"clock": gpu_clock(), **{name: sample(stacks[name], r) for name in order}})
            progress({"tier": rounds})
        out["rounds"] = rounds
    finally:
        for name, stack in stacks.items():
            if stack.proc is not None:
                out["exit_codes"][name] = stack.stop()
                out.setdefault("device_oom", {})[name] = stack.log_count("out of device memory")
        shutil.rmtree(disk_dir, ignore_errors=True)
    return out


def tier_report(rounds: list[dict]) -> str:
    """The paired tier part's table: medians of each measure, and of the on / off
    ratios taken within each round."""
    med = statistics.median
    rows = (("turn 2 on a cached conversation", "turn2", "s", "<= 1.05x"),
            ("of it, the backend before its engine", "turn2_before_engine", "s", ""),
            ("of it, the backend's engine", "turn2_engine", "s", ""),
            ("agents' turns 2-4 (mean TTFT)", "agents", "s", "<= 1.05x"),
            ("decode 1 stream", "decode1", "tok/s", ">= 0.95x"),
            ("decode 8 streams", "decode8", "tok/s", ">= 0.95x"))
    text = (f"| disk tier on / off, paired ({len(rounds)} rounds, the writer caught up before "
            "each sample) | tier on | tier off | on / off | target |\n|---|---|---|---|---|\n")
    for label, key, unit, target in rows:
        if not all(s[k].get(key) for s in rounds for k in ("on", "off")):
            continue  # not measured (runs before it was)
        on, off = (med(s[k][key] for s in rounds) for k in ("on", "off"))
        fmt = (lambda v: f"{v:.3f} s") if unit == "s" else (lambda v: f"{v:.0f} tok/s")
        text += (f"| {label} | {fmt(on)} | {fmt(off)} "
                 f"| {med(s['on'][key] / s['off'][key] for s in rounds):.2f}x | {target} |\n")
    return text


def gpu_clock() -> str:
    """The card's SM clock (MHz) and power draw (W) now, as nvidia-smi reads them ("" where
    there is none): beside each paired sample, so a drift in speed shows its cause."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return ""


def restore(stack: Stack, tok, args) -> dict:
    """--restore-repeat conversations of --restore tokens, the whole stack restarted,
    each one's turn 2 (medians): restored from disk, against the cold prefill of
    their turns 1 before the restart and of prompts of the same size after it."""
    size = args.restore
    convs = [conversation(tok, fresh(size, r, 5), 555 + r) for r in range(args.restore_repeat)]
    turns1 = [run(chat(stack.url, "m", messages, 1)) for messages, _ in convs]
    settle_disk(stack)
    # Commits the disk never got (the writers' queue was full): the next turn may find none.
    dropped = stack.metric("kvroute_backend_disk_writes_total", result="dropped")
    stack.stop()
    ready = stack.start()
    # Kernels are warm after start (warm-up); the cold reference runs first so the
    # restored turn does not find its prefix in RAM by any other path.
    cold = statistics.median(run(chat(stack.url, "m", conversation(tok, fresh(size, r, 6), 600 + r)[0],
                                      1))[0] for r in range(args.repeat))
    skipped = stack.metric("kvroute_backend_disk_restores_skipped_total")
    early = stack.metric("kvroute_backend_disk_early_reads_total", used="yes")
    in_memory = page_cache_share(stack.disk_dir)
    turns, splits = [], []
    for (messages, follow), (_, _, reply) in zip(convs, turns1):
        messages = messages + [{"role": "assistant", "content": reply}, {"role": "user", "content": follow}]
        before = stack.split()
        t, usage, _ = run(chat(stack.url, "m", messages, 2))
        # The backend's TTFT of the hit, its time before the engine, of that the restore.
        after = stack.split()
        turns.append((t, usage))
        splits.append({k: after[k] - before[k] for k in (
            "engine_ttft", "backend_prepare", "backend_prompt", "restore_read", "proxy_overhead",
            "backend_send")})
    skipped = stack.metric("kvroute_backend_disk_restores_skipped_total") - skipped
    early = stack.metric("kvroute_backend_disk_early_reads_total", used="yes") - early
    usage = min((u for _, u in turns), key=cached_tokens)  # the least restored of them
    return {"size": size, "restored_ttft": statistics.median(t for t, _ in turns),
            "restored_ttfts": [t for t, _ in turns], "cold_ttft": cold,
            "cold_before_restart": statistics.median(t[0] for t in turns1),
            **{k: statistics.median(sp[k] for sp in splits) for k in splits[0]},
            "writes_dropped": dropped, "skipped": skipped, "early": early,
            "cached_tokens": cached_tokens(usage), "prompt_tokens": usage.get("prompt_tokens"),
            "restart_ready_s": round(ready, 1), "repeat": len(turns),
            "page_cache_share": in_memory}


def progress(out: dict) -> None:
    # A run cut short by a time limit still shows what it measured.
    print("so far:", json.dumps(out, default=str), flush=True)


# -- report -------------------------------------------------------------------------------


def card_use() -> dict[int, int]:
    """Each process's memory on the GPU as nvidia-smi counts it (bytes, by pid); empty
    where there is no nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    use = {}
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        try:
            use[int(pid)] = int(float(mib) * (1 << 20))
        except ValueError:
            continue
    return use


def memory_table(phases: dict[str, list[dict]]) -> str:
    """Each backend's MLX memory after each phase (active, buffer cache, peak, cap),
    its process's memory on the card (nvidia-smi: with what MLX does not count), what
    CUDA's memory pool held for it and of that in use, the card's free memory then,
    what the prompt cache and the disk writers' queue held of it, and how often its
    card guard had emptied its buffer cache so far."""
    if not phases:
        return ""
    b = format_bytes

    def pool(m: dict) -> str:
        return f"{b(m['pool_reserved'])} / {b(m['pool_used'])}" if "pool_reserved" in m else "-"
    text = ("\n| memory after | backend | active | buffer cache | peak | cap | process on the card "
            "| CUDA pool held / in use | card free | prompt cache + hot copies | disk write queue "
            "| card guard so far |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    for phase, backends in phases.items():
        for i, m in enumerate(backends):
            if m:
                text += (f"| {phase} | {i + 1} | {b(m['active'])} | {b(m['cache'])} | {b(m['peak'])} "
                         f"| {b(m.get('limit', 0))} | {b(m['process']) if 'process' in m else '-'} "
                         f"| {pool(m)} "
                         f"| {b(m['device_free']) if 'device_free' in m else '-'} "
                         f"| {b(m.get('store', 0))} + {b(m.get('hot', 0))} | {b(m.get('queued', 0))} "
                         f"| {m.get('card_low', 0):.0f} |\n")
    return text


def report(args, got: dict) -> str:
    raw, ref, kv, nd, plain = (got.get(p) for p in PARTS[:5])
    rows = [("measure", "kvroute", "baseline", "kvroute / baseline", "target")]
    secs = lambda v: f"{v:.3f} s"  # noqa: E731
    rate = lambda v: f"{v:.0f} tok/s"  # noqa: E731

    def add(what, mine, base, fmt, target=""):
        if mine is None or base is None:
            return
        rows.append((what, fmt(mine), fmt(base), f"{mine / base:.2f}x", target))

    if kv:
        for size in args.sizes:
            k = kv["cold"].get(str(size), kv["cold"].get(size))
            if raw:
                add(f"cold TTFT ~{size} tokens (raw generate_step)", k,
                    raw["cold"].get(str(size), raw["cold"].get(size)), secs, "<= 1.15x")
            if ref:
                add(f"cold TTFT ~{size} tokens (mlx-lm server)", k,
                    ref["cold"].get(str(size), ref["cold"].get(size)), secs)
        if raw:
            add(f"turn 2 on ~{args.turn2} cached (raw)", kv["turn2"]["ttft"], raw["turn2"], secs,
                "<= 1.5x")
            add("decode 1 stream (raw)", kv["decode1"], raw["decode1"], rate, ">= 0.9x")
            for n in (8, 32):
                if f"decode{n}" in raw:
                    add(f"decode {n} streams, one backend (raw: mlx-lm's BatchGenerator, no server)",
                        kv[f"decode{n}_one"], raw[f"decode{n}"], rate)
        if ref:
            add(f"turn 2 on ~{args.turn2} cached (mlx-lm server)", kv["turn2"]["ttft"],
                ref["turn2"]["ttft"], secs)
            add("decode 1 stream (mlx-lm server)", kv["decode1"], ref["decode1"], rate)
            for n in (8, 32):
                add(f"decode {n} streams, one backend (mlx-lm server)", kv[f"decode{n}_one"],
                    ref[f"decode{n}"], rate, ">= 1.5x" if n == 8 else "")
                add(f"decode {n} streams via the proxy, {args.replicas} replicas (mlx-lm server)",
                    kv[f"decode{n}"], ref[f"decode{n}"], rate)
        f, t = kv["first_vs_tenth"]
        add("first request after ready (the tenth)", f, t, secs, "~1x")
        t2 = kv["turn2"]
        if "engine_ttft" in t2:
            rest = t2.get("ttft_mean", t2["ttft"]) - t2["engine_ttft"] - t2.get("proxy_overhead", 0.0)
            rows.append((f"turn 2 on ~{args.turn2} cached: where it went",
                         f"backend {secs(t2['engine_ttft'])} (before its engine "
                         f"{secs(t2.get('backend_prepare', 0.0))}, of it the prompt's template and "
                         f"tokens {secs(t2.get('backend_prompt', 0.0))}, in its queue "
                         f"{secs(t2.get('backend_queue', 0.0))}), proxy before forwarding "
                         f"{secs(t2.get('proxy_overhead', 0.0))}, the rest "
                         f"{secs(rest)}"
                         + (f" (of it the first chunk's way out of the backend "
                            f"{secs(t2['backend_send'])})" if "backend_send" in t2 else "")
                         + (f" (means; each turn 2: {', '.join(secs(t) for t in t2['ttfts'])})"
                            if "ttfts" in t2 else "")
                         + (f"; {t2['hot_hits']:.0f} of {t2['repeat']} from the turn's hot copy"
                            if "hot_hits" in t2 else "")
                         + (f"; the disk writers: {t2['disk_queue']:.1f} items queued before it, "
                            f"{t2['disk_writes']:.1f} writes ended and {t2['disk_paced']:.3f} s "
                            f"paced during it" if "disk_queue" in t2 else "")
                         + (f"; the card guard emptied a buffer cache {t2['card_low']:.0f} times "
                            f"during them" if t2.get("card_low") else ""),
                         "", "", ""))
        if "restore" in kv and kv["restore"]["cached_tokens"] < kv["restore"]["prompt_tokens"] // 2:
            r = kv["restore"]
            rows.append((f"~{r['size']}-token conversation after a restart", secs(r["restored_ttft"]),
                         secs(r["cold_ttft"]), "not restored", "<= 0.33x"))
            why = ("the backend judged its prefill faster than reading the disk" if r.get("skipped")
                   else f"its turn 1 was not on disk ({r.get('writes_dropped', 0):.0f} commits were "
                   "dropped before the restart: the disk writers' queue was full)"
                   if r.get("writes_dropped") else "its turn 1 was not on disk")
            rows.append(("", f"cached {r['cached_tokens']} of {r['prompt_tokens']}: {why}", "", "", ""))
        elif "restore" in kv:
            r = kv["restore"]
            # Against a warm backend's prefill of that length (before the restart): the
            # cold prompts after it include each replica's first prompt of that length.
            add(f"~{r['size']}-token conversation restored from disk after a restart, median of "
                f"{r.get('repeat', 1)} (their turns 1's cold prefill before the restart)", r["restored_ttft"],
                r["cold_before_restart"], secs, "<= 0.33x")
            add(f"~{r['size']}-token conversation restored from disk after a restart "
                "(cold prompts of its length after the restart)", r["restored_ttft"],
                r["cold_ttft"], secs)
            if "engine_ttft" in r:
                rows.append(("the restored turn: where it went",
                             f"backend {secs(r['engine_ttft'])} (before its engine "
                             f"{secs(r['backend_prepare'])}, of it the prompt's template and tokens "
                             f"{secs(r.get('backend_prompt', 0.0))} and the restore "
                             f"{secs(r['restore_read'])}), the rest "
                             f"{secs(r['restored_ttft'] - r['engine_ttft'])}"
                             + (f" (of it the proxy before forwarding {secs(r['proxy_overhead'])}, "
                                f"the first chunk's way out of the backend {secs(r['backend_send'])})"
                                if "backend_send" in r else "")
                             + (f"; {r['early']:.0f} of {r['repeat']} reads begun from the "
                                "messages' keys, before the tokens" if "early" in r else "")
                             + (f"; the disk tier's files {100 * r['page_cache_share']:.0f}% "
                                "in the page cache before it" if r.get("page_cache_share") is not None
                                else ""), "", "", ""))
        if nd:
            big = args.sizes[-1]
            add(f"disk tier on: cold TTFT ~{big} (off)", kv["cold"].get(str(big), kv["cold"].get(big)),
                nd["cold"].get(str(big), nd["cold"].get(big)), secs, "<= 1.05x")
            add("disk tier on: turn 2 (off)", kv["turn2"]["ttft"], nd["turn2"]["ttft"], secs,
                "<= 1.05x")
            if "hot_hits" in kv["turn2"] and "hot_hits" in nd["turn2"]:
                rows.append(("", f"from the turn's hot copy: {kv['turn2']['hot_hits']:.0f} of "
                             f"{kv['turn2']['repeat']} (off: {nd['turn2']['hot_hits']:.0f})", "", "", ""))
            for n in (1, 8, 32):
                if f"decode{n}" in nd:
                    add(f"disk tier on: decode {n} via the proxy (off)", kv[f"decode{n}"],
                        nd[f"decode{n}"], rate, ">= 0.95x")
                if f"decode{n}_one" in nd:
                    add(f"disk tier on: decode {n}, one backend (off)", kv[f"decode{n}_one"],
                        nd[f"decode{n}_one"], rate, ">= 0.95x")
            if "decode_beside" in kv:
                b, off = kv["decode_beside"], nd.get("decode_beside", {})
                rows.append(("", f"beside the decodes: {b['disk_queue']:.0f} writes queued before "
                             f"them, {b['disk_writes']:.0f} ended and {b['disk_paced']:.1f} s paced "
                             f"during them; the card guard emptied a buffer cache {b['card_low']:.0f} "
                             f"times (off: {off.get('card_low', 0):.0f})", "", "", ""))
            if "agents" in kv and "agents" in nd:
                add("disk tier on: agents' turns 2-4 TTFT (off)", kv["agents"]["ttft_turns_2_4"],
                    nd["agents"]["ttft_turns_2_4"], secs, "<= 1.05x")
    if plain:
        started = "error" not in plain and plain.get("ttft") is not None
        rows.append((f"plain `kvroute serve --model M --replicas {args.replicas}`",
                     f"loaded {plain['ready_s']} s after start, first answer {plain['ttft']:.3f} s"
                     if started else "did not answer",
                     "", f"exit {plain['exit_code']}", "starts (met)" if started else "starts (not met)"))
    lines = [f"| {' | '.join(r)} |" for r in rows]
    lines.insert(1, "|" + "---|" * len(rows[0]))
    text = "\n".join(lines) if len(rows) > 1 else ""
    if got.get("paired", {}).get("rounds"):
        text += "\n\n" + paired_report(got["paired"]["rounds"])
    if got.get("tier", {}).get("rounds"):
        text += "\n\n" + tier_report(got["tier"]["rounds"])
    if kv:
        text += (f"\n\n| agents (8 x 4 turns, ~{args.agent_system}-token system prompts) | hit ratio "
                 "| turns 2-4 mean TTFT | wall | disk writes ended / paced beside them "
                 "| backend TTFT of hits / before the engine / in its queue (means) |"
                 "\n|---|---|---|---|---|---|\n")
        for name, part in (("disk tier on", kv), ("disk tier off", nd)):
            if part and part.get("device_oom"):
                text += (f"| {name} | the part's backends ran out of device memory "
                         f"{part['device_oom']} times (their log): slower steps after it | | | | |\n")
            if part and "agents" in part:
                a = part["agents"]
                disk = (f"{a['disk_writes']:.0f} / {a['disk_paced']:.2f} s" if "disk_paced" in a
                        else "")
                where = " / ".join(f"{a[k]:.3f} s" if k in a else "-" for k in
                                   ("engine_ttft", "backend_prepare", "backend_queue"))
                text += (f"| {name} | {a['hit_ratio']:.3f} | {a['ttft_turns_2_4']:.3f} s "
                         f"| {a['wall_s']:.1f} s | {disk} | {where} |\n")
        if "agents_error" in kv:
            text += f"| disk tier on | failed: {kv['agents_error'][-200:]} | | | | |\n"
        for name, part in (("disk tier on", kv), ("disk tier off", nd)):
            if part and (part.get("agents") or {}).get("routes"):
                text += (f"\nturns 2-4 by the proxy's route ({name}): " + ", ".join(
                    f"{k} {n} ({t:.3f} s)" for k, (n, t) in part["agents"]["routes"].items())
                    + "\n")
        text += memory_table(kv.get("memory") or {})
        extra = {k: kv.get(k) for k in ("ready_s", "exit_codes", "disk_read_rate",
                                        "disk_restores_skipped",
                                        "disk_bytes_written", "restore")}
        extra["turn2"] = kv["turn2"]
        text += "\n" + ", ".join(f"{k}: {v}" for k, v in extra.items() if v is not None)
    if plain:
        text += "\n\nplain serve: " + json.dumps(plain)
    return text


def paired_report(rounds: dict[str, list[dict]]) -> str:
    """The paired part's table: medians of the rates, and of the ratios taken within
    each round (what the targets read)."""
    med = statistics.median
    text = (f"| decode, all three on the card, samples taken in turns ({len(rounds['1'])} rounds) "
            "| kvroute (proxy, 1 replica) | mlx-lm server | raw mlx-lm | kvroute / raw "
            "| kvroute / server | server / raw | target | its backend alone / raw "
            "| kvroute's generator alone / raw | kvroute / its generator alone "
            "| SM clock MHz, power W |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    for n, samples in rounds.items():
        ratio = lambda a, b: f"{med(s[a] / s[b] for s in samples):.2f}x"  # noqa: E731
        has_gen = all("generator" in s for s in samples)  # not in runs before it was added
        target = ("kvroute / raw >= 0.9x" if n == "1" else
                  "kvroute / server >= 1.5x" if n == "8" else "")
        clocks = sorted({s["clock"] for s in samples if s.get("clock")})
        text += (f"| {n} stream{'s' if n != '1' else ''} | {med(s['kvroute'] for s in samples):.0f} tok/s "
                 f"| {med(s['server'] for s in samples):.0f} | {med(s['raw'] for s in samples):.0f} "
                 f"| {ratio('kvroute', 'raw')} | {ratio('kvroute', 'server')} "
                 f"| {ratio('server', 'raw')} | {target} | {ratio('backend', 'raw')} "
                 f"| {ratio('generator', 'raw') if has_gen else '-'} "
                 f"| {ratio('kvroute', 'generator') if has_gen else '-'} "
                 f"| {'; '.join(clocks[:1] + clocks[-1:] if len(clocks) > 1 else clocks) or '-'} |\n")
    text += ("\nraw at 1 stream: `generate_step`; at 8 and 32: mlx-lm's `BatchGenerator`, no server. "
             "kvroute's generator alone: the same in the same child, into kvroute's working caches "
             "(what its engine drives). Each round's samples decode the same fresh prompts.")
    return text + cpu_report(rounds)


def cpu_report(rounds: dict[str, list[dict]]) -> str:
    """The paired part's CPU per generated token: where a decode through the proxy, or
    to the backend alone, spends the host's time, and how much of a core each part took
    (an event loop near 1.0 is what the streams wait for)."""
    med = statistics.median
    keys = ("kvroute_cpu", "backend_cpu")
    if not all(k in s for samples in rounds.values() for s in samples for k in keys):
        return ""  # no /proc (or runs before it was measured)
    text = ("\n\n| CPU per generated token, µs (share of one core) | through the proxy: "
            "backend's event loop | whole backend | proxy | backend alone: its event loop "
            "| whole backend |\n|---|---|---|---|---|---|\n")
    for n, samples in rounds.items():
        cell = lambda k, part: (f"{med(s[k][part]['us_token'] for s in samples):.0f} "  # noqa: E731
                                f"({med(s[k][part]['core'] for s in samples):.2f})")
        text += (f"| {n} stream{'s' if n != '1' else ''} | {cell('kvroute_cpu', 'loop')} "
                 f"| {cell('kvroute_cpu', 'backend')} | {cell('kvroute_cpu', 'proxy')} "
                 f"| {cell('backend_cpu', 'loop')} | {cell('backend_cpu', 'backend')} |\n")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True,
                    help="model directory (python -m bench.models makes one)")
    ap.add_argument("--parts", default=",".join(PARTS), help="which parts to run, in order")
    ap.add_argument("--sizes", default="3900,15700,31300", help="cold prompt sizes (tokens)")
    ap.add_argument("--turn2", type=int, default=31300, help="turn 1's size before turn 2")
    ap.add_argument("--restore", type=int, default=8000,
                    help="conversation restored from disk after a restart (0: skip)")
    ap.add_argument("--restore-repeat", type=int, default=3,
                    help="conversations restored after the restart (a median)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--turn2-repeat", type=int, default=4,
                    help="conversations whose turn 2 is timed (a median; each costs a turn 1)")
    ap.add_argument("--decode", type=int, default=256, help="tokens per decode stream")
    ap.add_argument("--decode-repeat", type=int, default=2,
                    help="runs of each 8- and 32-stream decode (a median)")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--cache-bytes", default="16GiB")
    ap.add_argument("--max-batch", type=int, default=0, help="kvroute's (0: its default)")
    ap.add_argument("--max-prompt-tokens", type=int, default=0, help="kvroute's (0: its default)")
    ap.add_argument("--prefill-step", type=int, default=0, help="kvroute's (0: by platform)")
    ap.add_argument("--raw-prefill-step", type=int, default=2048)
    ap.add_argument("--agent-system", type=int, default=6000, help="system prompt tokens")
    ap.add_argument("--logs", default="/tmp/kvroute-bench-hw")
    ap.add_argument("--results", default="", help="folder of each part's JSON (default: --logs)")
    ap.add_argument("--out", help="also write the report (markdown) here")
    ap.add_argument("--profile", default="",
                    help="a folder: py-spy samples each backend's threads during the turns 2, decodes and agents")
    ap.add_argument("--paired-repeat", type=int, default=5,
                    help="rounds of the paired parts (paired: 1, 8 and 32 streams on all three; "
                         "tier: a turn 2, the agents, 1 and 8 streams on both)")
    ap.add_argument("--raw-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--raw-serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--raw-memory-limit", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.sizes = [int(x) for x in str(args.sizes).split(",")]
    if args.raw_child or args.raw_serve:
        if args.raw_child:
            raw_main(args)
        else:
            raw_serve(args)
        # As `kvroute backend` does: an abort at exit would fail the part.
        exit_skipping_teardown()
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    results = Path(args.results or logs)
    results.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(args.model)
    t0 = time.perf_counter()
    runners = {"raw": lambda: run_raw(args, tok, logs),
               "mlx-server": lambda: run_mlx_server(args, tok, logs),
               "kvroute": lambda: run_kvroute(args, tok, logs, disk=True),
               "no-disk": lambda: run_kvroute(args, tok, logs, disk=False),
               "defaults": lambda: run_defaults(args, logs),
               "paired": lambda: run_paired(args, tok, logs),
               "tier": lambda: run_tier(args, tok, logs)}
    for part in [p for p in args.parts.split(",") if p]:
        if part not in runners:
            ap.error(f"--parts: unknown part {part!r} (one of {', '.join(PARTS)})")
        got = runners[part]()
        (results / f"{part}.json").write_text(json.dumps(got, default=str))
        print(f"{part}:", json.dumps(got, default=str), flush=True)
    found = {p: json.loads((results / f"{p}.json").read_text()) for p in PARTS
             if (results / f"{p}.json").exists()}
    text = (f"command: {command_line()}\n"
            f"machine: {platform.machine()} {platform.system()} {platform.release()}, "
            f"python {platform.python_version()}; {time.strftime('%Y-%m-%d')}; "
            f"this call took {time.perf_counter() - t0:.0f}s\n\n" + report(args, found))
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()

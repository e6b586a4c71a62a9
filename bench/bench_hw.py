"""kvroute at the speed of the hardware: the whole stack against raw mlx-lm, one run.

Three parts, one after the other on the same machine and model:

1. raw mlx-lm (`generate_step`, one sequence, in a child process): cold time to
   first token at each size, the second turn on a cached --turn2 prompt (the
   suffix's prefill plus one step), and single-stream decode;
2. mlx-lm's own server (`python -m mlx_lm server`): decode at 1 and 8 streams;
3. kvroute: an embedded redis-server, --replicas backends (on a GPU each capped
   at its share of the card's memory) and two proxies on the same backends,
   cache-aware and round-robin. Through the cache-aware proxy: the first request
   after /health against the tenth, cold TTFT at each size, the second turn on a
   cached prompt, decode at 1 and 8 streams (8 streams also on one backend directly:
   through the proxy they are spread over the replicas, which share one device,
   where mlx-lm's server batches them in one process); then the agent workload (8
   agents x 4 turns, shared 6k-token system prompts) through each proxy.

Ratios are kvroute / raw (time) or kvroute / reference (throughput). Prompts are
random words of the model's tokenizer; a random-weight model never emits EOS.

    python -m bench.models /tmp/m7b                    # a 7B-class random model (GPU)
    python -m bench.bench_hw --model /tmp/m7b --out BENCH.md
    python -m bench.models /tmp/mcpu --preset cpu      # CPU: a smaller one
    python -m bench.bench_hw --model /tmp/mcpu --sizes 1024,2048,4096 --turn2 4000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from bench.command import command_line
from kvroute.core import accel
from kvroute.serve.redis_server import RedisServer, free_port
from tests.harness import ROOT, metric_sum, request

SECRET = "bench-hw"


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


def load_tokenizer(model: str):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))

    class T:
        def encode(self, s: str) -> list[int]:
            return tok.encode(s, add_special_tokens=False).ids

        def decode(self, ids: list[int]) -> str:
            return tok.decode(ids)

    return T()


# -- part 1: raw mlx-lm ---------------------------------------------------------------


def raw_main(args) -> None:
    """In a child process: raw generate_step numbers, one JSON line on stdout."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = load(args.model)
    tok = load_tokenizer(args.model)
    step = args.raw_prefill_step

    def first_token(ids: list[int], cache=None) -> float:
        t0 = time.perf_counter()
        gen = generate_step(mx.array(ids), model, max_tokens=1, prompt_cache=cache,
                            prefill_step_size=step)
        next(gen)
        return time.perf_counter() - t0

    first_token(tok.encode(text_of(tok, min(2100, max(args.sizes)), 1)))  # compile kernels
    out: dict = {"cold": {}}
    for size in args.sizes:
        times = [first_token(tok.encode(text_of(tok, size, 100 + size + r)))
                 for r in range(args.repeat)]
        out["cold"][size] = statistics.median(times)
        mx.clear_cache()
    turn1 = text_of(tok, args.turn2, 7)
    turn2 = turn1 + "\n\n" + text_of(tok, 60, 8)
    times = []
    for _ in range(args.repeat):
        a, b = tok.encode(turn1), tok.encode(turn2)
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        cache = make_prompt_cache(model)
        first_token(a, cache)  # the cache now holds turn 1's prompt
        for c in cache:
            c.trim(c.offset - common)
        times.append(first_token(b[common:], cache))
        del cache
        mx.clear_cache()
    out["turn2"] = statistics.median(times)
    gen = generate_step(mx.array(tok.encode(text_of(tok, 64, 9))), model, max_tokens=args.decode)
    stamps = [time.perf_counter() for _ in gen]
    out["decode1"] = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    print("RAW " + json.dumps(out), flush=True)


def run_raw(args) -> dict:
    cmd = [sys.executable, "-m", "bench.bench_hw", "--raw-child", "--model", args.model,
           "--sizes", ",".join(map(str, args.sizes)), "--turn2", str(args.turn2),
           "--repeat", str(args.repeat), "--decode", str(args.decode),
           "--raw-prefill-step", str(args.raw_prefill_step)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=ROOT)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RAW ")]
    if proc.returncode or not line:
        raise RuntimeError(f"raw mlx-lm run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    raw = json.loads(line[-1][4:])
    raw["cold"] = {int(k): v for k, v in raw["cold"].items()}
    return raw


# -- HTTP measurements -----------------------------------------------------------------


async def stream(session: aiohttp.ClientSession, url: str, path: str, body: dict,
                 ) -> tuple[float, list[float], dict, str]:
    """(time to first token, token arrival times, usage, text) of one streamed request."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps: list[float] = []
    usage: dict = {}
    text: list[str] = []
    async with session.post(url + path, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}{path}: {resp.status} {(await resp.text())[:300]}")
        usage["route"] = {k[len("x-kvroute-"):]: v for k, v in resp.headers.items()
                          if k.lower() in ("x-kvroute-backend", "x-kvroute-prefix-blocks",
                                           "x-kvroute-route-reason")}
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = {**event["usage"], "route": usage.get("route")}
            for choice in event.get("choices") or []:
                piece = choice.get("text") or (choice.get("delta") or {}).get("content")
                if piece:
                    stamps.append(time.perf_counter())
                    text.append(piece)
    if not stamps:
        raise RuntimeError(f"{url}{path}: no tokens")
    return stamps[0] - t0, stamps, usage, "".join(text)


def engine_ttft_sum(backends: list) -> float:
    """Sum of every backend's engine-side TTFT histogram (seconds)."""
    return sum(metric_sum(request(b.url + "/metrics")[2].decode(),
                          "kvroute_backend_ttft_seconds_sum") for b in backends)


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800))


async def decode_rate(url: str, model: str, tok, streams: int, n: int, seed: int) -> float:
    """Aggregate generated tokens/s of `streams` concurrent requests, from the
    first token of any to the last of all (prefill excluded)."""
    async with _session() as s:
        results = await asyncio.gather(*(
            stream(s, url, "/v1/completions",
                   {"model": model, "prompt": text_of(tok, 64, seed + i), "max_tokens": n,
                    "temperature": 0})
            for i in range(streams)))
    first = min(r[1][0] for r in results)
    last = max(r[1][-1] for r in results)
    return sum(len(r[1]) - 1 for r in results) / (last - first)


async def ttft(url: str, model: str, prompt: str, max_tokens: int = 2) -> tuple[float, dict]:
    async with _session() as s:
        t, _, usage, _ = await stream(s, url, "/v1/completions",
                                      {"model": model, "prompt": prompt,
                                       "max_tokens": max_tokens, "temperature": 0})
    return t, usage


async def chat(url: str, messages: list[dict], max_tokens: int) -> tuple[float, dict, str]:
    async with _session() as s:
        t, _, usage, text = await stream(s, url, "/v1/chat/completions",
                                         {"model": "m", "messages": messages,
                                          "max_tokens": max_tokens, "temperature": 0})
    return t, usage, text


def ttft_s(*a, **kw) -> tuple[float, dict]:
    return asyncio.run(ttft(*a, **kw))


async def agents(url: str, model: str, tok, seed: int, system: int) -> dict:
    """8 agents x 4 turns; 4 system prompts of `system` tokens, each shared by two agents."""
    systems = [text_of(tok, system, seed + k) for k in range(4)]
    ttfts: list[float] = []
    totals = {"prompt": 0, "cached": 0}

    async def agent(i: int, s: aiohttp.ClientSession) -> None:
        messages = [{"role": "system", "content": systems[i % 4]}]
        for turn in range(4):
            messages.append({"role": "user", "content": text_of(tok, 120, seed + 100 * i + turn)})
            t, _, usage, text = await stream(s, url, "/v1/chat/completions",
                                             {"model": model, "messages": messages,
                                              "max_tokens": 48, "temperature": 0})
            if turn:
                ttfts.append(t)
            totals["prompt"] += usage.get("prompt_tokens", 0)
            totals["cached"] += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            messages.append({"role": "assistant", "content": text})

    async with _session() as s:
        await asyncio.gather(*(agent(i, s) for i in range(8)))
    return {"hit_ratio": totals["cached"] / max(totals["prompt"], 1),
            "ttft_turns_2_4": statistics.mean(ttfts)}


# -- processes ---------------------------------------------------------------------------


class Proc:
    def __init__(self, name: str, cmd: list[str], url: str, logs: Path, env: dict | None = None):
        self.name, self.url = name, url
        self.log = logs / f"{name}.log"
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, cwd=ROOT)
        self.started = time.perf_counter()

    def wait_ready(self, path: str = "/health", timeout: float = 900.0) -> float:
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}: "
                                   f"{self.log.read_text(errors='replace')[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + path, timeout=2) as r:
                    if r.status == 200:
                        return time.perf_counter() - self.started
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f}s")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def run_mlx_server(args, tok, logs: Path) -> dict:
    port = free_port()
    server = Proc("mlx-lm-server", [sys.executable, "-m", "mlx_lm", "server", "--model",
                                    args.model, "--port", str(port), "--max-tokens", "512"],
                  f"http://127.0.0.1:{port}", logs)
    try:
        server.wait_ready("/v1/models")
        url = server.url
        # Warm-up (kernels), then measure as for kvroute.
        asyncio.run(decode_rate(url, args.model, tok, 8, 16, 5000))
        out = {"decode1": asyncio.run(decode_rate(url, args.model, tok, 1, args.decode, 5100)),
               "decode8": asyncio.run(decode_rate(url, args.model, tok, 8, args.decode, 5200))}
    finally:
        server.stop()
    return out


def progress(out: dict) -> None:
    # A run cut short by a time limit still shows what it measured.
    print("kvroute so far:", json.dumps(out, default=str), flush=True)


def run_kvroute(args, tok, logs: Path) -> dict:
    device = accel.probe()
    redis = RedisServer()
    redis.start()
    procs: list[Proc] = []
    out: dict = {"device": f"{device.kind} {device.name}", "exit_codes": []}
    try:
        env = {"KVROUTE_SECRET": SECRET, "KVROUTE_REDIS_URL": redis.url}
        limit = []
        if device.kind != "cpu":
            # Two replicas on one card: each capped so that together they stay well
            # under its memory (what `kvroute serve` does by itself).
            share = int(device.memory * 0.85) // args.replicas
            limit = ["--memory-limit", str(share)]
            out["memory_limit_each"] = share
            out["device_memory"] = device.memory
        backends = []
        for r in range(args.replicas):
            port = free_port()
            backends.append(Proc(f"backend-{r + 1}", [
                sys.executable, "-m", "kvroute.cli", "backend", "--model", args.model,
                "--model-id", "m", "--port", str(port), "--id", f"b{r + 1}",
                "--cache-bytes", args.cache_bytes, *limit,
                *(["--prefill-step", str(args.prefill_step)] if args.prefill_step else []),
            ], f"http://127.0.0.1:{port}", logs, env))
        procs += backends
        out["ready_s"] = [round(b.wait_ready(), 1) for b in backends]
        proxies = {}
        for policy in ("cache-aware", "round-robin"):
            port = free_port()
            proxies[policy] = Proc(f"proxy-{policy}", [
                sys.executable, "-m", "kvroute.cli", "proxy", "--port", str(port),
                "--policy", policy], f"http://127.0.0.1:{port}", logs, env)
            procs.append(proxies[policy])
        for p in proxies.values():
            p.wait_ready()
        time.sleep(1.5)  # the proxies see both backends' heartbeats
        url = proxies["cache-aware"].url
        import urllib.request

        health = json.loads(urllib.request.urlopen(backends[0].url + "/health").read())
        out["warmup_s"] = health["device"].get("warmup_s")
        out["prefill_step"] = health["device"].get("prefill_step")

        n = min(2048, max(args.sizes))
        firsts, engine_firsts = [], []
        for i in range(10):
            before = engine_ttft_sum(backends)
            firsts.append(ttft_s(url, "m", text_of(tok, n, 9000 + i))[0])
            engine_firsts.append(round(engine_ttft_sum(backends) - before, 3))
        out["first_vs_tenth"] = (firsts[0], firsts[-1])
        # The backend's own submit-to-first-token: what of the first request's extra
        # time is the engine's (kernels), what HTTP, templates and routing.
        out["first_ttfts"] = [round(f, 3) for f in firsts]
        out["first_engine_ttfts"] = engine_firsts
        out["cold"] = {}
        for size in args.sizes:
            times = [ttft_s(url, "m", text_of(tok, size, 100 + size + r))[0]
                     for r in range(args.repeat)]
            out["cold"][size] = statistics.median(times)
            progress(out)
        times = []
        for r in range(args.repeat):
            # A conversation, as agents send it: turn 2 is turn 1's messages, the reply
            # and a new user message (a chat prefix is a whole-block prefix of the
            # next turn's key chain; a completions prompt extended by text is not).
            messages = [{"role": "user", "content": text_of(tok, args.turn2, 70 + r)}]
            _, _, reply = asyncio.run(chat(url, messages, 1))
            messages += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": text_of(tok, 60, 8)}]
            t, usage, _ = asyncio.run(chat(url, messages, 2))
            times.append(t)
            out["turn2_cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            out["turn2_prompt_tokens"] = usage.get("prompt_tokens")
            out["turn2_route"] = usage.get("route")  # which backend, matched blocks, why
        out["turn2"] = statistics.median(times)
        progress(out)
        asyncio.run(decode_rate(url, "m", tok, 8, 16, 6000))
        out["decode1"] = asyncio.run(decode_rate(url, "m", tok, 1, args.decode, 6100))
        out["decode8"] = asyncio.run(decode_rate(url, "m", tok, 8, args.decode, 6200))
        # Through the proxy the 8 streams are spread over the replicas, which share one
        # device; mlx-lm's server batches all 8 in one process: so does one backend.
        out["decode8_one"] = asyncio.run(decode_rate(backends[0].url, "m", tok, 8, args.decode,
                                                     6300))
        progress(out)
        if not args.skip_agents:
            out["agents"] = {p: asyncio.run(agents(proxies[p].url, "m", tok, 20000 + 1000 * k,
                                                    args.agent_system))
                             for k, p in enumerate(("cache-aware", "round-robin"))}
    finally:
        for p in procs:
            code = p.stop()
            if p.name.startswith("backend"):
                out["exit_codes"].append(code)
        redis.stop()
    return out


# -- report -------------------------------------------------------------------------------


def report(args, raw: dict, ref: dict | None, kv: dict) -> str:
    rows = [("what", "kvroute", "baseline", "ratio", "goal")]

    def add(what, mine, base, fmt, goal, time_like=True):
        ratio = (mine / base) if time_like else (mine / base)
        rows.append((what, fmt(mine), fmt(base), f"{ratio:.2f}x", goal))

    secs = lambda v: f"{v:.3f} s"  # noqa: E731
    rate = lambda v: f"{v:.0f} tok/s"  # noqa: E731
    for size in args.sizes:
        add(f"cold TTFT {size} tokens (vs raw generate_step)", kv["cold"][size], raw["cold"][size],
            secs, "<= 1.3x" if size == max(args.sizes) else "")
    add(f"turn-2 TTFT, {args.turn2}-token cached prompt (vs raw)", kv["turn2"], raw["turn2"], secs,
        "<= 2x")
    add("decode 1 stream (vs raw)", kv["decode1"], raw["decode1"], rate, ">= 0.85x", False)
    if ref:
        add("decode 1 stream (vs mlx-lm server)", kv["decode1"], ref["decode1"], rate, "", False)
        add("decode 8 streams, one backend (vs mlx-lm server, one process)", kv["decode8_one"],
            ref["decode8"], rate, ">= 1.3x", False)
        add(f"decode 8 streams via the proxy, {args.replicas} replicas on one device "
            "(vs mlx-lm server)", kv["decode8"], ref["decode8"], rate, "", False)
    else:
        rows.append(("decode 8 streams, one backend", rate(kv["decode8_one"]), "", "", ""))
        rows.append((f"decode 8 streams via the proxy, {args.replicas} replicas",
                     rate(kv["decode8"]), "", "", ""))
    f, t = kv["first_vs_tenth"]
    add("first request after /health vs the tenth (cold)", f, t, secs, "~1x")
    lines = [f"| {' | '.join(r)} |" for r in rows]
    lines.insert(1, "|" + "---|" * len(rows[0]))
    text = "\n".join(lines)
    if "agents" in kv:
        a = kv["agents"]
        text += (f"\n\n| agent workload (8 agents x 4 turns, {args.agent_system}-token system "
                 "prompts) | hit ratio | "
                 "turns 2-4 mean TTFT |\n|---|---|---|\n")
        for policy, r in a.items():
            text += f"| {policy} | {r['hit_ratio']:.3f} | {r['ttft_turns_2_4']:.3f} s |\n"
    extra = {k: kv.get(k) for k in ("device", "ready_s", "warmup_s", "prefill_step",
                                    "memory_limit_each", "device_memory", "exit_codes",
                                    "turn2_prompt_tokens", "turn2_cached_tokens", "turn2_route",
                                    "first_ttfts", "first_engine_ttfts")}
    text += "\n\n" + ", ".join(f"{k}: {v}" for k, v in extra.items() if v is not None)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_hw", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="model directory (python -m bench.models makes one)")
    ap.add_argument("--sizes", default="4096,16384,32768", help="cold prompt sizes (tokens)")
    ap.add_argument("--turn2", type=int, default=31000, help="cached prompt of the second turn")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--decode", type=int, default=256, help="tokens per decode stream")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--cache-bytes", default="16GiB")
    ap.add_argument("--prefill-step", type=int, default=0, help="kvroute's (0: by platform)")
    ap.add_argument("--raw-prefill-step", type=int, default=2048)
    ap.add_argument("--agent-system", type=int, default=6000, help="system prompt tokens")
    ap.add_argument("--skip-mlx-server", action="store_true")
    ap.add_argument("--skip-agents", action="store_true")
    ap.add_argument("--logs", default="/tmp/kvroute-bench-hw")
    ap.add_argument("--out", help="also write the tables (markdown) here")
    ap.add_argument("--raw-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.sizes = [int(x) for x in str(args.sizes).split(",")]
    if args.raw_child:
        raw_main(args)
        return
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(args.model)
    t0 = time.perf_counter()
    raw = run_raw(args)
    print("raw:", json.dumps(raw), flush=True)
    ref = None if args.skip_mlx_server else run_mlx_server(args, tok, logs)
    print("mlx-lm server:", json.dumps(ref), flush=True)
    kv = run_kvroute(args, tok, logs)
    print("kvroute:", json.dumps(kv, default=str), flush=True)
    text = (f"command: {command_line()}\n"
            f"machine: {platform.machine()} {platform.system()} {platform.release()}, "
            f"python {platform.python_version()}; took {time.perf_counter() - t0:.0f}s\n\n"
            + report(args, raw, ref, kv))
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()

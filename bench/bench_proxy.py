"""The proxy's added latency and peak throughput, against a fake instant backend.

A fake backend (aiohttp, answers at once: a whole chat completion, or a short
SSE stream) is registered in a real redis-server with the conversation's prefix
keys advertised, so each proxied request does the real work: parse, chain,
one Lua lookup, policy, pending mark, pass-through. The proxy runs pinned to one
core (`taskset`), the load generator and the fake backend on the other.

For each mode (whole, streaming) it paces requests at --rate per second, first
straight to the fake backend (the baseline), then through the proxy, and reports
latency percentiles of both and their difference (the proxy's added latency);
also the proxy's own pre-forward work from its /metrics (parse, chain, lookup, choice;
its mean includes waiting for Redis) and, of it, the registry lookup's wait; then it
runs closed-loop with --concurrency workers for the peak requests/s, and divides the
proxy process's CPU time over that run by the requests it served (CPU µs per
request: on a machine shared with other work, steadier than latencies).

    python -m bench.bench_proxy [--rate 200] [--seconds 10] [--concurrency 32] [--modes whole,streaming]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import subprocess
import sys
import time

import aiohttp
import orjson
import psutil
from rich.console import Console
from rich.table import Table

from bench.command import command_line
from kvroute.core import prefix
from kvroute.core.registry import BackendRecord, Registry, new_instance_id
from kvroute.serve.redis_server import RedisServer
from tests.harness import free_port, metric_sum, request, wait_until

SECRET = "bench"
MODEL = "fake"

FAKE_BACKEND = r'''
import sys, orjson
from aiohttp import web
WHOLE = orjson.dumps({"id": "chatcmpl-x", "object": "chat.completion", "created": 0, "model": "fake",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 300, "completion_tokens": 1, "total_tokens": 301,
              "prompt_tokens_details": {"cached_tokens": 290}}})
CHUNK = b'data: {"id":"chatcmpl-x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"ok"}}]}\n\n'
async def chat(request):
    body = orjson.loads(await request.read())
    headers = {"x-kvroute-cached-tokens": "290", "x-kvroute-prompt-tokens": "300"}
    if not body.get("stream"):
        return web.Response(body=WHOLE, content_type="application/json", headers=headers)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **headers})
    await resp.prepare(request)
    for _ in range(4):
        await resp.write(CHUNK)
    await resp.write(b"data: [DONE]\n\n")
    return resp
app = web.Application()
app.router.add_post("/v1/chat/completions", chat)
app.router.add_get("/health", lambda r: web.json_response({"status": "ok"}))
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
'''


def conversation(i: int) -> dict:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are a careful assistant for a team of engineers. " * 12},
            {"role": "user", "content": f"Conversation {i % 16}: how do we ship this?"},
            {"role": "assistant", "content": "Step by step, with tests. " * 8},
            {"role": "user", "content": "And then?"},
        ],
    }


def pinned(cmd: list[str], core: int) -> list[str]:
    return ["taskset", "-c", str(core), *cmd] if shutil.which("taskset") else cmd


async def register(redis_url: str, url: str, stop: asyncio.Event) -> None:
    reg = Registry(redis_url)
    record = BackendRecord(backend_id="fake", instance_id=new_instance_id(), url=url,
                           models=[MODEL], prefill_tps=5000.0,
                           **prefix.fingerprint(SECRET, prefix.DEFAULT_BLOCK_BYTES))
    salt = prefix.make_salt(SECRET)
    for i in range(16):
        keys = prefix.chat_chain(conversation(i), model=MODEL, salt=salt)
        await reg.heartbeat(record)
        await reg.advertise("fake", record.instance_id, MODEL, keys)
    while not stop.is_set():
        await reg.heartbeat(record)
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass
    await reg.close()


async def one(session: aiohttp.ClientSession, url: str, body: bytes) -> float:
    t0 = time.perf_counter()
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"status {r.status}")
    return time.perf_counter() - t0


def pre_forward(proxy_url: str) -> tuple[float, float, float]:
    """(sum, count) of the proxy's own pre-forward work (kvroute_proxy_overhead_seconds:
    parse, chain, lookup, choice), and the sum of its registry lookups' waits, from its
    /metrics."""
    text = request(proxy_url + "/metrics")[2].decode()
    return (metric_sum(text, "kvroute_proxy_overhead_seconds_sum"),
            metric_sum(text, "kvroute_proxy_overhead_seconds_count"),
            metric_sum(text, "kvroute_proxy_lookup_seconds_sum"))


async def paced(url: str, rate: float, seconds: float, stream: bool) -> list[float]:
    bodies = [orjson.dumps({**conversation(i), "stream": stream}) for i in range(16)]
    latencies: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = []
        start = time.perf_counter()
        n = int(rate * seconds)
        for i in range(n):
            # Open loop: send on schedule whatever the previous answers did.
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(session, url, bodies[i % 16])))
        latencies = await asyncio.gather(*tasks)
    return latencies


async def closed_loop(url: str, workers: int, seconds: float, stream: bool) -> tuple[float, int]:
    bodies = [orjson.dumps({**conversation(i), "stream": stream}) for i in range(16)]
    done = 0
    deadline = time.perf_counter() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def worker(w: int) -> None:
            nonlocal done
            i = w
            while time.perf_counter() < deadline:
                await one(session, url, bodies[i % 16])
                done += 1
                i += workers
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(workers)))
        elapsed = time.perf_counter() - t0
    return done / elapsed, done


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1000


async def main_async(args) -> None:
    console = Console()
    redis = RedisServer()
    redis.start()
    fake_port, proxy_port = free_port(), free_port()
    fake = subprocess.Popen(pinned([sys.executable, "-c", FAKE_BACKEND, str(fake_port)], 1))
    fake_url = f"http://127.0.0.1:{fake_port}"
    stop = asyncio.Event()
    reg_task = asyncio.create_task(register(redis.url, fake_url, stop))
    proxy = subprocess.Popen(pinned([sys.executable, "-m", "kvroute.cli", "proxy", "--redis-url",
                                     redis.url, "--secret", SECRET, "--port", str(proxy_port),
                                     "--log-level", "warning"], 0))
    proxy_url = f"http://127.0.0.1:{proxy_port}"
    try:
        await asyncio.to_thread(wait_until, lambda: request(fake_url + "/health")[0] == 200, 20)
        await asyncio.to_thread(
            wait_until, lambda: b'"fake"' in request(proxy_url + "/v1/models")[2], 20)
        table = Table(title=f"Proxy overhead: paced at {args.rate:.0f} req/s for {args.seconds:.0f} s, "
                      "fake instant backend, proxy on one core")
        for col in ("mode", "direct p50", "direct p99", "proxy p50", "proxy p99",
                    "added p50 (ms)", "added p99 (ms)", "pre-forward µs (mean)", "of it lookup µs",
                    "peak req/s (proxy, 1 core)", "proxy CPU µs/req"):
            table.add_column(col, justify="right")
        for stream in [m == "streaming" for m in args.modes.split(",")]:
            path = "/v1/chat/completions"
            await paced(proxy_url + path, args.rate, 2, stream)  # warm-up
            direct = await paced(fake_url + path, args.rate, args.seconds, stream)
            s0, n0, l0 = await asyncio.to_thread(pre_forward, proxy_url)
            proxied = await paced(proxy_url + path, args.rate, args.seconds, stream)
            s1, n1, l1 = await asyncio.to_thread(pre_forward, proxy_url)
            cpu0 = sum(psutil.Process(proxy.pid).cpu_times()[:2])
            peak, served = await closed_loop(proxy_url + path, args.concurrency, args.seconds,
                                             stream)
            cpu = sum(psutil.Process(proxy.pid).cpu_times()[:2]) - cpu0
            d50, d99, p50, p99 = (pct(direct, .5), pct(direct, .99), pct(proxied, .5),
                                  pct(proxied, .99))
            n = max(n1 - n0, 1)
            table.add_row("streaming" if stream else "whole", f"{d50:.2f}", f"{d99:.2f}",
                          f"{p50:.2f}", f"{p99:.2f}", f"{p50 - d50:.2f}", f"{p99 - d99:.2f}",
                          f"{(s1 - s0) / n * 1e6:.0f}", f"{(l1 - l0) / n * 1e6:.0f}",
                          f"{peak:.0f}", f"{cpu / max(served, 1) * 1e6:.0f}")
        console.print(f"command: {command_line()}")
        console.print(f"machine: {platform.machine()} {platform.system()}, {os.cpu_count()} cores, "
                      f"python {platform.python_version()}; latencies in ms, client side")
        console.print(table)
    finally:
        stop.set()
        await reg_task
        proxy.terminate()
        fake.terminate()
        proxy.wait(10)
        fake.wait(10)
        redis.stop()


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_proxy", description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=200.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--modes", default="whole,streaming", help="which of whole,streaming to run")
    args = ap.parse_args()
    if not set(args.modes.split(",")) <= {"whole", "streaming"}:
        ap.error(f"--modes takes whole and/or streaming, not {args.modes!r}")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()

"""Benchmark: registry lookup latency and prefix-chain cost.

Starts its own redis-server on a free port, registers backends, advertises chains
(plus background noise so Redis holds a realistic number of keys), then measures
end-to-end `Registry.lookup` latency from Python (hex packing, EVALSHA round trip,
record parsing) for 64- and 512-key chains, and the cost of computing the chain of
a 128 KB chat request. "Redis mean ms" is the script's own run time (INFO commandstats),
the rest is the client, the event loop and the loopback round trip.

Bursts: N lookups issued at once (as N requests arriving together), coalesced into
pipelines by `Registry.lookup` vs one EVALSHA call each (what the client did before),
and, for scale, the same depths computed from an in-process dict of sets (what an
in-proxy index fed by a stream of insert/evict events would answer from).

    python -m bench.bench_lookup [--backends 16] [--iterations 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import statistics
import time
from pathlib import Path

import orjson
import redis
import redis.asyncio as aioredis
from rich.console import Console
from rich.table import Table

from bench.command import command_line
from kvroute.core.prefix import chat_chain, make_salt
from kvroute.core.registry import BackendRecord, Registry
from kvroute.serve.redis_server import RedisServer

MODEL = "mlx-community/Qwen2.5-7B-Instruct-4bit"
console = Console(width=120)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def random_chain(rng: random.Random, n: int) -> list[int]:
    return [rng.getrandbits(64) for _ in range(n)]


def percentile(sorted_values: list[float], q: float) -> float:
    i = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[i]


def big_request(target_bytes: int = 128 * 1024) -> dict:
    msgs = [{"role": "system", "content": "You are a helpful assistant."}]
    turn = "The quick brown fox jumps over the lazy dog. " * 90  # ~4 KB per turn
    i = 0
    while sum(len(m["content"]) for m in msgs) < target_bytes:
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": f"{i}: {turn}"})
        i += 1
    return {"messages": msgs}


async def setup(reg: Registry, n_backends: int, noise_chains: int, rng: random.Random):
    records = []
    for i in range(n_backends):
        rec = BackendRecord(
            backend_id=f"backend-{i:02d}", instance_id=f"inst-{i:02d}-{rng.getrandbits(32):08x}",
            url=f"http://127.0.0.1:{9000 + i}", models=[MODEL], cache_bytes=rng.getrandbits(30),
            cache_budget=1 << 34, waiting=rng.randrange(8), prefill_tps=800.0 + i,
            started_at=time.time(),
        )
        await reg.heartbeat(rec)
        records.append(rec)
    # Background: each backend holds many unrelated conversations.
    n_keys = 0
    for rec in records:
        for _ in range(noise_chains):
            chain = random_chain(rng, rng.randrange(8, 513))
            n_keys += len(chain)
            await reg.advertise(rec.backend_id, rec.instance_id, MODEL, chain)
    return records, n_keys


async def time_lookups(reg: Registry, chain: list[int], iterations: int, expect: dict[str, int]) -> list[float]:
    found = await reg.lookup(MODEL, chain)
    assert found is not None, "lookup failed"
    got = {b: m.depth for b, m in found.items()}
    assert got == expect, f"unexpected depths: {got} != {expect}"
    for _ in range(min(200, iterations)):  # warm up connections and the script cache
        await reg.lookup(MODEL, chain)
    out = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        found = await reg.lookup(MODEL, chain)
        out.append(time.perf_counter() - t0)
        assert found is not None
    return out


async def main(args) -> None:
    rng = random.Random(42)
    console.print(f"[bold]command:[/bold] {command_line()}")
    with RedisServer() as server:
        info = redis.Redis(port=server.port).info("server")
        console.print(
            f"[bold]machine:[/bold] {platform.platform()} | {cpu_model()} | {os.cpu_count()} cores | "
            f"Python {platform.python_version()} | redis-server {info['redis_version']} | "
            f"redis-py {redis.__version__} (hiredis: {redis.utils.HIREDIS_AVAILABLE})"
        )
        # Generous deadlines: the benchmark measures latency, not the fallback.
        reg = Registry(server.url, lookup_timeout=5.0, record_ttl=3600, op_timeout=30)
        t0 = time.perf_counter()
        records, noise_keys = await setup(reg, args.backends, args.noise_chains, rng)
        raw = aioredis.from_url(server.url)
        dbsize = await raw.dbsize()
        console.print(
            f"[bold]setup:[/bold] {len(records)} backends, {noise_keys} background keys advertised "
            f"({dbsize} Redis keys) in {time.perf_counter() - t0:.1f} s"
        )

        rows = []
        for n in (64, 512):
            full = random_chain(rng, n)
            for rec in records:  # worst case: every backend holds the whole chain
                await reg.advertise(rec.backend_id, rec.instance_id, MODEL, full)
            stagger = random_chain(rng, n)
            depths = [rng.randrange(n + 1) for _ in records]  # each backend stops somewhere else
            for d, rec in zip(depths, records):
                await reg.advertise(rec.backend_id, rec.instance_id, MODEL, stagger[:d])
            lone = random_chain(rng, n)
            await reg.advertise(records[0].backend_id, records[0].instance_id, MODEL, lone)
            miss = random_chain(rng, n)
            cases = [
                (f"all {len(records)} hold all {n}", full, {r.backend_id: n for r in records}),
                ("random depths, 0..all", stagger, {r.backend_id: d for d, r in zip(depths, records)}),
                ("one holds all, rest 0", lone, {r.backend_id: (n if i == 0 else 0) for i, r in enumerate(records)}),
                ("miss (no backend)", miss, {r.backend_id: 0 for r in records}),
            ]
            for label, chain, expect in cases:
                await raw.config_resetstat()
                lat = sorted(await time_lookups(reg, chain, args.iterations, expect))
                stats = await raw.info("commandstats")
                server_us = stats.get("cmdstat_evalsha", {}).get("usec_per_call", float("nan"))
                rows.append((f"{n}", label, lat, server_us))
        bursts = await burst_rows(reg, raw, records, rng)
        await reg.close()
        await raw.aclose()
    print_bursts(bursts)

    table = Table(title=f"Registry.lookup latency ({args.iterations} sequential lookups each, loopback)")
    for col in ("chain keys", "case", "p50 ms", "p99 ms", "max ms", "mean ms", "lookups/s", "Redis mean ms"):
        table.add_column(col, justify="right" if col not in ("case",) else "left")
    for n, label, lat, server_us in rows:
        p99 = percentile(lat, 0.99) * 1e3
        table.add_row(
            n, label, f"{percentile(lat, 0.5) * 1e3:.3f}",
            f"[{'green' if p99 < 1 else 'red'}]{p99:.3f}[/]",
            f"{lat[-1] * 1e3:.3f}", f"{statistics.fmean(lat) * 1e3:.3f}",
            f"{1 / statistics.fmean(lat):,.0f}", f"{server_us / 1e3:.3f}",
        )
    console.print(table)

    body = big_request()
    salt = make_salt("bench-secret", "tenant")
    size = len(orjson.dumps(body))
    chat_chain(body, model=MODEL, salt=salt)
    times = []
    for _ in range(args.chain_iterations):
        t0 = time.perf_counter()
        keys = chat_chain(body, model=MODEL, salt=salt)
        times.append(time.perf_counter() - t0)
    times.sort()
    t2 = Table(title="Prefix chain computation")
    for col in ("request", "keys", "p50 ms", "p99 ms", "mean ms"):
        t2.add_column(col, justify="right")
    t2.add_row(f"{size / 1024:.0f} KB chat, {len(body['messages'])} messages", str(len(keys)),
               f"{percentile(times, 0.5) * 1e3:.3f}", f"{percentile(times, 0.99) * 1e3:.3f}",
               f"{statistics.fmean(times) * 1e3:.3f}")
    console.print(t2)


async def burst_rows(reg: Registry, raw, records, rng: random.Random) -> list[tuple]:
    from kvroute.core.redis_keys import chain_hex, model_tag
    from kvroute.core.registry import _SCRIPTS

    chain = random_chain(rng, 64)
    depths = [rng.randrange(65) for _ in records]
    for d, rec in zip(depths, records):
        await reg.advertise(rec.backend_id, rec.instance_id, MODEL, chain[:d])
    tag = model_tag(MODEL)
    script = raw.register_script(_SCRIPTS["lookup"])
    await script(keys=[tag + "backends"], args=[tag, chain_hex(chain)])

    async def timed(aw) -> float | None:
        """Seconds to an answer; None when the lookup failed or answered "unknown"."""
        t0 = time.perf_counter()
        try:
            ok = await aw is not None
        except Exception:  # e.g. the client's connection pool is exhausted
            ok = False
        return time.perf_counter() - t0 if ok else None

    rows = []
    for n in (1, 50, 200):
        for label, make in (
            ("coalesced (Registry.lookup)", lambda: reg.lookup(MODEL, chain)),
            ("one EVALSHA each", lambda: script(keys=[tag + "backends"], args=[tag, chain_hex(chain)])),
        ):
            lat, walls, failed = [], [], 0
            for _ in range(max(3, 600 // n)):
                t0 = time.perf_counter()
                got = await asyncio.gather(*(timed(make()) for _ in range(n)))
                walls.append(time.perf_counter() - t0)
                lat += [x for x in got if x is not None]
                failed += sum(x is None for x in got)
            rows.append((n, label, sorted(lat), statistics.median(walls), failed / (len(lat) + failed)))
    # The in-process alternative: key -> set of holders, walked key by key.
    index = {k: {r.backend_id for d, r in zip(depths, records) if i < d} for i, k in enumerate(chain)}
    lat = []
    for _ in range(3000):
        t0 = time.perf_counter()
        alive = {r.backend_id for r in records}
        found = dict.fromkeys(alive, 0)
        for i, k in enumerate(chain):
            alive &= index.get(k, set())
            if not alive:
                break
            for b in alive:
                found[b] = i + 1
        lat.append(time.perf_counter() - t0)
    assert found == {r.backend_id: d for d, r in zip(depths, records)}
    rows.append((1, "in-process index (dict of sets)", sorted(lat), statistics.median(lat), 0.0))
    return rows


def print_bursts(rows: list[tuple]) -> None:
    table = Table(title="Lookup bursts: 64-key chain, 16 backends at random depths")
    for col in ("burst", "how", "p50 ms", "p99 ms", "burst wall ms", "failed"):
        table.add_column(col, justify="left" if col == "how" else "right")
    for n, label, lat, wall, failed in rows:
        table.add_row(str(n), label, f"{percentile(lat, 0.5) * 1e3:.3f}",
                      f"{percentile(lat, 0.99) * 1e3:.3f}", f"{wall * 1e3:.2f}", f"{failed:.0%}")
    console.print(table)


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m bench.bench_lookup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", type=int, default=16)
    p.add_argument("--iterations", type=int, default=3000, help="lookups per case")
    p.add_argument("--noise-chains", type=int, default=100, help="background chains per backend")
    p.add_argument("--chain-iterations", type=int, default=500)
    asyncio.run(main(p.parse_args()))

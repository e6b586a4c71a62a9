"""The Redis registry client, against a real redis-server started per test."""

from __future__ import annotations

import asyncio
import random
import shutil
import subprocess
import time

import pytest
import redis.asyncio as aioredis

from kvroute.core.prefix import chat_chain, make_salt
from kvroute.serve.redis_server import RedisServer, free_port
from kvroute.core.registry import BackendRecord, Registry, RegistryUnavailable, new_instance_id

MODEL = "demo/model"
SALT = make_salt("registry-test")


@pytest.fixture
def server(redis_db):
    """An empty database of the session's Redis."""
    return redis_db


@pytest.fixture
def own_server():
    """A redis-server of the test's own: it stops, pauses it or flushes its scripts
    (every database's)."""
    with RedisServer() as s:
        yield s


def run(coro):
    return asyncio.run(coro)


async def poll(fn, *, deadline: float = 5.0, interval: float = 0.02, what: str = "condition"):
    """Await fn() until it returns something truthy, or fail after `deadline` seconds."""
    end = time.monotonic() + deadline
    while True:
        value = await fn()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {deadline}s waiting for {what}")
        await asyncio.sleep(interval)


def record(backend_id="b1", instance_id=None, models=(MODEL,)) -> BackendRecord:
    return BackendRecord(
        backend_id=backend_id,
        instance_id=instance_id or new_instance_id(),
        url=f"http://127.0.0.1:9/{backend_id}",
        models=list(models),
        cache_bytes=1 << 20,
        cache_budget=1 << 30,
        waiting=1,
        prefill_tps=1234.5,
        started_at=time.time(),
    )


def conv(n_turns: int, text: str = "some conversation text ") -> dict:
    msgs = [{"role": "system", "content": "You are a test."}]
    for i in range(n_turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": f"{i}: " + text * 20})
    return {"messages": msgs}


def chain_of(body) -> list[int]:
    return chat_chain(body, model=MODEL, salt=SALT)


# -- lookup ---------------------------------------------------------------------


def test_advertise_then_lookup_reports_shared_prefix_depth(server):
    async def main():
        reg = Registry(server.url)
        r1, r2 = record("b1"), record("b2")
        await reg.heartbeat(r1)
        await reg.heartbeat(r2)
        old = chain_of(conv(3))
        new = chain_of(conv(5))  # the same conversation, two turns later
        assert new[: len(old)] == old
        await reg.advertise("b1", r1.instance_id, MODEL, old)

        found = await reg.lookup(MODEL, new)
        assert set(found) == {"b1", "b2"}  # depth-0 backends are reported too
        assert found["b1"].depth == len(old) and found["b1"].marked_depth == len(old)
        assert found["b2"].depth == 0
        assert found["b1"].record == BackendRecord.from_json(found["b1"].record.to_json())
        assert found["b1"].record.prefill_tps == 1234.5 and found["b1"].record.updated_at > 0

        # A chain that diverges after the system prompt matches only that far.
        other = chain_of({"messages": conv(1)["messages"][:1] + [{"role": "user", "content": "x"}]})
        shared = len(chain_of({"messages": conv(1)["messages"][:1]}))
        assert (await reg.lookup(MODEL, other))["b1"].depth == shared
        assert (await reg.lookup(MODEL, [])) ["b1"].depth == 0
        assert await reg.lookup("unknown-model", new) == {}
        await reg.close()

    run(main())


def test_withdraw_drops_depth_to_what_remains(server):
    async def main():
        reg = Registry(server.url)
        r1 = record("b1")
        await reg.heartbeat(r1)
        chain = chain_of(conv(8))
        assert len(chain) > 10
        await reg.advertise("b1", r1.instance_id, MODEL, chain)
        assert (await reg.lookup(MODEL, chain))["b1"].depth == len(chain)
        await reg.withdraw("b1", r1.instance_id, MODEL, chain[6:])
        assert (await reg.lookup(MODEL, chain))["b1"].depth == 6
        # Depth counts contiguous keys from the start: a hole ends it.
        await reg.withdraw("b1", r1.instance_id, MODEL, chain[2:3])
        assert (await reg.lookup(MODEL, chain))["b1"].depth == 2
        await reg.close()

    run(main())


def _reference_depths(chain, held, marked, backends):
    """The definition, walked key by key: depth = leading keys held; pending also counts marks."""
    out = {}
    for b in backends:
        depth = next((x for x, k in enumerate(chain) if (b, k) not in held), len(chain))
        pend = next((x for x, k in enumerate(chain) if (b, k) not in held and (b, k) not in marked),
                    len(chain))
        out[b] = (depth, pend)
    return out


def test_lookup_matches_a_key_by_key_walk_with_holes_and_marks(server):
    """Random holdings with holes, pending marks and a dead instance: the chunked Lua
    walk must give exactly the key-by-key answer."""
    async def main():
        reg = Registry(server.url)
        rng = random.Random(7)
        backends = [f"b{i}" for i in range(6)]
        recs = {b: record(b) for b in backends}
        for rec in recs.values():
            await reg.heartbeat(rec)
        for trial in range(12):
            chain = [rng.getrandbits(64) for _ in range(rng.choice([1, 7, 64, 150, 300]))]
            held, marked = set(), set()
            for b in backends:
                rec = recs[b]
                n = rng.choice([0, 1, len(chain) // 3, rng.randrange(len(chain) + 1), len(chain)])
                await reg.advertise(b, rec.instance_id, MODEL, chain[:n])
                held |= {(b, k) for k in chain[:n]}
                holes = rng.sample(chain[:n], k=min(n, rng.choice([0, 0, 1, 3])))
                await reg.withdraw(b, rec.instance_id, MODEL, holes)
                held -= {(b, k) for k in holes}
                if rng.random() < 0.4:  # pending marks over a range, possibly bridging holes
                    lo = rng.randrange(len(chain))
                    hi = rng.randrange(lo, len(chain)) + 1
                    await reg.mark_route(MODEL, chain[lo:hi], b, ttl_ms=60_000)
                    marked |= {(b, k) for k in chain[lo:hi]}
            # A dead instance of b0 holding everything must not count.
            await reg.advertise("b0", "dead-instance", MODEL, chain)
            found = await reg.lookup(MODEL, chain)
            got = {b: (m.depth, m.marked_depth) for b, m in found.items()}
            assert got == _reference_depths(chain, held, marked, backends), f"trial {trial}"
            # Clean up this trial's state for the next one.
            for b in backends:
                await reg.withdraw(b, recs[b].instance_id, MODEL, chain)
        await reg.close()

    run(main())


def test_two_backends_two_depths_and_models_are_separate(server):
    async def main():
        reg = Registry(server.url)
        r1, r2 = record("b1", models=[MODEL, "other/model"]), record("b2")
        await reg.heartbeat(r1)
        await reg.heartbeat(r2)
        chain = chain_of(conv(6))
        await reg.advertise("b1", r1.instance_id, MODEL, chain[:3])
        await reg.advertise("b2", r2.instance_id, MODEL, chain)
        await reg.advertise("b1", r1.instance_id, "other/model", chain)
        found = await reg.lookup(MODEL, chain)
        assert (found["b1"].depth, found["b2"].depth) == (3, len(chain))
        other = await reg.lookup("other/model", chain)
        assert set(other) == {"b1"} and other["b1"].depth == len(chain)
        # Odd model names stay in their own hash tag and do not clash.
        await reg.heartbeat(record("b3", models=["we{ir}d model%"]))
        assert set(await reg.lookup("we{ir}d model%", chain)) == {"b3"}
        await reg.close()

    run(main())


def test_record_ttl_lapse_forgets_backend(server):
    async def main():
        reg = Registry(server.url, record_ttl=0.5)
        r1, r2 = record("b1"), record("b2")
        chain = chain_of(conv(2))
        await reg.heartbeat(r1)
        await reg.heartbeat(r2)
        await reg.advertise("b1", r1.instance_id, MODEL, chain)
        assert (await reg.lookup(MODEL, chain))["b1"].depth == len(chain)

        async def b1_gone():
            await reg.heartbeat(r2)  # b2 stays alive: only b1 (SIGKILLed, say) lapses
            found = await reg.lookup(MODEL, chain)
            return found is not None and "b1" not in found and "b2" in found

        # Its record lapses on its TTL alone (0.5 s): the deadline is generous, as a
        # record that never lapsed would fail it all the same.
        await poll(b1_gone, deadline=10.0, what="b1's record to lapse")
        assert [r.backend_id for r in await reg.live_backends()] == ["b2"]
        await reg.close()

    run(main())


def test_new_instance_never_inherits_advertisements(server):
    async def main():
        reg = Registry(server.url)
        old = record("b1", instance_id="first")
        chain = chain_of(conv(2))
        assert await reg.heartbeat(old) is False  # first beat: nothing there before
        assert await reg.heartbeat(old) is True
        await reg.advertise("b1", "first", MODEL, chain)
        assert (await reg.lookup(MODEL, chain))["b1"].depth == len(chain)

        new = record("b1", instance_id="second")  # same id, restarted process
        assert await reg.heartbeat(new) is False  # the record changed hands: re-advertise
        found = await reg.lookup(MODEL, chain)
        assert found["b1"].depth == 0 and found["b1"].record.instance_id == "second"
        # The old instance's clean shutdown must not remove the new one.
        await reg.withdraw_all("b1", "first")
        assert "b1" in await reg.lookup(MODEL, chain)
        await reg.close()

    run(main())


def test_each_tier_sees_that_redis_lost_its_keys(server):
    """A backend's RAM and disk publishers share one record. After Redis restarts
    empty, whichever beats first writes the record again: the other must still be
    told that its keys are gone (it used to find the record and never re-advertise)."""
    async def main():
        reg = Registry(server.url)
        rec = record("b1", instance_id="one")
        assert await reg.heartbeat(rec, "ram") is False
        assert await reg.heartbeat(rec, "disk") is False  # the record exists, its keys do not
        assert await reg.heartbeat(rec, "ram") is True and await reg.heartbeat(rec, "disk") is True
        await reg._redis.flushdb()  # Redis restarted empty
        assert await reg.heartbeat(rec, "disk") is False
        assert await reg.heartbeat(rec, "ram") is False  # though the disk beat rewrote the record
        await reg.close()

    run(main())


def test_withdraw_all_forgets_at_once(server):
    async def main():
        reg = Registry(server.url)
        r1 = record("b1", models=[MODEL, "other/model"])
        await reg.heartbeat(r1)
        chain = chain_of(conv(2))
        await reg.advertise("b1", r1.instance_id, MODEL, chain)
        assert [r.backend_id for r in await reg.live_backends()] == ["b1"]
        await reg.withdraw_all("b1", r1.instance_id)
        assert await reg.lookup(MODEL, chain) == {}
        assert await reg.lookup("other/model", chain) == {}
        assert await reg.live_backends() == []
        await reg.close()

    run(main())


def test_pending_marks_count_and_expire(server):
    async def main():
        reg = Registry(server.url)
        r1, r2 = record("b1"), record("b2")
        await reg.heartbeat(r1)
        await reg.heartbeat(r2)
        chain = chain_of(conv(4))
        await reg.advertise("b1", r1.instance_id, MODEL, chain[:2])
        await reg.mark_route(MODEL, chain, "b1", ttl_ms=400)
        await reg.mark_route(MODEL, chain[:3], "b2", ttl_ms=400)
        found = await reg.lookup(MODEL, chain)
        assert (found["b1"].depth, found["b1"].marked_depth) == (2, len(chain))
        assert (found["b2"].depth, found["b2"].marked_depth) == (0, 3)
        # A mark for a backend that is not live does not make it appear.
        await reg.mark_route(MODEL, chain, "ghost", ttl_ms=400)
        assert "ghost" not in await reg.lookup(MODEL, chain)

        async def expired():
            f = await reg.lookup(MODEL, chain)
            return f["b1"].marked_depth == 2 and f["b2"].marked_depth == 0

        # They expire on their TTL (0.4 s) alone; a mark that never expired fails it too.
        await poll(expired, deadline=10.0, what="pending marks to expire")
        await reg.close()

    run(main())


# -- failures -------------------------------------------------------------------


def test_lookup_returns_none_within_deadline_when_redis_hangs_or_dies(own_server):
    async def main():
        # Timeouts far apart, so each bound below tells which one acted with a wide margin
        # for a loaded machine: a lookup waits at most its own deadline (0.5 s), never the
        # operations' (2 s); within retry_after (2 s) it does not wait on Redis at all.
        reg = Registry(own_server.url, lookup_timeout=0.5, op_timeout=2.0, retry_after=2.0)
        r1 = record("b1")
        chain = chain_of(conv(2))
        await reg.heartbeat(r1)
        await reg.advertise("b1", r1.instance_id, MODEL, chain)
        assert (await reg.lookup(MODEL, chain))["b1"].depth == len(chain)

        own_server.pause()  # SIGSTOP: the socket accepts, nothing answers
        try:
            t0 = time.monotonic()
            assert await reg.lookup(MODEL, chain) is None
            hung = time.monotonic() - t0
            # Each lookup waits at most its own deadline; once the pipeline has said
            # nothing for op_timeout, Redis counts as down and lookups answer at once.
            async def answers_at_once():
                t0 = time.monotonic()
                return await reg.lookup(MODEL, chain) is None and time.monotonic() - t0 < 0.1

            await poll(answers_at_once, deadline=2.0 + 3.0, what="lookups skipping a hung Redis")
            t0 = time.monotonic()
            assert await reg.lookup(MODEL, chain) is None  # within retry_after: no wait at all
            fast = time.monotonic() - t0
            t0 = time.monotonic()
            with pytest.raises(RegistryUnavailable):
                await reg.advertise("b1", r1.instance_id, MODEL, chain)
            write = time.monotonic() - t0
        finally:
            own_server.resume()
        print(f"\nlookup on a hung Redis: {hung * 1e3:.1f} ms, next one {fast * 1e3:.2f} ms, "
              f"advertise failed after {write * 1e3:.0f} ms")
        assert hung < 1.5, hung  # the lookup deadline acted, not op_timeout
        assert fast < 0.4, fast  # below the lookup deadline: it did not wait on Redis
        assert write < 2.0 + 3.0, write

        # The pause can outlast the record's heartbeat TTL: a live backend heartbeats again.
        async def answers():
            try:
                await reg.heartbeat(r1)
            except RegistryUnavailable:
                return False
            found = await reg.lookup(MODEL, chain)
            return found is not None and "b1" in found and found["b1"].depth == len(chain)

        await poll(answers, deadline=10.0, what="lookup after SIGCONT")

        await asyncio.to_thread(own_server.stop)
        t0 = time.monotonic()
        assert await reg.lookup(MODEL, chain) is None
        assert time.monotonic() - t0 < 1.5  # refused connections: within the lookup deadline
        with pytest.raises(RegistryUnavailable):
            await reg.heartbeat(r1)
        await reg.close()

    run(main())


async def advertise_one(reg: Registry) -> list[int]:
    """Backend b1 live and holding a short conversation's chain; returns the chain."""
    r1 = record("b1")
    chain = chain_of(conv(2))
    await reg.heartbeat(r1)
    await reg.advertise("b1", r1.instance_id, MODEL, chain)
    return chain


def test_a_late_lookup_costs_only_its_own_request(server):
    """A lookup that misses its deadline (here: the event loop blocked past it, as
    under a burst) answers "unknown" to its own request only; the next lookups are
    answered from Redis, and concurrent lookups share pipelines."""
    async def main():
        reg = Registry(server.url, lookup_timeout=0.05)
        chain = await advertise_one(reg)
        slow = asyncio.ensure_future(reg.lookup(MODEL, chain, timeout=0.0))
        assert await slow is None  # no time at all: unknown for this request
        lagged = [asyncio.ensure_future(reg.lookup(MODEL, chain)) for _ in range(20)]
        await asyncio.sleep(0)
        time.sleep(0.1)  # the loop stalls past every deadline (event-loop lag)
        await asyncio.gather(*lagged)
        # Whatever those answered, nobody else is blinded: the next burst is answered.
        pipelines = reg._batch.pipelines
        burst = await asyncio.gather(*(reg.lookup(MODEL, chain, timeout=10.0) for _ in range(50)))
        assert all(f is not None and f["b1"].depth == len(chain) for f in burst)
        assert reg._batch.pipelines - pipelines < 50  # coalesced, not one round trip each
        await reg.close()

    run(main())


def test_a_lone_lookup_goes_at_once_and_a_burst_shares_pipelines(server):
    """A lookup with nothing else in flight is sent from its own task (no pipeline,
    so no extra turns of the event loop); lookups made while it is in flight are
    coalesced as before."""
    async def main():
        reg = Registry(server.url)
        chain = await advertise_one(reg)
        for _ in range(3):
            assert (await reg.lookup(MODEL, chain, timeout=10.0))["b1"].depth == len(chain)
        assert reg._batch.pipelines == 0 and reg._batch.calls == 3
        burst = await asyncio.gather(*(reg.lookup(MODEL, chain, timeout=10.0) for _ in range(30)))
        assert all(f["b1"].depth == len(chain) for f in burst)
        # The first went alone; the 29 behind it shared pipelines.
        assert 1 <= reg._batch.pipelines < 29 and reg._batch.calls == 33
        await reg.close()

    run(main())


def test_a_lone_lookup_after_redis_lost_its_scripts_is_answered(own_server):
    """When Redis has lost the scripts (a restart, a failover), a lookup loads them
    again and answers, instead of answering "unknown"."""
    import redis as redis_py

    async def main():
        reg = Registry(own_server.url)
        chain = await advertise_one(reg)
        assert (await reg.lookup(MODEL, chain, timeout=10.0))["b1"].depth == len(chain)
        redis_py.Redis.from_url(own_server.url).script_flush()
        found = await reg.lookup(MODEL, chain, timeout=10.0)
        assert found is not None and found["b1"].depth == len(chain)
        await reg.close()

    run(main())


def test_wrong_password_is_unavailable_not_a_crash():
    async def main(s):
        good = Registry(s.url)
        r1 = record("b1")
        chain = chain_of(conv(2))
        await good.heartbeat(r1)
        await good.advertise("b1", r1.instance_id, MODEL, chain)
        assert (await good.lookup(MODEL, chain))["b1"].depth == len(chain)
        assert s.url.startswith("redis://:pw-123@127.0.0.1:")

        bad = Registry(f"redis://:wrong@127.0.0.1:{s.port}/0")
        assert await bad.lookup(MODEL, chain) is None
        with pytest.raises(RegistryUnavailable):
            await bad.advertise("b1", r1.instance_id, MODEL, chain)
        await good.close()
        await bad.close()

    with RedisServer(password="pw-123") as s:
        run(main(s))


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a test certificate")
def test_rediss_tls_url(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )
    tls_port = free_port()
    tls = ["--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
           "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"]

    async def main():
        reg = Registry(f"rediss://default:pw@127.0.0.1:{tls_port}/0?ssl_ca_certs={cert}")
        r1 = record("b1")
        chain = chain_of(conv(2))
        await reg.heartbeat(r1)
        await reg.advertise("b1", r1.instance_id, MODEL, chain)
        assert (await reg.lookup(MODEL, chain))["b1"].depth == len(chain)
        await reg.close()

    try:
        s = RedisServer(password="pw", extra_args=tls).start()
    except RuntimeError as e:  # a redis-server built without TLS
        pytest.skip(f"redis-server without TLS support: {e}")
    with s:
        run(main())


def test_redis_holds_no_prompt_text(server):
    secret_text = "PURPLE-ELEPHANT-7f3a9"

    async def main():
        reg = Registry(server.url)
        body = {"messages": [{"role": "user", "content": f"my prompt mentions {secret_text} twice: {secret_text}"}],
                "tools": [{"type": "function", "function": {"name": secret_text}}]}
        chain = chain_of(body)
        r1 = record("b1")
        await reg.heartbeat(r1)
        await reg.advertise("b1", r1.instance_id, MODEL, chain)
        await reg.mark_route(MODEL, chain, "b1")
        assert (await reg.lookup(MODEL, chain))["b1"].depth == len(chain)

        raw = aioredis.from_url(server.url)
        needles = [secret_text.encode(), b"mentions", SALT]
        n_keys = 0
        async for key in raw.scan_iter(count=1000):
            n_keys += 1
            kind = (await raw.type(key)).decode()
            if kind == "string":
                values = [await raw.get(key)]
            elif kind == "set":
                values = list(await raw.smembers(key))
            elif kind == "zset":
                values = [m for m, _ in await raw.zrange(key, 0, -1, withscores=True)]
            elif kind == "hash":
                values = [x for kv in (await raw.hgetall(key)).items() for x in kv]
            else:
                raise AssertionError(f"unexpected key type {kind} for {key!r}")
            for blob in [key, *values]:
                for needle in needles:
                    assert needle not in blob, f"{needle!r} found in {key!r}"
        assert n_keys >= len(chain)
        await raw.aclose()
        await reg.close()

    run(main())


# -- regressions found by bench.reliability -----------------------------------------------


def test_regression_withdrawn_keys_leave_the_backend_index(server):
    """The per-backend index of advertised keys only ever grew while the backend kept
    advertising (a Redis memory leak, and an ever longer purge at the next restart)."""
    async def main():
        reg = Registry(server.url)
        rec = record("b1")
        await reg.heartbeat(rec)
        chain = chain_of(conv(3))
        await reg.advertise("b1", rec.instance_id, MODEL, chain)
        assert await reg.advertised("b1", MODEL) == set(chain)
        await reg.withdraw("b1", rec.instance_id, MODEL, chain[2:])
        assert await reg.advertised("b1", MODEL) == set(chain[:2])
        await reg.withdraw("b1", rec.instance_id, MODEL, chain)
        assert await reg.advertised("b1", MODEL) == set()
        await reg.close()

    run(main())

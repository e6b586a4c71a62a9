"""The backend's registry publisher, driven by the real cache store (backend/store.py,
with real mlx-lm KV caches, no model) against a real redis-server started per test.

The store refcounts prefix keys shared by several entries and tells the publisher only
the keys it holds or released as a whole; these tests check that Redis follows it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from kvroute.backend.publisher import Publisher
from kvroute.backend.store import Store
from kvroute.core.registry import BackendRecord, Registry
from tests.test_registry import MODEL, chain_of, conv, own_server, poll, record, run, server  # noqa: F401

_TOKENS = 8


def make_cache(n_tokens: int) -> list[KVCache]:
    c = KVCache()
    k = mx.zeros((1, 2, n_tokens, 8))
    c.update_and_fetch(k, k)
    return [c]


def commit(store: Store, chain: list[int], start: int) -> int:
    """Commit an entry advertised under `chain`; token ranges of different `start`s never
    extend one another, so no entry supersedes another and each keeps its own keys."""
    tokens = list(range(start, start + _TOKENS))
    entry = store.insert(MODEL, tokens, make_cache(_TOKENS), "finish", chain=chain)
    assert entry is not None
    return entry.id


def publisher(reg: Registry, rec: BackendRecord, store: Store, **kw) -> Publisher:
    kw.setdefault("period", 0.1)
    kw.setdefault("backoff_cap", 0.4)
    pub = Publisher(reg, lambda: rec, store.snapshot, **kw)
    store.listeners.append(pub.on_store_event)  # as the backend wires it
    return pub


async def _depth(reg: Registry, chain: list[int], backend_id: str = "b1") -> int | None:
    found = await reg.lookup(MODEL, chain)
    if found is None or backend_id not in found:
        return None
    return found[backend_id].depth


async def _eq(aw, expected) -> bool:
    return (await aw) == expected


async def _true(value) -> bool:
    return bool(value)


def test_publisher_publishes_inserts_and_evictions_in_order(server):
    async def main():
        reg = Registry(server.url, record_ttl=1.0)
        store = Store(budget_bytes=1 << 30)
        first = chain_of(conv(2))
        commit(store, first, 0)  # already in the store at start: published by the first sync
        pub = publisher(reg, record("b1"), store)
        await pub.start()
        await poll(lambda: _eq(_depth(reg, first), len(first)), what="snapshot published")

        # A commit on another thread (the engine's), then its eviction: the keys it
        # shares with the first entry stay held, so only its tail is withdrawn.
        second = chain_of(conv(6))
        assert second[:len(first)] == first
        ids = []
        t = threading.Thread(target=lambda: ids.append(commit(store, second, 100)))
        t.start()
        t.join()
        await poll(lambda: _eq(_depth(reg, second), len(second)), what="insert published")
        store.remove(ids[0])
        await poll(lambda: _eq(_depth(reg, second), len(first)), what="eviction published")

        await pub.stop(withdraw=True)
        assert await reg.lookup(MODEL, second) == {}
        await reg.close()

    run(main())


def test_a_load_change_is_published_at_once_and_bursts_are_coalesced(server):
    """Proxies place new conversations by a backend's published load: a change must
    reach Redis well before the next periodic heartbeat (here 30 s away), and a burst
    of changes must not turn into a heartbeat each."""
    async def main():
        reg = Registry(server.url, record_ttl=60.0)
        store = Store(budget_bytes=1 << 30)
        rec = record("b1")
        pub = publisher(reg, rec, store, period=30.0, min_gap=0.2)
        pub.record_fn = lambda: rec  # read when a beat runs: sees the latest load
        beats = 0
        heartbeat = reg.heartbeat

        async def counted(*args, **kw):
            nonlocal beats
            beats += 1
            return await heartbeat(*args, **kw)

        reg.heartbeat = counted
        await pub.start()

        async def published_running():
            return {r.backend_id: r.running for r in await reg.live_backends()}.get("b1")

        await poll(lambda: _eq(published_running(), 0), what="first heartbeat")
        beats_before, t0 = beats, time.monotonic()

        def burst():  # the engine thread: every step of a busy batch changes the load
            nonlocal rec
            for running in range(1, 201):
                rec = dataclasses.replace(rec, running=running)
                pub.beat_soon()

        t = threading.Thread(target=burst)
        t.start()
        t.join()
        await poll(lambda: _eq(published_running(), 200), what="the last load published")
        elapsed = time.monotonic() - t0
        assert elapsed < 10  # long before the 30 s heartbeat
        assert beats - beats_before <= elapsed / 0.2 + 2, (beats - beats_before, elapsed)
        await pub.stop()
        await reg.close()

    run(main())


def test_publisher_readvertises_after_redis_restarts_empty(own_server):
    async def main():
        reg = Registry(own_server.url, record_ttl=1.0, retry_after=0.05)
        store = Store(budget_bytes=1 << 30)
        pub = publisher(reg, record("b1"), store)
        await pub.start()
        chain = chain_of(conv(4))
        commit(store, chain, 0)
        await poll(lambda: _eq(_depth(reg, chain), len(chain)), what="first publish")
        resyncs = pub.resyncs

        await asyncio.to_thread(own_server.restart)  # same port, empty
        # No new insert: the publisher notices and re-advertises its snapshot by itself.
        await poll(lambda: _eq(_depth(reg, chain), len(chain)), what="re-advertise after restart")
        # The keys are visible in Redis a moment before the resync that wrote them
        # finishes and counts itself (its last reply is still on its way back).
        await poll(lambda: _true(pub.resyncs > resyncs), what="the resync to be counted")
        await pub.stop()
        await reg.close()

    run(main())


def test_publisher_keeps_running_while_redis_is_down_and_recovers(own_server):
    async def main():
        reg = Registry(own_server.url, record_ttl=1.0, op_timeout=0.3, retry_after=0.05)
        store = Store(budget_bytes=1 << 30)
        pub = publisher(reg, record("b1"), store)
        await pub.start()
        before = chain_of(conv(2))
        commit(store, before, 0)
        await poll(lambda: _eq(_depth(reg, before), len(before)), what="first publish")

        await asyncio.to_thread(own_server.stop)

        async def retried():
            return not pub.connected and pub.failures >= 3

        await poll(retried, deadline=5.0, what="publisher to retry while Redis is down")
        during = chain_of({"messages": [{"role": "user", "content": "inserted while Redis was down"}]})
        commit(store, during, 100)
        assert not pub._task.done()
        assert pub.pending >= 1  # what the backend's registry_pending gauge shows

        await asyncio.to_thread(own_server.start)  # same port, empty
        await poll(lambda: _eq(_depth(reg, before), len(before)), what="old entries re-advertised")
        await poll(lambda: _eq(_depth(reg, during), len(during)), what="outage insert published")
        assert pub.connected
        await poll(lambda: _true(pub.pending == 0), what="nothing left to publish")
        await pub.stop()
        await reg.close()

    run(main())


def test_publisher_stop_when_redis_is_down_does_not_hang(own_server):
    async def main():
        reg = Registry(own_server.url, op_timeout=0.3)
        store = Store(budget_bytes=1 << 30)
        pub = publisher(reg, record("b1"), store)
        await pub.start()
        await poll(lambda: _true(pub.connected), what="connected")
        await asyncio.to_thread(own_server.stop)
        t0 = time.monotonic()
        await pub.stop(withdraw=True)
        assert time.monotonic() - t0 < 10.0  # bounded by op_timeout (0.3 s), with margin
        await reg.close()

    run(main())


# -- regressions found by bench.reliability -----------------------------------------------


def test_regression_eviction_while_redis_is_unreachable_is_withdrawn(own_server):
    """A resync after an outage dropped the evictions queued meanwhile without
    withdrawing them: Redis kept advertising keys the store no longer held."""
    async def main():
        reg = Registry(own_server.url, record_ttl=1.0, op_timeout=0.3, retry_after=0.05)
        store = Store(budget_bytes=1 << 30)
        pub = publisher(reg, record("b1"), store)
        await pub.start()
        kept, gone = chain_of(conv(2, "kept text ")), chain_of(conv(2, "evicted text "))
        commit(store, kept, 0)
        gone_id = commit(store, gone, 100)
        await poll(lambda: _eq(_depth(reg, gone), len(gone)), what="both published")
        shared = next(i for i, (a, b) in enumerate(zip(kept, gone)) if a != b)
        failures = pub.failures
        own_server.pause()  # hung: connections stay open, nothing answers
        try:
            await poll(lambda: _true(pub.failures > failures), what="the publisher to see the outage")
            store.remove(gone_id)  # releases only the keys `kept` does not share
        finally:
            own_server.resume()
        resyncs = pub.resyncs
        await poll(lambda: _true(pub.resyncs > resyncs and pub.connected), what="a resync")
        await poll(lambda: _eq(_depth(reg, gone), shared), what="the evicted keys withdrawn")
        assert await _depth(reg, kept) == len(kept)
        await pub.stop()
        await reg.close()

    run(main())

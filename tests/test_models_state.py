"""Per-model states and load requests in a real Redis: what proxies see and send."""

from __future__ import annotations

import asyncio
import time

from kvroute.core.model_loads import (LOADED, LOADING, UNLOADED, ModelLoads, ModelState,
                                      STALE_AFTER, summarize)
from kvroute.core import redis_keys


def test_publish_summarize_withdraw_and_load_requests(redis_db):
    async def main(url: str) -> None:
        a, b = ModelLoads(url), ModelLoads(url)
        await a.publish([ModelState("m1", "mac-a", LOADED, memory_bytes=10, loads=2),
                         ModelState("m2", "mac-a", UNLOADED)])
        await b.publish([ModelState("m1", "mac-b", LOADING, loads=1)])
        s = await b.summaries()
        assert s["m1"].state == LOADED and s["m1"].loads == 3 and s["m1"].machine == "mac-a,mac-b"
        assert s["m2"].state == UNLOADED

        # A machine's consumer sees requests made after it started, in order, once each.
        start = await a.last_request_id()
        await b.request_load("m2")
        await b.request_load("m2")
        await b.request_load("m3")
        after, models = await a.load_requests(start, block_s=1)
        assert models == ["m2", "m3"]
        assert (await a.load_requests(after, block_s=0.1))[1] == []

        await b.touch("m1", 123.0)
        assert (await a.used())["m1"] == 123.0

        await a.withdraw("mac-a", ["m1", "m2"])
        assert set(await a.summaries()) == {"m1"}
        await b.withdraw("mac-b", ["m1"])
        # The last machine out leaves no key behind.
        assert not [k async for k in a._redis.scan_iter("kvr:*")]
        await a.close()
        await b.close()

    asyncio.run(main(redis_db.url))


def test_stale_states_are_ignored(redis_db):
    fresh = ModelState("m", "x", LOADED, updated_at=time.time())
    stale = ModelState("m", "y", LOADED, updated_at=time.time() - STALE_AFTER - 1)

    async def main(url: str) -> None:
        s = ModelLoads(url)
        await s._redis.hset(redis_keys.MODEL_STATES, mapping={"m|x": fresh.to_json(), "m|y": stale.to_json()})
        assert [x.machine for x in (await s.states())["m"]] == ["x"]
        await s.close()

    asyncio.run(main(redis_db.url))


def test_summary_reports_the_latest_error():
    old = ModelState("m", "a", UNLOADED, error="old", error_at=1.0)
    new = ModelState("m", "b", UNLOADED, error="new", error_at=2.0)
    assert summarize([old, new]).error == "new"


def test_one_machines_refusal_waits_for_the_others():
    """Machine a has no room, machine b (configured for the model too) has not answered
    the same load request yet: the model's summary carries no error, so a proxy keeps
    waiting for b instead of answering a's refusal."""
    refused = ModelState("m", "a", UNLOADED, error="no room", error_code="model_capacity",
                         error_at=2.0)
    quiet = ModelState("m", "b", UNLOADED)
    assert summarize([refused, quiet]).error == ""
    assert summarize([refused, ModelState("m", "b", LOADING)]).state == LOADING
    assert summarize([refused]).error == "no room"


def test_a_loop_of_quiet_redis_calls_stops_when_cancelled(redis_db):
    # The loader's loops (idle checks, load requests) call Redis through `quietly`; a
    # cancellation that lands in redis-py's read can be swallowed there, and the loop
    # went on: serve hung on SIGTERM. Cancelled at many points, every loop ends.
    import random

    from kvroute.core import redis_client
    from kvroute.core.model_loads import quietly

    async def main(url: str) -> int:
        r = redis_client.connect(url)

        async def loop() -> None:
            while True:
                await asyncio.sleep(0.005)
                await quietly(r.hgetall("kvr:{models}:used"), {})

        stuck = 0
        rng = random.Random(7)
        for _ in range(100):
            task = asyncio.create_task(loop())
            await asyncio.sleep(rng.uniform(0.004, 0.008))
            task.cancel()
            done, _ = await asyncio.wait([task], timeout=1.0)
            stuck += not done
        await r.aclose()
        return stuck

    assert asyncio.run(main(redis_db.url)) == 0


def test_a_request_just_after_a_load_ends_is_routed_not_held(redis_db):
    """A proxy refreshes its copy of the states every REFRESH seconds. A request that
    finds a live backend while that copy still says "loading" has the states read
    again, and goes to the backend when they say "loaded" (held, it waited a POLL of
    0.2 s before it was routed). A model no backend serves is held whatever they say."""
    from kvroute.proxy.loading import OnDemand

    async def main(url: str) -> None:
        serve, states = ModelLoads(url), ModelLoads(url)
        proxy = OnDemand(states, load_timeout=5.0)
        await serve.publish([ModelState("m", "mac", LOADING)])
        await proxy.refresh()
        assert await proxy.must_wait("m", serving=True)  # still loading: held
        await serve.publish([ModelState("m", "mac", LOADED)])
        assert proxy.needs_load("m", True)  # its copy is behind
        assert not await proxy.must_wait("m", serving=True)
        assert await proxy.must_wait("m", serving=False)
        assert not await proxy.must_wait("unmanaged", serving=True)  # no `kvroute serve`'s
        await serve.close()
        await states.close()

    asyncio.run(main(redis_db.url))

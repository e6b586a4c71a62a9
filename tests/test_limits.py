"""Usage limits against a real redis-server: the shared counters (kvroute/core/
limit_counters.py, its Lua scripts) and the proxy's rules and local fallback
(kvroute/proxy/limits.py). The limits across two real proxies over HTTP are in
tests/test_cache_reasons.py; on a Redis Cluster, in tests/test_cluster.py."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import redis as redis_py
from tests.harness import wait_until

from kvroute import config
from kvroute.api.errors import APIError
from kvroute.core import limit_counters
from kvroute.core.limit_counters import LimitCounters
from kvroute.proxy.limits import Limits, rules_of
from kvroute.proxy.observe.metrics import ProxyMetrics
from kvroute.proxy.observe.stats import Stats
from kvroute.serve.redis_server import RedisServer


@pytest.fixture
def redis(redis_db):
    """An empty database of the session's Redis."""
    return redis_db


@pytest.fixture
def own_redis():
    """A redis-server of the test's own, which it stops."""
    server = RedisServer().start()
    yield server
    server.close()


def clear_of_a_minute_end(url: str) -> None:
    """Windows are the server's minutes: a test that counts in one must not cross into
    the next (at most 6 s of waiting, one run in ten)."""
    client = redis_py.Redis.from_url(url)
    wait_until(lambda: client.time()[0] % 60 < 54, 10, interval=0.2, what="a fresh minute")
    client.close()


async def admit_all(counters: LimitCounters, subject: str, n: int, **limits) -> list[str]:
    return [(await counters.admit(subject, f"r{i}", **limits))[0] for i in range(n)]


def test_requests_and_tokens_per_window(redis):
    clear_of_a_minute_end(redis.url)

    async def main():
        c = LimitCounters(redis.url, timeout=5.0)  # a busy test machine: no fallback
        assert await admit_all(c, "scope:a", 3, requests_per_minute=2) == \
            ["", "", "requests_per_minute"]
        limit, wait = await c.admit("scope:a", "r9", requests_per_minute=2)
        assert limit == "requests_per_minute" and 0 < wait <= 60
        assert await admit_all(c, "scope:b", 2, requests_per_minute=2) == ["", ""]  # apart
        # Tokens are charged when a request ends; over the limit, the next one waits.
        assert await admit_all(c, "scope:t", 1, tokens_per_minute=100) == [""]
        await c.charge("scope:t", 100, per_minute=True, per_day=True)
        assert (await c.admit("scope:t", "x", tokens_per_minute=100))[0] == "tokens_per_minute"
        limit, wait = await c.admit("scope:t", "y", tokens_per_day=100)
        assert limit == "tokens_per_day" and 60 < wait <= 86400
        assert (await c.admit("scope:t", "z", tokens_per_day=101))[0] == ""
        await c.close()

    asyncio.run(main())


def test_requests_in_flight_hold_leases(redis, monkeypatch):
    monkeypatch.setattr(limit_counters, "LEASE_MS", 1000)

    async def main():
        c = LimitCounters(redis.url, timeout=5.0)  # a busy test machine: no fallback
        assert await admit_all(c, "scope:c", 2, concurrent=1) == ["", "concurrent_requests"]
        await c.release("scope:c", "r0")
        assert (await c.admit("scope:c", "r2", concurrent=1))[0] == ""
        # Renewed, it still counts past its lease; left alone (a proxy died), it lapses.
        for _ in range(6):
            await asyncio.sleep(0.25)
            await c.renew("scope:c", ["r2"])
        assert (await c.admit("scope:c", "r3", concurrent=1))[0] == "concurrent_requests"
        await asyncio.sleep(1.2)
        assert (await c.admit("scope:c", "r4", concurrent=1))[0] == ""
        await c.close()

    asyncio.run(main())


def proxy_config(redis_url: str, **limits) -> SimpleNamespace:
    settings = {name: [] for name in config.LIMIT_NAMES}
    for name, values in limits.items():
        settings[name] = [config.parse_models(v) if name == "allowed_models"
                          else config.parse_limit(v) for v in values]
    return SimpleNamespace(redis_url=redis_url, limit_timeout_ms=250.0, **settings)


def test_which_rule_applies_key_then_scope_then_any():
    rules = rules_of(proxy_config("redis://unused", requests_per_minute=["sk-x=1", "a=2", "*=3"],
                                  allowed_models=["a=m1;m2"]))
    assert rules["a"].requests_per_minute == 2 and rules["a"].allowed_models == {"m1", "m2"}
    limits = Limits(proxy_config("redis://unused", requests_per_minute=["sk-x=1", "a=2", "*=3"]),
                    ProxyMetrics(), Stats())
    assert limits.rule_for({"api_key": "sk-x", "scope": "a"})[0].startswith("key:")
    assert limits.rule_for({"api_key": "sk-y", "scope": "a"})[0] == "scope:a"
    assert limits.rule_for({"api_key": "sk-z", "scope": "b"})[0] == "scope:b"  # *: each team
    assert limits.rule_for({})[0] == "scope:other"


def test_a_model_not_allowed_is_a_403():
    limits = Limits(proxy_config("redis://unused", allowed_models=["a=m1"]), ProxyMetrics(),
                    Stats(["a", "other"]))
    request = {"scope": "a"}
    assert limits.allows(request, "m1") and not limits.allows(request, "m2")
    with pytest.raises(APIError) as err:
        asyncio.run(limits.admit(request, "m2"))
    assert (err.value.status, err.value.code) == (403, "model_not_allowed")
    assert limits.allows({"scope": "b"}, "m2")  # no rule for b


def test_with_redis_down_each_proxy_decides_alone(own_redis):
    clear_of_a_minute_end(own_redis.url)  # the local windows are the same minutes
    url = own_redis.url
    own_redis.close()
    metrics = ProxyMetrics()
    limits = Limits(proxy_config(url, requests_per_minute=["a=2"], tokens_per_minute=["a=50"]),
                    metrics, Stats(["a", "other"]))

    async def main():
        request = {"scope": "a"}
        t0 = time.monotonic()
        first = await limits.admit(request, "m")
        assert first is not None and not first.shared
        assert time.monotonic() - t0 < 2  # within the limit check's deadline, not a hang
        limits.end(first, 60)  # over the token limit: the next waits for the next minute
        with pytest.raises(APIError) as err:
            await limits.admit(request, "m")
        assert (err.value.status, err.value.code) == (429, "tokens_per_minute")
        assert 0 < err.value.retry_after <= 60
        await limits.close()

    asyncio.run(main())
    assert metrics.limits_local._value.get() == 2
    assert metrics.limited.labels("a", "tokens_per_minute")._value.get() == 1

"""Usage-limit counters shared by every proxy through Redis: requests and tokens per
window, requests in flight. What the limits are and who they apply to is the proxy's
(kvroute/proxy/limits.py); this is the client of their keys (kvroute/core/redis_keys.py) and
scripts (kvroute/core/lua/limit_*.lua).

Windows are fixed: a minute and a UTC day of the Redis server's clock, so every proxy
counts the same ones. A request in flight holds a lease that its proxy renews; a proxy
that died stops renewing, and its requests stop counting when their leases lapse. Every
call gives up after `timeout` and raises `LimitsUnavailable`: the caller decides alone
then (docs/DESIGN.md invariant 4).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from . import redis_client
from .redis_keys import LIMIT_OPEN, limit_tag

_LUA = Path(__file__).with_name("lua")
LEASE_MS = 30_000  # a request in flight counts this long unless its proxy renews it


class LimitsUnavailable(Exception):
    """Redis did not answer in time, or refused."""


class LimitCounters:
    def __init__(self, url: str, timeout: float = 0.25):
        self.timeout = timeout
        self._redis = redis_client.connect(url, socket_connect_timeout=timeout,
                                           socket_timeout=timeout, retry=Retry(NoBackoff(), 1))
        scripts = {name: self._redis.register_script((_LUA / f"limit_{name}.lua").read_text())
                   for name in ("admit", "charge", "renew")}
        self._admit, self._charge, self._renew = scripts["admit"], scripts["charge"], scripts["renew"]

    async def _call(self, aw):
        try:
            async with asyncio.timeout(self.timeout):
                return await aw
        except (TimeoutError, RedisError, OSError) as exc:
            raise LimitsUnavailable(f"{type(exc).__name__}: {exc}") from None

    async def admit(self, subject: str, request_id: str, *, requests_per_minute: int = 0,
                    tokens_per_minute: int = 0, tokens_per_day: int = 0,
                    concurrent: int = 0) -> tuple[str, float]:
        """("", 0) once admitted (its request counted, its lease taken when `concurrent`
        is set); else (the limit it is over, seconds until it may pass)."""
        tag = limit_tag(subject)
        limit, wait = await self._call(self._admit(
            keys=[tag + LIMIT_OPEN],
            args=[tag, requests_per_minute, tokens_per_minute, tokens_per_day, concurrent,
                  request_id, LEASE_MS]))
        return (limit.decode() if isinstance(limit, bytes) else limit), float(wait)

    async def charge(self, subject: str, tokens: int, per_minute: bool, per_day: bool) -> None:
        tag = limit_tag(subject)
        await self._call(self._charge(keys=[tag + LIMIT_OPEN],
                                      args=[tag, int(tokens), int(per_minute), int(per_day)]))

    async def release(self, subject: str, request_id: str) -> None:
        await self._call(self._redis.zrem(limit_tag(subject) + LIMIT_OPEN, request_id))

    async def renew(self, subject: str, request_ids: list[str]) -> None:
        if request_ids:
            await self._call(self._renew(keys=[limit_tag(subject) + LIMIT_OPEN],
                                         args=[LEASE_MS, *request_ids]))

    async def close(self) -> None:
        await self._redis.aclose()

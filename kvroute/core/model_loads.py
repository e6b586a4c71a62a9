"""Which configured model is loaded where, in Redis: what every proxy shows and waits on.

Each `kvroute serve` (one per machine) publishes the state of each model it is
configured for, and consumes load requests that proxies append to a stream. Key
layout (names in kvroute/core/redis_keys.py, with the registry's):

    kvr:{models}:states     HASH  "<model>|<machine>" -> ModelState (JSON); a field whose
                                  updated_at is older than STALE_AFTER is ignored (its
                                  machine stopped without withdrawing it)
    kvr:{models}:used       HASH  <model> -> last request (unix s), written by proxies
                                  at most once a second per model; drives LRU and idle
                                  unloading
    kvr:{models}:load       STREAM entries {model, origin}: "load this model"; each
                                  machine reads every entry (XREAD, no consumer group)
                                  and acts on the models it is configured for; capped
                                  at LOAD_STREAM_LEN entries, EXPIRE LOAD_STREAM_TTL

The client comes from `redis_client.connect`, the registry's, so every URL the
registry takes (a server, a Cluster, a Sentinel-managed primary) works here too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass

import orjson
from redis.exceptions import RedisError

from . import redis_client

from .redis_keys import MODEL_LOADS as LOAD_STREAM
from .redis_keys import MODEL_STATES as STATE_KEY
from .redis_keys import MODELS_USED as USED_KEY

LOAD_STREAM_LEN = 1000
LOAD_STREAM_TTL = 60
STALE_AFTER = 15.0
PUBLISH_PERIOD = 2.0  # seconds between a machine's republications of unchanged states

LOADED, LOADING, UNLOADING, UNLOADED, FAILED = "loaded", "loading", "unloading", "unloaded", "failed"
# What one model's summary says when machines disagree: the most useful state wins.
_RANK = {LOADED: 0, LOADING: 1, UNLOADING: 2, FAILED: 3, UNLOADED: 4}
# Error codes a machine publishes with a refusal or a failed load.
LOAD_FAILED, NO_CAPACITY = "model_load_failed", "model_capacity"


@dataclass
class ModelState:
    """One model on one machine."""

    model: str
    machine: str
    state: str = UNLOADED
    pinned: bool = False
    replicas: int = 1
    memory_bytes: int = 0  # what its replicas take (or would take) by the accounting
    last_used: float = 0.0
    loads: int = 0
    unloads: int = 0
    load_seconds: float = 0.0  # summed over its loads
    last_load_seconds: float = 0.0
    error: str = ""  # the last failed load or refusal, while it stands
    error_code: str = ""
    error_at: float = 0.0
    retry_after: float = 0.0  # seconds a client should wait before asking again
    updated_at: float = 0.0
    configured_at: float = 0.0  # when its machine's `kvroute serve` began to offer it

    def to_json(self) -> bytes:
        return orjson.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> "ModelState":
        data = orjson.loads(raw)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def summarize(states: list[ModelState]) -> ModelState:
    """One model's state across machines: the best state, summed counters."""
    best = min(states, key=lambda s: (_RANK.get(s.state, 9), -s.updated_at))
    failed = max(states, key=lambda s: s.error_at)
    if not all(s.error for s in states):
        # One machine's refusal is not the model's while another configured for it has
        # not answered yet: that one may have room (it publishes `loading` a moment later).
        failed = ModelState(model=best.model, machine=best.machine)
    return dataclasses.replace(
        best, machine=",".join(sorted(s.machine for s in states if s.state in (LOADED, LOADING)))
        or best.machine,
        memory_bytes=sum(s.memory_bytes for s in states if s.state in (LOADED, LOADING, UNLOADING))
        or best.memory_bytes,
        last_used=max(s.last_used for s in states), loads=sum(s.loads for s in states),
        unloads=sum(s.unloads for s in states), load_seconds=sum(s.load_seconds for s in states),
        last_load_seconds=max(states, key=lambda s: s.updated_at).last_load_seconds,
        error=failed.error, error_code=failed.error_code, error_at=failed.error_at,
        retry_after=failed.retry_after, pinned=any(s.pinned for s in states),
        configured_at=min((s.configured_at for s in states if s.configured_at > 0), default=0.0))


class ModelLoads:
    """Async access to the models' states and load requests. Raises RedisError/OSError
    on Redis trouble: callers decide (a proxy keeps its last view, a launcher retries)."""

    def __init__(self, url: str, op_timeout: float = 2.0):
        # The socket timeout leaves room for load_requests' blocking read.
        self._redis = redis_client.connect(url, socket_connect_timeout=op_timeout,
                                           socket_timeout=op_timeout + 5.0)
        self.op_timeout = op_timeout

    async def publish(self, states: list[ModelState]) -> None:
        now = time.time()
        mapping = {}
        for s in states:
            s.updated_at = now
            mapping[f"{s.model}|{s.machine}"] = s.to_json()
        if mapping:
            await self._redis.hset(STATE_KEY, mapping=mapping)

    async def withdraw(self, machine: str, models: list[str]) -> None:
        if models:
            await self._redis.hdel(STATE_KEY, *[f"{m}|{machine}" for m in models])
            # The last machine out leaves nothing behind.
            pipe = self._redis.pipeline(transaction=False)
            pipe.hlen(STATE_KEY)
            (left,) = await pipe.execute()
            if not left:
                await self._redis.delete(USED_KEY, LOAD_STREAM)

    async def states(self) -> dict[str, list[ModelState]]:
        """Fresh states by model."""
        raw = await self._redis.hgetall(STATE_KEY)
        now = time.time()
        out: dict[str, list[ModelState]] = {}
        for value in raw.values():
            try:
                s = ModelState.from_json(value)
            except (orjson.JSONDecodeError, TypeError):
                continue
            if now - s.updated_at <= STALE_AFTER:
                out.setdefault(s.model, []).append(s)
        return out

    async def summaries(self) -> dict[str, ModelState]:
        return {m: summarize(s) for m, s in (await self.states()).items()}

    async def touch(self, model: str, when: float | None = None) -> None:
        await self._redis.hset(USED_KEY, model, str(when or time.time()))

    async def used(self) -> dict[str, float]:
        raw = await self._redis.hgetall(USED_KEY)
        out = {}
        for k, v in raw.items():
            try:
                out[k.decode()] = float(v)
            except ValueError:
                pass
        return out

    async def request_load(self, model: str, origin: str = "") -> None:
        pipe = self._redis.pipeline(transaction=False)
        pipe.xadd(LOAD_STREAM, {"model": model, "origin": origin}, maxlen=LOAD_STREAM_LEN,
                  approximate=True)
        pipe.expire(LOAD_STREAM, LOAD_STREAM_TTL)
        await pipe.execute()

    async def last_request_id(self) -> str:
        """Where a new reader starts: after the newest entry (older requests were for
        machines that have since answered, or their proxies resend them)."""
        entries = await self._redis.xrevrange(LOAD_STREAM, count=1)
        return entries[0][0].decode() if entries else "0-0"

    async def load_requests(self, after: str, block_s: float) -> tuple[str, list[str]]:
        """Models asked for after stream id `after`, waiting up to block_s for one."""
        answer = await self._redis.xread({LOAD_STREAM: after}, block=int(block_s * 1000),
                                         count=100)
        models: list[str] = []
        for _, entries in answer or []:
            for entry_id, fields in entries:
                after = entry_id.decode()
                model = fields.get(b"model", b"").decode()
                if model and model not in models:
                    models.append(model)
        return after, models

    async def close(self) -> None:
        await self._redis.aclose()


async def quietly(aw, default=None):
    """Await a Redis call whose failure must not stop the caller's loop."""
    try:
        result = await aw
    except (RedisError, OSError, asyncio.TimeoutError):
        result = default
    # redis-py may swallow a cancellation that lands in its read (or turn it into one of
    # those errors): the task is still being cancelled, and a loop that carried on
    # would never stop (serve then hung on SIGTERM).
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
    return result

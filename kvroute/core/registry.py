"""The Redis registry: which backend holds which prefix keys, and which backends are alive.

This is the client: its key names are spelled in kvroute/core/redis_keys.py (the layout
is described there), its Lua scripts live in kvroute/core/lua/*.lua.

Liveness: an advertisement counts only while the record of the same backend id
*and instance id* exists. A SIGKILLed backend stops counting when its record's TTL
lapses; a restarted backend (new instance id) never inherits old advertisements,
which simply expire (docs/DESIGN.md invariant 5). Redis holds hashes and ids, never
prompt text (docs/DESIGN.md invariant 3).

Redis failures never reach the request path: `lookup` returns None ("unknown") within
its deadline; writes raise `RegistryUnavailable`, which the backend's publisher (backend/publisher.py)
handles by retrying with backoff and re-publishing its whole store (docs/DESIGN.md
invariant 4). Requires Redis >= 6.2.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, TypeVar

import orjson
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from . import redis_client
from .coalesce import ScriptBatcher, Unanswered
from .redis_keys import (ALL_BACKENDS, chain_hex, check_id, member, model_tag, record_key,
                         response_key, tier_keys, tier_marker_key)

log = logging.getLogger("kvroute.registry")

T = TypeVar("T")

# At most this many keys per advertise/withdraw/mark script call, so one call never
# blocks Redis for long (a 4096-key call runs in about a millisecond).
KEYS_PER_CALL = 4096


class RegistryUnavailable(Exception):
    """Redis could not be reached, timed out or refused the command."""


@dataclass(frozen=True)
class BackendRecord:
    """What a backend tells the world about itself on every heartbeat.

    Frozen: lookups share parsed records between calls (use dataclasses.replace).
    """

    backend_id: str
    instance_id: str  # fresh per process start: advertisements belong to one instance
    url: str
    models: list[str] = field(default_factory=list)
    cache_bytes: int = 0
    cache_budget: int = 0
    # What the store's entries would hold without sharing blocks (>= cache_bytes), and
    # the blocks it holds: a prefix many conversations share is held once.
    cache_bytes_unshared: int = 0
    cache_blocks: int = 0
    waiting: int = 0  # requests accepted, not yet admitted to the engine's batch
    running: int = 0  # requests in the engine's batch: prefilling or decoding
    prefill_tps: float = 0.0  # measured prefill tokens/s
    # Calibration for the proxy's cost function (proxy/policy/cost.py), measured by the
    # backend for the model it serves.
    bytes_per_token: float = 0.0  # canonical request bytes per prompt token
    decode_steps_per_s: float = 0.0  # batch steps/s; each decoding sequence gains a token
    reply_tokens: float = 0.0  # mean tokens of a finished reply
    decoding: int = 0  # sequences decoding now
    max_batch: int = 0  # sequences one batch holds; 0 = unknown
    # The prefix-key fingerprint (kvroute.prefix.fingerprint): a proxy matches caches
    # only on backends whose fingerprint equals its own.
    prefix_scheme: int = 0
    block_bytes: int = 0
    secret_tag: str = ""
    # Where the model's chat template renders the tools and the system prompt
    # (kvroute.prefix.Layout): the proxy's chains must put them where the backend's do.
    tools_at: str = "start"
    system_at: str = "first"
    tools_mark: bool = False
    images: bool = False  # the model takes images (a vision-language model)
    disk_bytes: int = 0  # the disk tier (0 and 0: none)
    disk_budget: int = 0
    restore_tps: float = 0.0  # measured tokens/s restored from the disk tier; 0 = not yet
    ram_hits: int = 0  # requests that started from a cached state in RAM, since start
    disk_hits: int = 0  # ... from a state read back from the disk tier
    started_at: float = 0.0
    updated_at: float = 0.0

    @property
    def queue_depth(self) -> int:
        """Everything accepted and not finished (the backend's queue limit counts this)."""
        return self.waiting + self.running

    def to_json(self) -> bytes:
        # queue_depth is still written for proxies that predate waiting/running.
        return orjson.dumps({**dataclasses.asdict(self), "queue_depth": self.queue_depth})

    @classmethod
    def from_json(cls, raw: bytes | str) -> "BackendRecord":
        data = orjson.loads(raw)
        if "waiting" not in data and "queue_depth" in data:  # from an older backend
            data["waiting"] = data["queue_depth"]
        # Ignore fields a newer backend may add, so old proxies keep working.
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class PrefixMatch:
    """How deep one live backend matches a chain."""

    depth: int  # leading keys it advertised (contiguous from key 0)
    record: BackendRecord
    marked_depth: int = 0  # leading keys advertised *or* carrying a routing mark for it (>= depth)
    disk_depth: int = 0  # leading keys its disk tier holds (restorable, slower than depth)


def new_instance_id() -> str:
    return uuid.uuid4().hex



# ---------------------------------------------------------------------------
# Lua: the scripts live in kvroute/core/lua/*.lua (package data), read once at import.

_LUA_DIR = Path(__file__).with_name("lua")


_SCRIPTS = {name: (_LUA_DIR / f"{name}.lua").read_text()
            for name in ("lookup", "advertise", "withdraw", "mark", "delete_record", "purge")}


# ---------------------------------------------------------------------------
# Registry


class Registry:
    """Async access to the registry. One instance per process and event loop."""

    def __init__(
        self,
        url: str,
        *,
        lookup_timeout: float = 0.05,
        key_ttl: int = 600,
        record_ttl: float = 3.0,
        op_timeout: float = 1.0,
        retry_after: float = 0.5,
    ):
        """url: see kvroute/redis_client.py (one server, redis+cluster://, redis+sentinel://).

        lookup_timeout: deadline of one lookup; past it the answer is "unknown".
        key_ttl: backstop expiry (s) of advertised keys; publishers refresh well before.
        record_ttl: lifetime (s) of a backend record; heartbeats must come faster.
        op_timeout: deadline of writes (heartbeat, advertise, ...).
        retry_after: after a lookup pipeline failed (Redis refused, errored or said
            nothing for op_timeout), answer "unknown" at once for this long. A lookup
            that only missed its own deadline never trips this.
        """
        self.url = url
        self.lookup_timeout = lookup_timeout
        self.key_ttl = int(key_ttl)
        self.record_ttl = record_ttl
        self.op_timeout = op_timeout
        self.retry_after = retry_after
        self._redis = redis_client.connect(
            url,
            socket_connect_timeout=op_timeout,
            socket_timeout=op_timeout,
            # One immediate retry heals a pooled connection that a Redis restart
            # broke; anything longer is the caller's backoff, not ours.
            retry=Retry(NoBackoff(), 1),
        )
        self._advertise = self._redis.register_script(_SCRIPTS["advertise"])
        self._withdraw = self._redis.register_script(_SCRIPTS["withdraw"])
        self._delete_record = self._redis.register_script(_SCRIPTS["delete_record"])
        self._purge = self._redis.register_script(_SCRIPTS["purge"])
        self._down_until = 0.0
        self._down = False
        self.late = 0  # lookups that missed their own deadline
        self._batch = ScriptBatcher(self._redis, stall_after=op_timeout,
                                    on_failure=self._lookup_failed, on_success=self._batch_ok)
        self._models_of: dict[str, list[str]] = {}  # backend id -> models last heartbeat
        # Parsed records by their JSON: a record changes once per heartbeat, lookups
        # come far more often, and parsing 16 records costs more than the round trip.
        self._records: dict[bytes, BackendRecord] = {}

    # -- failure handling ---------------------------------------------------

    async def _op(self, what: str, aw: Awaitable[T]) -> T:
        """Run one write within op_timeout; any Redis trouble becomes RegistryUnavailable."""
        try:
            return await asyncio.wait_for(aw, self.op_timeout)
        except asyncio.TimeoutError:
            raise RegistryUnavailable(f"{what}: timed out after {self.op_timeout}s") from None
        except (RedisError, OSError) as e:
            raise RegistryUnavailable(f"{what}: {type(e).__name__}: {e}") from e

    def _lookup_failed(self, why: str) -> None:
        self._down_until = time.monotonic() + self.retry_after
        if not self._down:
            log.warning("registry lookup unavailable (%s); routing by load until Redis answers", why)
        self._down = True

    # -- backend side -------------------------------------------------------

    async def heartbeat(self, record: BackendRecord, tier: str = "ram") -> bool:
        """Write the record with its TTL and register it under each model it serves.

        Returns True when Redis still had this instance's keys of `tier`, False when
        they may be gone (first beat, TTL lapsed, Redis restarted empty): the caller
        should then re-advertise everything it holds. Each tier's publisher asks for its
        own: they share the record, and after a restart the first to beat would find it
        written again by the other. Raises RegistryUnavailable.
        """
        check_id("backend_id", record.backend_id)
        check_id("instance_id", record.instance_id)
        now = time.time()
        raw = dataclasses.replace(record, updated_at=now).to_json()
        px = max(1, int(self.record_ttl * 1000))
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(tier_marker_key(record.backend_id, tier), record.instance_id, px=px, get=True)
        pipe.set(record_key(record.backend_id), raw, px=px)
        for zset, rec_key in [(ALL_BACKENDS, None)] + [
            (model_tag(m) + "backends", model_tag(m) + "rec:" + record.backend_id)
            for m in record.models
        ]:
            if rec_key:
                pipe.set(rec_key, raw, px=px)
            pipe.zadd(zset, {record.backend_id: now})
            pipe.zremrangebyscore(zset, "-inf", now - self.key_ttl)
            pipe.expire(zset, self.key_ttl)
        results = await self._op("heartbeat", pipe.execute())
        self._models_of[record.backend_id] = list(record.models)
        old = results[0]
        if isinstance(old, bytes):
            old = old.decode()
        return old == record.instance_id

    async def _per_chunk(self, what: str, script, model: str, keys: list[int], *extra) -> None:
        tag = model_tag(model)
        for start in range(0, len(keys), KEYS_PER_CALL):
            chunk = chain_hex(keys[start : start + KEYS_PER_CALL])
            await self._op(what, script(keys=[tag + "backends"], args=[tag, chunk, *extra]))

    async def advertise(self, backend_id: str, instance_id: str, model: str, keys: list[int],
                        tier: str = "ram") -> None:
        """Record that this instance holds these prefix keys in `tier` ("ram" or "disk")
        (refreshes their expiry)."""
        check_id("backend_id", backend_id)
        check_id("instance_id", instance_id)
        kind, idx = tier_keys(tier)
        await self._per_chunk("advertise", self._advertise, model, keys,
                              member(backend_id, instance_id), self.key_ttl, idx + backend_id, kind)

    async def purge(self, backend_id: str, models: list[str], keep_instance: str = "",
                    tier: str = "ram") -> int:
        """Remove advertisements of `backend_id` by every instance but `keep_instance`
        (all, when empty): a restarted backend clears what its killed predecessor left,
        and a clean shutdown leaves nothing behind. Returns the entries removed."""
        check_id("backend_id", backend_id)
        keep = member(backend_id, keep_instance) if keep_instance else ""
        kind, idx = tier_keys(tier)
        removed = 0
        for model in models:
            tag = model_tag(model)
            removed += await self._op("purge", self._purge(
                keys=[tag + "backends"], args=[tag, idx + backend_id, backend_id + "|", keep, kind]))
        return removed

    async def withdraw(self, backend_id: str, instance_id: str, model: str, keys: list[int],
                       tier: str = "ram") -> None:
        """Record that this instance no longer holds these keys in `tier`."""
        check_id("backend_id", backend_id)
        check_id("instance_id", instance_id)
        kind, idx = tier_keys(tier)
        await self._per_chunk("withdraw", self._withdraw, model, keys, member(backend_id, instance_id),
                              idx + backend_id, kind)

    async def advertised(self, backend_id: str, model: str, tier: str = "ram") -> set[int]:
        """The keys of `model` this backend id advertised in `tier` and has not withdrawn."""
        check_id("backend_id", backend_id)
        idx = tier_keys(tier)[1]
        members = await self._op("advertised", self._redis.smembers(model_tag(model) + idx + backend_id))
        return {int(m, 16) for m in members}

    async def withdraw_all(self, backend_id: str, instance_id: str) -> None:
        """Clean shutdown: delete this instance's records so its advertisements stop
        counting at once. The advertised keys themselves are left to expire (key_ttl):
        without a live record they are ignored, and scanning for them would cost more."""
        check_id("backend_id", backend_id)
        check_id("instance_id", instance_id)
        models = set(self._models_of.get(backend_id, []))
        raw = await self._op("withdraw_all", self._redis.get(record_key(backend_id)))
        if raw is not None:
            try:
                models.update(orjson.loads(raw).get("models") or [])
            except orjson.JSONDecodeError:
                pass
        for m in sorted(models):
            tag = model_tag(m)
            await self._op(
                "withdraw_all",
                self._delete_record(keys=[tag + "rec:" + backend_id, tag + "backends"],
                                    args=[backend_id, instance_id]),
            )
        deleted = await self._op(
            "withdraw_all",
            self._delete_record(keys=[record_key(backend_id)], args=[backend_id, instance_id]),
        )
        if deleted:
            await self._op("withdraw_all", self._redis.zrem(ALL_BACKENDS, backend_id))

    # -- proxy side ---------------------------------------------------------

    async def lookup(self, model: str, chain: list[int],
                     timeout: float | None = None) -> dict[str, PrefixMatch] | None:
        """Depth of each live backend serving `model` on `chain`, by backend id.

        Backends with depth 0 are included, so the caller can still pick by load.
        Returns None ("unknown") if Redis is down, or this lookup's answer misses its
        deadline (`timeout`, default lookup_timeout); never raises for Redis trouble
        (ValueError only for a malformed model or chain). A lookup with nothing else
        in flight is sent at once; lookups issued while one is in flight share one
        pipeline; a missed deadline costs only its own request.
        """
        tag = model_tag(model)
        hexed = chain_hex(chain)
        if time.monotonic() < self._down_until:
            return None
        deadline = self.lookup_timeout if timeout is None else timeout
        if deadline <= 0:  # no time to ask at all
            self.late += 1
            return None
        args = (_SCRIPTS["lookup"], [tag + "backends"], [tag, hexed])
        # Alone, the call is sent from this task; otherwise it joins a pipeline and its
        # future, this call's own, is awaited bare: the task wakes in the loop turn its
        # answer arrives (a shield and wait_for cost two more turns, each as long as
        # everything else the loop is relaying), and a missed deadline cancels only
        # this future, which the pipeline skips.
        fut = None if self._batch.idle() else self._batch.call(*args)
        try:
            async with asyncio.timeout(deadline):
                flat = await (self._batch.call_alone(*args) if fut is None else fut)
        except TimeoutError:
            if fut is None or fut.cancelled() or fut.exception() is not None:
                self.late += 1
                return None
            flat = fut.result()  # answered in the same tick the deadline fired
        except Unanswered:
            return None
        try:
            out: dict[str, PrefixMatch] = {}
            for i in range(0, len(flat), 4):
                rec = self._record(flat[i])
                out[rec.backend_id] = PrefixMatch(depth=int(flat[i + 1]), record=rec,
                                                  marked_depth=int(flat[i + 2]),
                                                  disk_depth=int(flat[i + 3]))
        except Exception as e:  # the request path must never see a registry error
            log.warning("malformed lookup answer: %s: %s", type(e).__name__, e)
            return None
        return out

    def _batch_ok(self) -> None:
        if self._down:
            log.info("registry lookup available again")
            self._down = False

    def _record(self, raw: bytes) -> BackendRecord:
        rec = self._records.get(raw)
        if rec is None:
            if len(self._records) >= 1024:  # old heartbeats: drop them all, cheaply
                self._records.clear()
            rec = self._records[raw] = BackendRecord.from_json(raw)
        return rec

    async def mark_route(self, model: str, chain: list[int], backend_id: str, ttl_ms: int = 2000) -> None:
        """Mark `chain` as about to be cached on `backend_id` (routing-time hint).

        A burst of requests sharing a new prefix then lands on the same backend before
        its first commit is published. Best effort: never raises for Redis trouble.
        """
        check_id("backend_id", backend_id)
        if not isinstance(ttl_ms, int) or ttl_ms <= 0:
            raise ValueError(f"ttl_ms must be a positive int, got {ttl_ms!r}")
        tag = model_tag(model)
        hexed = chain_hex(chain)
        if time.monotonic() < self._down_until:
            return
        # Rides the next pipeline; a mark that fails is only a lost hint.
        fut = self._batch.call(_SCRIPTS["mark"], [tag + "backends"], [tag, hexed, backend_id, ttl_ms])
        try:
            await asyncio.shield(fut)
        except Unanswered:
            pass

    async def put_response(self, scope_tag: str, response_id: str, blob: bytes, ttl: float) -> None:
        """Keep a stored response (opaque bytes) for `ttl` seconds. Raises RegistryUnavailable."""
        await self._op("put_response", self._redis.set(response_key(scope_tag, response_id), blob,
                                                       px=max(1, int(ttl * 1000))))

    async def get_response(self, scope_tag: str, response_id: str) -> bytes | None:
        """A stored response, None when unknown or expired. Raises RegistryUnavailable."""
        return await self._op("get_response", self._redis.get(response_key(scope_tag, response_id)))

    async def delete_response(self, scope_tag: str, response_id: str) -> bool:
        """Forget a stored response; False when there was none. Raises RegistryUnavailable."""
        key = response_key(scope_tag, response_id)
        return bool(await self._op("delete_response", self._redis.delete(key)))

    async def live_backends(self) -> list[BackendRecord]:
        """Every backend whose record is alive, sorted by id. Raises RegistryUnavailable."""
        ids = await self._op("live_backends", self._redis.zrange(ALL_BACKENDS, 0, -1))
        if not ids:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for bid in ids:
            pipe.get(record_key(bid.decode()))
        raws = await self._op("live_backends", pipe.execute())
        records = [BackendRecord.from_json(r) for r in raws if r is not None]
        return sorted(records, key=lambda r: r.backend_id)

    async def close(self) -> None:
        await self._batch.close()
        await self._redis.aclose()

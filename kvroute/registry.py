"""The Redis registry: which backend holds which prefix keys, and which backends are alive.

This is the one module that knows Redis key names and Lua scripts.

Key layout (`<m>` is the model id with `{`, `}`, `%`, blanks and non-ASCII percent-encoded;
`<hex>` is a prefix key as 16 lowercase hex digits; `<bid>` a backend id):

    kvr:{m:<m>}:k:<hex>      SET   members "<bid>|<instance_id>" that hold the key;
                                   EXPIRE key_ttl, refreshed on every (re)advertise
    kvr:{m:<m>}:p:<hex>      ZSET  pending routing marks: <bid> -> expiry (server ms)
    kvr:{m:<m>}:rec:<bid>    STR   the backend record (JSON), PX record_ttl: a copy of
                                   kvr:b:<bid> kept under the model's hash tag so the
                                   lookup script never leaves the model's slot
    kvr:{m:<m>}:backends     ZSET  <bid> -> last heartbeat (unix s) of backends serving
                                   the model; entries older than key_ttl are pruned
    kvr:{m:<m>}:idx:<bid>    SET   <hex> keys this backend id advertised and has not
                                   withdrawn, for purges and resyncs; EXPIRE key_ttl
    kvr:b:<bid>              STR   the backend record (JSON), PX record_ttl
    kvr:backends             ZSET  <bid> -> last heartbeat, for live_backends()
    kvr:resp:<tag>:<id>      STR   a stored /v1/responses answer (its conversation,
                                   encrypted by the proxy), PX its TTL; <tag> is a
                                   keyed hash of the API key's scope, <id> resp_<hex>

Everything a model's lookup touches shares the hash tag `{m:<m>}`, so one model
lives in one Redis Cluster slot. The scripts declare the model's `backends` key
(so a cluster client routes them to the right slot) and derive the other key names
from a prefix inside the script: they are undeclared but always in that same slot.

Liveness: an advertisement counts only while the record of the same backend id
*and instance id* exists. A SIGKILLed backend stops counting when its record's TTL
lapses; a restarted backend (new instance id) never inherits old advertisements,
which simply expire. Redis holds hashes and ids, never prompt text.

Redis failures never reach the request path: `lookup` returns None ("unknown") within
its deadline; writes raise `RegistryUnavailable`, which the `Publisher` handles by
retrying with backoff and re-publishing its whole store. Requires Redis >= 6.2.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import random
import re
import struct
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Awaitable, Callable, TypeVar
from urllib.parse import quote

import orjson
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

log = logging.getLogger("kvroute.registry")

T = TypeVar("T")

# At most this many keys per advertise/withdraw/mark script call, so one call never
# blocks Redis for long (a 4096-key call runs in about a millisecond).
_KEYS_PER_CALL = 4096


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
    queue_depth: int = 0
    prefill_tps: float = 0.0  # measured prefill tokens/s
    started_at: float = 0.0
    updated_at: float = 0.0

    def to_json(self) -> bytes:
        return orjson.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> "BackendRecord":
        data = orjson.loads(raw)
        # Ignore fields a newer backend may add, so old proxies keep working.
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class PrefixMatch:
    """How deep one live backend matches a chain."""

    depth: int  # leading keys it advertised (contiguous from key 0)
    record: BackendRecord
    marked_depth: int = 0  # leading keys advertised *or* carrying a routing mark for it (>= depth)


def new_instance_id() -> str:
    return uuid.uuid4().hex


# ---------------------------------------------------------------------------
# Key names


def _model_tag(model: str) -> str:
    if not isinstance(model, str) or not model:
        raise ValueError("model must be a non-empty string")
    # Braces would break the hash tag; '%' is escaped so the encoding is injective.
    return "kvr:{m:" + quote(model, safe="!#$&'()*+,-./:;<=>?@[]^_`|~") + "}:"


# Ids appear in key names and set members ("<bid>|<iid>"), and the lookup script finds
# the instance id in the record JSON by pattern: keep them to a plain alphabet.
_ID_RE = re.compile(r"[A-Za-z0-9._:@/+-]{1,200}")


def _check_id(name: str, value: str) -> None:
    if not isinstance(value, str) or not _ID_RE.fullmatch(value):
        raise ValueError(f"{name} must be 1-200 characters of [A-Za-z0-9._:@/+-], got {value!r}")


def _record_key(backend_id: str) -> str:
    return f"kvr:b:{backend_id}"


_ALL_BACKENDS = "kvr:backends"

_RESPONSE_ID_RE = re.compile(r"resp_[0-9a-f]{32}")
_SCOPE_TAG_RE = re.compile(r"[0-9a-f]{32}")


def _response_key(scope_tag: str, response_id: str) -> str:
    # Both parts come from the proxy's own hashing and ids: checked so no client text
    # ever becomes (part of) a key name.
    if not _SCOPE_TAG_RE.fullmatch(scope_tag) or not _RESPONSE_ID_RE.fullmatch(response_id):
        raise ValueError("malformed response key")
    return f"kvr:resp:{scope_tag}:{response_id}"


def _chain_hex(keys: list[int]) -> str:
    """The chain as one string of 16-hex-digit keys: one argument, split in Lua."""
    try:
        return struct.pack(f">{len(keys)}Q", *keys).hex()
    except struct.error as e:
        raise ValueError(f"prefix keys must be unsigned 64-bit ints: {e}") from None


def _member(backend_id: str, instance_id: str) -> str:
    return f"{backend_id}|{instance_id}"


# ---------------------------------------------------------------------------
# Lua

# The lookup: one round trip answers "how deep does each live backend match".
#   KEYS[1] kvr:{m:<m>}:backends     ARGV[1] kvr:{m:<m>}:     ARGV[2] chain hex
# Returns {record_json, depth, marked_depth, ...} for every live backend serving the
# model (depth 0 included). A backend is live when its rec key exists; it holds key x
# when the set of key x contains "<bid>|<instance id from its record>", and it is
# pending on key x when the pending zset of key x has an unexpired mark for <bid>.
# depth = leading keys held, contiguous from key 0; marked_depth = leading keys held
# or pending. The result is exactly that of walking the chain key by key and stopping
# at the first key no backend still matches; to make the common case cheap, the walk
# goes by chunks (8 keys, doubling up to 64): one SINTER tells which backends hold the
# whole chunk, and only those that do not are walked key by key through it.
_LOOKUP = """
local prefix, chain = ARGV[1], ARGV[2]
local n = #chain / 16
local ids, members, raws = {}, {}, {}
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local raw = redis.call('GET', prefix .. 'rec:' .. id)
  -- orjson writes compact JSON and escapes quotes inside strings, so this pattern
  -- only matches the real field (cheaper than cjson.decode on every lookup).
  local iid = raw and string.match(raw, '"instance_id":"([^"]*)"')
  if iid then
    ids[#ids + 1] = id
    members[#members + 1] = id .. '|' .. iid
    raws[#raws + 1] = raw
  end
end
local depth, pending, adv, active = {}, {}, {}, {}
for j = 1, #ids do depth[j], pending[j], adv[j], active[j] = 0, 0, true, j end
local now = nil

-- Walk backends `w` (indexes) through key x alone; returns those still matching.
local function step(x, name, w)
  local wm = {}
  for y, j in ipairs(w) do wm[y] = members[j] end
  local held = redis.call('SMISMEMBER', name, unpack(wm))
  local marks, still = nil, {}
  for y, j in ipairs(w) do
    local ok = held[y] == 1
    if not ok then
      if adv[j] then adv[j] = false; depth[j] = x end
      if marks == nil then
        if now == nil then
          local t = redis.call('TIME')
          now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
        end
        marks = {}
        local p = prefix .. 'p:' .. string.sub(chain, x * 16 + 1, x * 16 + 16)
        for _, id in ipairs(redis.call('ZRANGEBYSCORE', p, '(' .. now, '+inf')) do marks[id] = true end
      end
      ok = marks[ids[j]] == true
    end
    if ok then still[#still + 1] = j else pending[j] = x end
  end
  return still
end

local i, chunk = 0, 8
while i < n and #active > 0 do
  local last = math.min(n, i + chunk) - 1
  local names = {}
  for x = i, last do names[#names + 1] = prefix .. 'k:' .. string.sub(chain, x * 16 + 1, x * 16 + 16) end
  local whole = {}
  for _, m in ipairs(redis.call('SINTER', unpack(names))) do whole[m] = true end
  local keep, walkers = {}, {}
  for _, j in ipairs(active) do
    if whole[members[j]] then keep[#keep + 1] = j else walkers[#walkers + 1] = j end
  end
  for x = i, last do
    if #walkers == 0 then break end
    walkers = step(x, names[x - i + 1], walkers)
  end
  for _, j in ipairs(walkers) do keep[#keep + 1] = j end
  active = keep
  i = last + 1
  if chunk < 64 then chunk = chunk * 2 end
end
for _, j in ipairs(active) do
  pending[j] = i
  if adv[j] then depth[j] = i end
end
local out = {}
for j = 1, #ids do
  out[#out + 1] = raws[j]
  out[#out + 1] = depth[j]
  out[#out + 1] = pending[j]
end
return out
"""

# KEYS[1] model slot   ARGV: prefix, chain hex, member, key ttl (s)
_ADVERTISE = """
local prefix, chain, member, ttl, idx = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
for i = 0, #chain / 16 - 1 do
  local hex = string.sub(chain, i * 16 + 1, i * 16 + 16)
  local k = prefix .. 'k:' .. hex
  redis.call('SADD', k, member)
  redis.call('EXPIRE', k, ttl)
  redis.call('SADD', prefix .. idx, hex)
end
redis.call('EXPIRE', prefix .. idx, ttl)
return 1
"""

# Remove a backend id's advertisements by instances other than `keep` (all of
# them when keep is empty), through the index of keys that backend id advertised.
#   KEYS[1] model slot   ARGV: prefix, index key suffix, member prefix "bid|", keep member
_PURGE = """
local prefix, idx, mine, keep = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local removed = 0
for _, hex in ipairs(redis.call('SMEMBERS', prefix .. idx)) do
  local k = prefix .. 'k:' .. hex
  local still = false
  for _, m in ipairs(redis.call('SMEMBERS', k)) do
    if string.sub(m, 1, #mine) == mine then
      if m ~= keep then
        redis.call('SREM', k, m)
        removed = removed + 1
      else
        still = true
      end
    end
  end
  if not still then redis.call('SREM', prefix .. idx, hex) end
end
return removed
"""

# KEYS[1] model slot   ARGV: prefix, chain hex, member, index key suffix
# The key leaves the backend id's index too, which otherwise would grow with every
# key ever advertised for as long as the backend keeps advertising (its expiry is
# refreshed on each call). Instances of one backend id never overlap: a new one
# purges its predecessor's entries before it advertises or withdraws anything.
_WITHDRAW = """
local prefix, chain, member, idx = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
for i = 0, #chain / 16 - 1 do
  local hex = string.sub(chain, i * 16 + 1, i * 16 + 16)
  redis.call('SREM', prefix .. 'k:' .. hex, member)
  redis.call('SREM', prefix .. idx, hex)
end
return 1
"""

# KEYS[1] model slot   ARGV: prefix, chain hex, backend id, ttl (ms)
# Server time, so that marks expire by the same clock the lookup reads.
_MARK_PENDING = """
local prefix, chain, id, ttl = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i = 0, #chain / 16 - 1 do
  local k = prefix .. 'p:' .. string.sub(chain, i * 16 + 1, i * 16 + 16)
  redis.call('ZADD', k, 'GT', now + ttl, id)
  redis.call('ZREMRANGEBYSCORE', k, '-inf', now)
  if redis.call('PTTL', k) < ttl then redis.call('PEXPIRE', k, ttl) end
end
return 1
"""

# Delete a record only if it still belongs to this instance (a new instance with
# the same backend id may already have replaced it).
#   KEYS[1] record key   KEYS[2] (optional) zset of ids in the same slot
#   ARGV: backend id, instance id
_DELETE_RECORD = """
local raw = redis.call('GET', KEYS[1])
if raw then
  local ok, rec = pcall(cjson.decode, raw)
  if not (ok and type(rec) == 'table' and rec.instance_id == ARGV[2]) then return 0 end
  redis.call('DEL', KEYS[1])
end
if KEYS[2] then redis.call('ZREM', KEYS[2], ARGV[1]) end
return 1
"""


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
        """url: redis:// or rediss:// (username/password and ssl_* query options allowed).

        lookup_timeout: deadline of one lookup; past it the answer is "unknown".
        key_ttl: backstop expiry (s) of advertised keys; publishers refresh well before.
        record_ttl: lifetime (s) of a backend record; heartbeats must come faster.
        op_timeout: deadline of writes (heartbeat, advertise, ...).
        retry_after: after a failed lookup, answer "unknown" at once for this long,
            so a hung Redis costs one deadline, not one per request.
        """
        self.url = url
        self.lookup_timeout = lookup_timeout
        self.key_ttl = int(key_ttl)
        self.record_ttl = record_ttl
        self.op_timeout = op_timeout
        self.retry_after = retry_after
        self._redis = aioredis.from_url(
            url,
            socket_connect_timeout=op_timeout,
            socket_timeout=op_timeout,
            # One immediate retry heals a pooled connection that a Redis restart
            # broke; anything longer is the caller's backoff, not ours.
            retry=Retry(NoBackoff(), 1),
        )
        self._lookup = self._redis.register_script(_LOOKUP)
        self._advertise = self._redis.register_script(_ADVERTISE)
        self._withdraw = self._redis.register_script(_WITHDRAW)
        self._mark = self._redis.register_script(_MARK_PENDING)
        self._delete_record = self._redis.register_script(_DELETE_RECORD)
        self._purge = self._redis.register_script(_PURGE)
        self._down_until = 0.0
        self._down = False
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

    async def heartbeat(self, record: BackendRecord) -> bool:
        """Write the record with its TTL and register it under each model it serves.

        Returns True when Redis still had this instance's record, False when it was
        missing (first beat, TTL lapsed, Redis restarted empty): the caller should then
        re-advertise everything it holds. Raises RegistryUnavailable.
        """
        _check_id("backend_id", record.backend_id)
        _check_id("instance_id", record.instance_id)
        now = time.time()
        raw = dataclasses.replace(record, updated_at=now).to_json()
        px = max(1, int(self.record_ttl * 1000))
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(_record_key(record.backend_id), raw, px=px, get=True)
        for zset, rec_key in [(_ALL_BACKENDS, None)] + [
            (_model_tag(m) + "backends", _model_tag(m) + "rec:" + record.backend_id)
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
        if old is None:
            return False
        try:
            return orjson.loads(old).get("instance_id") == record.instance_id
        except orjson.JSONDecodeError:
            return False

    async def _per_chunk(self, what: str, script, model: str, keys: list[int], *extra) -> None:
        tag = _model_tag(model)
        for start in range(0, len(keys), _KEYS_PER_CALL):
            chunk = _chain_hex(keys[start : start + _KEYS_PER_CALL])
            await self._op(what, script(keys=[tag + "backends"], args=[tag, chunk, *extra]))

    async def advertise(self, backend_id: str, instance_id: str, model: str, keys: list[int]) -> None:
        """Record that this instance holds these prefix keys (refreshes their expiry)."""
        _check_id("backend_id", backend_id)
        _check_id("instance_id", instance_id)
        await self._per_chunk("advertise", self._advertise, model, keys,
                              _member(backend_id, instance_id), self.key_ttl, "idx:" + backend_id)

    async def purge(self, backend_id: str, models: list[str], keep_instance: str = "") -> int:
        """Remove advertisements of `backend_id` by every instance but `keep_instance`
        (all, when empty): a restarted backend clears what its killed predecessor left,
        and a clean shutdown leaves nothing behind. Returns the entries removed."""
        _check_id("backend_id", backend_id)
        keep = _member(backend_id, keep_instance) if keep_instance else ""
        removed = 0
        for model in models:
            tag = _model_tag(model)
            removed += await self._op("purge", self._purge(
                keys=[tag + "backends"], args=[tag, "idx:" + backend_id, backend_id + "|", keep]))
        return removed

    async def withdraw(self, backend_id: str, instance_id: str, model: str, keys: list[int]) -> None:
        """Record that this instance no longer holds these keys."""
        _check_id("backend_id", backend_id)
        _check_id("instance_id", instance_id)
        await self._per_chunk("withdraw", self._withdraw, model, keys, _member(backend_id, instance_id),
                              "idx:" + backend_id)

    async def advertised(self, backend_id: str, model: str) -> set[int]:
        """The keys of `model` this backend id advertised and has not withdrawn (its index)."""
        _check_id("backend_id", backend_id)
        members = await self._op("advertised", self._redis.smembers(_model_tag(model) + "idx:" + backend_id))
        return {int(m, 16) for m in members}

    async def withdraw_all(self, backend_id: str, instance_id: str) -> None:
        """Clean shutdown: delete this instance's records so its advertisements stop
        counting at once. The advertised keys themselves are left to expire (key_ttl):
        without a live record they are ignored, and scanning for them would cost more."""
        _check_id("backend_id", backend_id)
        _check_id("instance_id", instance_id)
        models = set(self._models_of.get(backend_id, []))
        raw = await self._op("withdraw_all", self._redis.get(_record_key(backend_id)))
        if raw is not None:
            try:
                models.update(orjson.loads(raw).get("models") or [])
            except orjson.JSONDecodeError:
                pass
        for m in sorted(models):
            tag = _model_tag(m)
            await self._op(
                "withdraw_all",
                self._delete_record(keys=[tag + "rec:" + backend_id, tag + "backends"],
                                    args=[backend_id, instance_id]),
            )
        deleted = await self._op(
            "withdraw_all",
            self._delete_record(keys=[_record_key(backend_id)], args=[backend_id, instance_id]),
        )
        if deleted:
            await self._op("withdraw_all", self._redis.zrem(_ALL_BACKENDS, backend_id))

    # -- proxy side ---------------------------------------------------------

    async def lookup(self, model: str, chain: list[int]) -> dict[str, PrefixMatch] | None:
        """Depth of each live backend serving `model` on `chain`, by backend id.

        Backends with depth 0 are included, so the caller can still pick by load.
        Returns None ("unknown") if Redis is down, slow or past lookup_timeout; never raises
        for Redis trouble (ValueError only for a malformed model or chain).
        """
        tag = _model_tag(model)
        chain_hex = _chain_hex(chain)
        if time.monotonic() < self._down_until:
            return None
        try:
            flat = await asyncio.wait_for(
                self._lookup(keys=[tag + "backends"], args=[tag, chain_hex]), self.lookup_timeout
            )
            out: dict[str, PrefixMatch] = {}
            for i in range(0, len(flat), 3):
                rec = self._record(flat[i])
                out[rec.backend_id] = PrefixMatch(depth=int(flat[i + 1]), record=rec,
                                                  marked_depth=int(flat[i + 2]))
        except asyncio.TimeoutError:
            self._lookup_failed(f"no answer within {self.lookup_timeout * 1000:.0f} ms")
            return None
        except Exception as e:  # the request path must never see a registry error
            self._lookup_failed(f"{type(e).__name__}: {e}")
            return None
        if self._down:
            log.info("registry lookup available again")
            self._down = False
        return out

    def _record(self, raw: bytes) -> BackendRecord:
        rec = self._records.get(raw)
        if rec is None:
            if len(self._records) >= 1024:  # old heartbeats: drop them all, cheaply
                self._records.clear()
            rec = self._records[raw] = BackendRecord.from_json(raw)
        return rec

    async def mark_pending(self, model: str, chain: list[int], backend_id: str, ttl_ms: int = 2000) -> None:
        """Mark `chain` as about to be cached on `backend_id` (routing-time hint).

        A burst of requests sharing a new prefix then lands on the same backend before
        its first commit is published. Best effort: never raises for Redis trouble.
        """
        _check_id("backend_id", backend_id)
        if not isinstance(ttl_ms, int) or ttl_ms <= 0:
            raise ValueError(f"ttl_ms must be a positive int, got {ttl_ms!r}")
        tag = _model_tag(model)
        chain_hex = _chain_hex(chain)
        if time.monotonic() < self._down_until:
            return
        try:
            await asyncio.wait_for(
                self._mark(keys=[tag + "backends"], args=[tag, chain_hex, backend_id, ttl_ms]),
                self.lookup_timeout,
            )
        except asyncio.TimeoutError:
            self._lookup_failed("mark_pending timed out")
        except Exception as e:
            self._lookup_failed(f"mark_pending: {type(e).__name__}: {e}")

    async def put_response(self, scope_tag: str, response_id: str, blob: bytes, ttl: float) -> None:
        """Keep a stored response (opaque bytes) for `ttl` seconds. Raises RegistryUnavailable."""
        await self._op("put_response", self._redis.set(_response_key(scope_tag, response_id), blob,
                                                       px=max(1, int(ttl * 1000))))

    async def get_response(self, scope_tag: str, response_id: str) -> bytes | None:
        """A stored response, None when unknown or expired. Raises RegistryUnavailable."""
        return await self._op("get_response", self._redis.get(_response_key(scope_tag, response_id)))

    async def live_backends(self) -> list[BackendRecord]:
        """Every backend whose record is alive, sorted by id. Raises RegistryUnavailable."""
        ids = await self._op("live_backends", self._redis.zrange(_ALL_BACKENDS, 0, -1))
        if not ids:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for bid in ids:
            pipe.get(_record_key(bid.decode()))
        raws = await self._op("live_backends", pipe.execute())
        records = [BackendRecord.from_json(r) for r in raws if r is not None]
        return sorted(records, key=lambda r: r.backend_id)

    async def close(self) -> None:
        await self._redis.aclose()


# ---------------------------------------------------------------------------
# Publisher


class Publisher:
    """Keeps Redis in sync with one backend's cache store. Runs in the backend's loop.

    Contract with the store:
    - `on_insert(model, keys)` after the store committed an entry with that chain;
    - `on_evict(model, keys)` with the keys that no entry of the store holds any more
      (the store refcounts keys shared by several entries; the registry only sees
      set membership, so withdrawing a key another entry still holds would lie);
    - `snapshot_fn()` returns {model: [chain, ...]} for everything the store holds now;
      it must be safe to call from another thread (it runs via asyncio.to_thread).
    Both callbacks may be called from any thread (e.g. the engine thread), after the
    store itself changed.

    On any Redis error the publisher marks itself disconnected, retries with
    exponential backoff (capped), and once Redis answers again re-advertises the whole
    snapshot; it does the same when a heartbeat finds its record gone (Redis restarted
    empty, or the record's TTL lapsed). It also re-advertises the snapshot every
    `refresh_every` seconds so the keys' expiry backstop never fires on live entries.
    """

    def __init__(
        self,
        registry: Registry,
        record_fn: Callable[[], BackendRecord],
        snapshot_fn: Callable[[], dict[str, list[list[int]]]],
        period: float = 1.0,
        *,
        refresh_every: float | None = None,
        backoff_cap: float = 2.0,
    ):
        self.registry = registry
        self.record_fn = record_fn
        self.snapshot_fn = snapshot_fn
        self.period = period
        self.refresh_every = refresh_every if refresh_every is not None else registry.key_ttl / 3
        self.backoff_cap = backoff_cap
        self.connected = False
        self.resyncs = 0  # full re-advertisements done (for metrics and tests)
        self.failures = 0  # Redis errors seen (each one is followed by a backoff)
        # deque append/popleft are atomic: the engine thread appends, the loop pops.
        self._events: collections.deque[tuple[bool, str, list[int]]] = collections.deque()
        self._lock = threading.Lock()  # guards _loop/_wake against a concurrent start/stop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._stopping: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    # -- called by the store (any thread) -----------------------------------

    def on_insert(self, model: str, keys: list[int]) -> None:
        self._enqueue(True, model, keys)

    def on_evict(self, model: str, keys: list[int]) -> None:
        self._enqueue(False, model, keys)

    def _enqueue(self, insert: bool, model: str, keys: list[int]) -> None:
        if not keys:
            return
        self._events.append((insert, model, list(keys)))
        with self._lock:
            loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # loop closed during shutdown: the event stays queued
                pass

    # -- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        if self._task is not None:
            return
        with self._lock:
            self._loop = asyncio.get_running_loop()
            self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="kvroute-publisher")

    async def stop(self, withdraw: bool = True) -> None:
        """Stop publishing; with withdraw, delete this instance's keys and records."""
        task = self._task
        if task is None:
            return
        self._stopping.set()
        self._wake.set()
        await task
        self._task = None
        with self._lock:
            self._loop = self._wake = None
        rec = self.record_fn()
        try:
            if withdraw:
                # Withdraw every advertised key too, so a deployment that shuts down
                # cleanly leaves nothing of itself in Redis (not even until key_ttl).
                await self.registry.purge(rec.backend_id, rec.models)
                await self.registry.withdraw_all(rec.backend_id, rec.instance_id)
            elif self.connected:
                await self._drain(rec)
        except RegistryUnavailable as e:
            log.warning("publisher stop: Redis unavailable (%s); records will lapse by TTL", e)

    # -- the loop --------------------------------------------------------------

    async def _run(self) -> None:
        backoff = 0.1
        need_resync = True  # the first connection publishes the whole store
        next_beat = next_refresh = 0.0
        while not self._stopping.is_set():
            self._wake.clear()
            try:
                now = time.monotonic()
                if need_resync or now >= next_refresh:
                    await self._resync()
                    need_resync = False
                    next_beat, next_refresh = now + self.period, now + self.refresh_every
                elif now >= next_beat:
                    next_beat = now + self.period
                    if not await self.registry.heartbeat(self.record_fn()):
                        log.warning("publisher: our record was missing in Redis; re-advertising")
                        need_resync = True
                        continue
                await self._drain(self.record_fn())
                if not self.connected:
                    log.info("publisher: connected to Redis")
                    self.connected = True
                backoff = 0.1
            except RegistryUnavailable as e:
                if self.connected:
                    log.warning("publisher: Redis unavailable (%s); retrying", e)
                self.connected = False
                self.failures += 1
                need_resync = True
                # Jitter so that many backends do not reconnect in lockstep.
                await self._sleep(self._stopping, backoff * random.uniform(0.8, 1.2))
                backoff = min(backoff * 2, self.backoff_cap)
                continue
            except Exception:  # a bug in a callback must not kill publishing for good
                log.exception("publisher: unexpected error")
                need_resync = True
                await self._sleep(self._stopping, self.backoff_cap)
                continue
            await self._sleep(self._wake, next_beat - time.monotonic())

    @staticmethod
    async def _sleep(event: asyncio.Event, seconds: float) -> None:
        try:
            await asyncio.wait_for(event.wait(), max(0.0, seconds))
        except asyncio.TimeoutError:
            pass

    async def _resync(self) -> None:
        """Heartbeat, then advertise the full snapshot.

        Events queued before the snapshot was taken are already reflected in it
        (the store changes before it enqueues), so they are dropped once the snapshot
        is published; later events are applied after it, in order.
        """
        rec = self.record_fn()
        await self.registry.heartbeat(rec)
        if not self.resyncs:
            # A predecessor with our backend id may have died without withdrawing.
            await self.registry.purge(rec.backend_id, rec.models, keep_instance=rec.instance_id)
        covered = len(self._events)
        # In a thread: the store's lock and a big snapshot must not stall the loop.
        snapshot = await asyncio.to_thread(self._snapshot_keys)
        # The covered events are dropped below, evictions included: withdraw whatever
        # Redis still lists for us beyond the snapshot (keys evicted while Redis was
        # unreachable, or written late by a Redis that was hung), so a resync leaves
        # Redis exactly equal to the store. Later evictions are applied after, in order.
        for model in set(snapshot) | set(rec.models):
            stale = await self.registry.advertised(rec.backend_id, model)
            stale.difference_update(snapshot.get(model, ()))
            if stale:
                await self.registry.withdraw(rec.backend_id, rec.instance_id, model, sorted(stale))
        for model, keys in snapshot.items():
            await self.registry.advertise(rec.backend_id, rec.instance_id, model, keys)
        for _ in range(covered):
            self._events.popleft()
        self.resyncs += 1

    def _snapshot_keys(self) -> dict[str, list[int]]:
        """The snapshot as one key list per model, deduplicated (chains share heads),
        each chain's keys in order so a prefix is always published before its tail."""
        out = {}
        for model, chains in self.snapshot_fn().items():
            keys = list(dict.fromkeys(k for chain in chains for k in chain))
            if keys:
                out[model] = keys
        return out

    async def _drain(self, rec: BackendRecord) -> None:
        """Publish queued events in order, batching runs of the same kind and model."""
        while self._events:
            insert, model, _ = self._events[0]
            keys: list[int] = []
            n = 0
            # Index, don't iterate: another thread may append meanwhile (only this
            # task pops, so indices of the head stay valid).
            for i in range(len(self._events)):
                ev = self._events[i]
                if ev[0] != insert or ev[1] != model or len(keys) >= _KEYS_PER_CALL:
                    break
                keys.extend(ev[2])
                n += 1
            if insert:
                await self.registry.advertise(rec.backend_id, rec.instance_id, model, keys)
            else:
                await self.registry.withdraw(rec.backend_id, rec.instance_id, model, keys)
            for _ in range(n):
                self._events.popleft()

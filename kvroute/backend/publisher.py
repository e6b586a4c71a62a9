"""Keeps the Redis registry in sync with one backend's cache store (backend/store.py).

Runs in the backend's event loop; the store notifies it from the engine thread, so its
callbacks only enqueue (docs/DESIGN.md invariant 1).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import threading
import time
from typing import Callable

from kvroute.core.registry import KEYS_PER_CALL, BackendRecord, Registry, RegistryUnavailable

log = logging.getLogger("kvroute.registry")


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
        min_gap: float = 0.05,
        refresh_every: float | None = None,
        backoff_cap: float = 2.0,
        tier: str = "ram",
    ):
        self.registry = registry
        self.record_fn = record_fn
        self.snapshot_fn = snapshot_fn
        self.period = period
        self.min_gap = min_gap  # seconds between early heartbeats (beat_soon)
        self.refresh_every = refresh_every if refresh_every is not None else registry.key_ttl / 3
        self.backoff_cap = backoff_cap
        self.tier = tier  # which key sets it keeps: "ram" (the store) or "disk" (the disk tier)
        self.connected = False
        self.resyncs = 0  # full re-advertisements done (for metrics and tests)
        self.failures = 0  # Redis errors seen (each one is followed by a backoff)
        # deque append/popleft are atomic: the engine thread appends, the loop pops.
        self._events: collections.deque[tuple[bool, str, list[int]]] = collections.deque()
        self._beat_wanted = False
        self._lock = threading.Lock()  # guards _loop/_wake against a concurrent start/stop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._stopping: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    @property
    def pending(self) -> int:
        """Key changes queued or being written (a batch leaves the queue once written)."""
        return len(self._events)

    # -- called by the store (any thread) -----------------------------------

    def on_insert(self, model: str, keys: list[int]) -> None:
        self._enqueue(True, model, keys)

    def on_evict(self, model: str, keys: list[int]) -> None:
        self._enqueue(False, model, keys)

    def on_store_event(self, event) -> None:
        """A `backend.store.Store` listener (on the engine thread: only enqueues)."""
        if event.kind == "insert":
            self.on_insert(event.model, event.keys)
        else:
            self.on_evict(event.model, event.keys)

    def beat_soon(self) -> None:
        """The record changed (load, cache size): write it now, not at the next period,
        at most once every `min_gap` seconds. Proxies place new conversations by these
        numbers; a record a second old showed a backend busy with a request it had
        long answered, and new conversations piled onto the other one."""
        if self._beat_wanted:  # one is due already; it reads the record when it runs
            return
        self._beat_wanted = True
        self._wake_loop()

    def _enqueue(self, insert: bool, model: str, keys: list[int]) -> None:
        if not keys:
            return
        self._events.append((insert, model, list(keys)))
        self._wake_loop()

    def _wake_loop(self) -> None:
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
                await self.registry.purge(rec.backend_id, rec.models, tier=self.tier)
                await self.registry.withdraw_all(rec.backend_id, rec.instance_id)
            elif self.connected:
                await self._drain(rec)
        except RegistryUnavailable as e:
            log.warning("publisher stop: Redis unavailable (%s); records will lapse by TTL", e)

    # -- the loop --------------------------------------------------------------

    async def _run(self) -> None:
        backoff = 0.1
        need_resync = True  # the first connection publishes the whole store
        next_beat = next_refresh = last_beat = 0.0
        while not self._stopping.is_set():
            self._wake.clear()
            try:
                now = time.monotonic()
                if need_resync or now >= next_refresh:
                    self._beat_wanted = False
                    await self._resync()
                    need_resync = False
                    last_beat = now
                    next_beat, next_refresh = now + self.period, now + self.refresh_every
                elif now >= next_beat or (self._beat_wanted and now >= last_beat + self.min_gap):
                    self._beat_wanted = False  # before reading the record: a later change beats again
                    next_beat, last_beat = now + self.period, now
                    if not await self.registry.heartbeat(self.record_fn(), self.tier):
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
            due = min(next_beat, last_beat + self.min_gap) if self._beat_wanted else next_beat
            await self._sleep(self._wake, due - time.monotonic())

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
        await self.registry.heartbeat(rec, self.tier)
        if not self.resyncs:
            # A predecessor with our backend id may have died without withdrawing.
            await self.registry.purge(rec.backend_id, rec.models, keep_instance=rec.instance_id,
                                      tier=self.tier)
        covered = len(self._events)
        # In a thread: the store's lock and a big snapshot must not stall the loop.
        snapshot = await asyncio.to_thread(self._snapshot_keys)
        # The covered events are dropped below, evictions included: withdraw whatever
        # Redis still lists for us beyond the snapshot (keys evicted while Redis was
        # unreachable, or written late by a Redis that was hung), so a resync leaves
        # Redis exactly equal to the store. Later evictions are applied after, in order.
        for model in set(snapshot) | set(rec.models):
            stale = await self.registry.advertised(rec.backend_id, model, self.tier)
            stale.difference_update(snapshot.get(model, ()))
            if stale:
                await self.registry.withdraw(rec.backend_id, rec.instance_id, model, sorted(stale),
                                             self.tier)
        for model, keys in snapshot.items():
            await self.registry.advertise(rec.backend_id, rec.instance_id, model, keys, self.tier)
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
                if ev[0] != insert or ev[1] != model or len(keys) >= KEYS_PER_CALL:
                    break
                keys.extend(ev[2])
                n += 1
            if insert:
                await self.registry.advertise(rec.backend_id, rec.instance_id, model, keys, self.tier)
            else:
                await self.registry.withdraw(rec.backend_id, rec.instance_id, model, keys, self.tier)
            for _ in range(n):
                self._events.popleft()

"""`kvroute serve`'s models on demand: which configured model runs, loaded when asked.

The launcher owns the processes; this module decides when a model's backend
replicas start and stop. Pinned and preloaded models start with the deployment.
Any other configured model starts when a proxy asks for it through the Redis load
stream (kvroute/core/model_loads.py). Before a load would pass `max_loaded_models` or
`memory_budget`, the least recently used unpinned model is unloaded, once its
in-flight requests have finished; models unused for their `idle_unload` are
unloaded too. Every state change is published for the proxies to show and wait on.

A load that fails (the process exits, or is not healthy within the load timeout) is
not retried for FAILED_RETRY_AFTER seconds: requests meanwhile get its error at once.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass, field

import orjson

from . import capacity
from .capacity import Cost, Refusal, Resident
from kvroute.config import DEMO, ConfigError, ModelSpec
from kvroute.core.model_loads import (FAILED, LOAD_FAILED, LOADED, LOADING, NO_CAPACITY,
                                      PUBLISH_PERIOD, UNLOADED, UNLOADING, ModelLoads,
                                      ModelState, quietly)
from kvroute.api.lifecycle import health_body
from kvroute.core.sizes import format_bytes

from .processes import Child, Processes

log = logging.getLogger("kvroute.loader")

FAILED_RETRY_AFTER = 30.0  # seconds a failed load is answered from its error, not retried
CAPACITY_RETRY_AFTER = 5.0  # what a refused request's Retry-After says
DRAIN_TIMEOUT = 120.0  # seconds an unloading model's in-flight requests get to finish
IDLE_CHECK = 1.0
STOP_WAIT = 5.0  # seconds the loader's tasks get to end once cancelled


@dataclass
class Slot:
    """One configured model on this machine: its replicas and their history."""

    spec: ModelSpec
    children: list[Child]
    cost: Cost  # of one replica
    state: str = UNLOADED
    last_used: float = 0.0
    loads: int = 0
    unloads: int = 0
    load_seconds: float = 0.0
    last_load_seconds: float = 0.0
    error: str = ""
    error_code: str = ""
    error_at: float = 0.0
    retry_after: float = 0.0
    task: asyncio.Task | None = None  # the load or unload in progress
    wanted: bool = False  # asked for while it was unloading: load it again after
    watches: list[asyncio.Task] = field(default_factory=list)

    @property
    def alias(self) -> str:
        return self.spec.alias

    @property
    def bytes(self) -> int:
        return self.spec.replicas * self.cost.total

    def resident(self) -> Resident:
        return Resident(self.alias, self.bytes, self.spec.pin, self.last_used,
                        movable=self.state == LOADED)


class Loader:
    def __init__(self, launcher: Processes, slots: list[Slot], budget: tuple[int, str]):
        self.launcher = launcher
        self.config = launcher.config
        self.slots = {s.alias: s for s in slots}
        self.machine = self.config.machine or f"{socket.gethostname()}:{self.config.port}"
        self.configured_at = time.time()  # /v1/models' `created` of a model not loaded
        self.loads: ModelLoads | None = None
        self.changed = asyncio.Event()
        self.admit = asyncio.Lock()  # one admission decision at a time
        self.tasks: list[asyncio.Task] = []
        self.budget, self.budget_source = budget  # bytes, and where the figure comes from

    # -- start and stop -----------------------------------------------------------

    def initial(self) -> tuple[list[Slot], list[str]]:
        """The models to start with the deployment (pinned, then preloaded while they
        fit), and notes about the others. Refuses a model that can never fit, or
        pinned models that do not fit together."""
        self._refuse_impossible()
        chosen: list[Slot] = []
        notes: list[str] = []
        order = sorted(self.slots.values(), key=lambda s: not s.spec.pin)
        for slot in order:
            if not (slot.spec.pin or slot.spec.preload):
                notes.append(f"{slot.alias}: loads on its first request")
                continue
            plan = capacity.plan_room([c.resident() for c in chosen], slot.resident(),
                                      self.config.max_loaded_models, self.budget,
                                      self.budget_source, evict=False)
            if isinstance(plan, Refusal):
                if slot.spec.pin:
                    raise ConfigError("pinned models do not fit: " + plan.message)
                notes.append(f"{slot.alias}: not preloaded ({plan.message}); loads on its "
                             "first request")
                continue
            chosen.append(slot)
            slot.state = LOADING
        return chosen, notes

    def _refuse_impossible(self) -> None:
        lines = [capacity.line(s.alias, s.spec.replicas, s.cost) for s in self.slots.values()]
        too_big = [s for s in self.slots.values() if s.bytes > self.budget]
        if too_big:
            raise ConfigError(
                "these models do not fit in memory:\n" + "\n".join(lines) + "\n" + "\n".join(
                    f"  total {s.alias}: {format_bytes(s.bytes)} > {format_bytes(self.budget)} "
                    f"({self.budget_source})" for s in too_big)
                + "\nLower replicas, cache_bytes, max_running_tokens, max_batch or "
                "max_prompt_tokens, or use "
                "smaller models.")

    async def start(self, url: str) -> None:
        self.loads = ModelLoads(url)
        now = time.time()
        for slot in self.slots.values():
            slot.last_used = now
        after = await quietly(self.loads.last_request_id(), "0-0")
        self.tasks = [asyncio.create_task(self._consume(after)),
                      asyncio.create_task(self._publish_loop()),
                      asyncio.create_task(self._idle_loop())]

    async def stop(self) -> None:
        tasks = self.tasks + [s.task for s in self.slots.values() if s.task]
        tasks += [w for s in self.slots.values() for w in s.watches]
        for task in tasks:
            task.cancel()
        # Bounded: a task that outlives its cancellation must not keep serve (and the
        # backends it stops after this) from stopping.
        _, stuck = await asyncio.wait(tasks, timeout=STOP_WAIT) if tasks else ((), ())
        if stuck:
            log.warning("%d loader tasks did not stop within %.0fs; stopping anyway",
                        len(stuck), STOP_WAIT)
        if self.loads is not None:
            await quietly(self.loads.withdraw(self.machine, list(self.slots)))
            await self.loads.close()

    # -- loading --------------------------------------------------------------------

    async def started(self, slot: Slot, seconds: float) -> None:
        """A model the launcher started with the deployment is healthy."""
        self._loaded(slot, seconds)

    def _loaded(self, slot: Slot, seconds: float) -> None:
        slot.state, slot.loads = LOADED, slot.loads + 1
        slot.load_seconds += seconds
        slot.last_load_seconds = seconds
        slot.last_used = time.time()
        slot.error = slot.error_code = ""
        slot.watches = [asyncio.create_task(self.launcher.watch(c)) for c in slot.children]
        log.info("loaded %s in %.1fs", slot.alias, seconds)
        self.changed.set()

    def request(self, alias: str) -> None:
        """A proxy asked for `alias`: load it unless it is loaded, loading or failing."""
        slot = self.slots.get(alias)
        if slot is None or self.launcher.stopping.is_set():
            return
        if slot.state in (LOADED, LOADING):
            return
        if slot.state == UNLOADING:
            slot.wanted = True
            return
        if slot.state == FAILED and time.time() - slot.error_at < FAILED_RETRY_AFTER:
            self.changed.set()  # republish the error for the proxy that asked
            return
        if slot.spec.path != DEMO:
            try:  # before `loading` is published: a path that is not there never loads,
                capacity.check_model_path(slot.spec.path)  # and unloads nothing
            except ConfigError as exc:
                self._fail(slot, FAILED, LOAD_FAILED, f"loading model '{slot.alias}' failed: "
                           f"{exc}", FAILED_RETRY_AFTER)
                return
        slot.state = LOADING
        self.changed.set()
        slot.task = asyncio.create_task(self._load(slot))

    async def _load(self, slot: Slot) -> None:
        async with self.admit:
            others = [s.resident() for s in self.slots.values()
                      if s is not slot and s.state in (LOADED, LOADING)]
            plan = capacity.plan_room(others, slot.resident(), self.config.max_loaded_models,
                                      self.budget, self.budget_source)
            if isinstance(plan, Refusal):
                log.warning("%s", plan.message)
                self._fail(slot, UNLOADED, NO_CAPACITY, plan.message, CAPACITY_RETRY_AFTER)
                return
            for alias in plan:
                self.unload(self.slots[alias], "to make room for " + slot.alias)
        draining = [s.task for s in self.slots.values() if s.state == UNLOADING and s.task]
        await asyncio.gather(*draining, return_exceptions=True)
        t0 = time.monotonic()
        log.info("loading %s (%s)", slot.alias, format_bytes(slot.bytes))
        try:
            for child in slot.children:
                child.wanted = True
                self.launcher.repick_port(child)
                await self.launcher.spawn(child)
            # Loaded once one replica answers: the proxies route to it while the others
            # finish starting (each is watched, restarted should it exit). As long as a
            # start may take, not load_timeout: that is how long a request waits, and a
            # load that outlasts one request's patience still serves the next ones.
            await self.launcher.wait_healthy(slot.children, self.config.ready_timeout, enough=1)
        except asyncio.CancelledError:
            await self.launcher.stop_children(slot.children)
            raise
        except RuntimeError as exc:
            await self.launcher.stop_children(slot.children)
            self._fail(slot, FAILED, LOAD_FAILED, f"loading model '{slot.alias}' failed: {exc}",
                       FAILED_RETRY_AFTER)
            return
        self._loaded(slot, time.monotonic() - t0)

    def _fail(self, slot: Slot, state: str, code: str, message: str, retry_after: float) -> None:
        if code != NO_CAPACITY:  # a refusal for room is logged where it is decided
            log.warning("%s; requests for it get this error for %.0fs, then it is tried again",
                        message, retry_after)
        slot.state, slot.error_code, slot.error = state, code, message
        slot.error_at, slot.retry_after = time.time(), retry_after
        self.changed.set()

    # -- unloading ------------------------------------------------------------------

    def unload(self, slot: Slot, why: str) -> None:
        slot.state = UNLOADING
        self.changed.set()
        log.info("unloading %s (%s)", slot.alias, why)
        slot.task = asyncio.create_task(self._unload(slot))

    async def _unload(self, slot: Slot) -> None:
        # Proxies stop routing here once they read UNLOADING; what they already sent
        # finishes first. A proxy's view lags by up to a refresh: idle twice in a row.
        deadline = time.monotonic() + DRAIN_TIMEOUT
        quiet = 0
        while quiet < 2 and time.monotonic() < deadline:
            busy = await asyncio.to_thread(_busy, slot.children)
            quiet = 0 if busy else quiet + 1
            await asyncio.sleep(0.5)
        for child in slot.children:
            child.wanted = False
        await self.launcher.stop_children(slot.children)
        for watch in slot.watches:
            watch.cancel()
        slot.watches = []
        slot.state, slot.unloads = UNLOADED, slot.unloads + 1
        self.changed.set()
        log.info("unloaded %s", slot.alias)
        if slot.wanted:
            slot.wanted = False
            self.request(slot.alias)

    async def _idle_loop(self) -> None:
        while True:
            await asyncio.sleep(IDLE_CHECK)
            used = await quietly(self.loads.used(), {})
            now = time.time()
            for slot in self.slots.values():
                slot.last_used = max(slot.last_used, used.get(slot.alias, 0.0))
                idle = slot.spec.idle_unload
                if (slot.state == LOADED and not slot.spec.pin and idle > 0
                        and now - slot.last_used > idle):
                    # Requests mark a use when they arrive: one that runs longer than
                    # idle_unload still counts as use until it ends.
                    if await asyncio.to_thread(_busy, slot.children):
                        slot.last_used = time.time()
                    elif slot.state == LOADED:
                        self.unload(slot, f"idle for {now - slot.last_used:.0f}s")

    # -- Redis ----------------------------------------------------------------------

    async def _consume(self, after: str) -> None:
        while True:
            try:
                after, models = await self.loads.load_requests(after, block_s=2.0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: try again, a proxy resends its requests
                log.debug("load requests unavailable: %s", exc)
                await asyncio.sleep(1.0)
                continue
            for model in models:
                self.request(model)

    def snapshot(self) -> list[ModelState]:
        return [ModelState(
            model=s.alias, machine=self.machine, state=s.state, pinned=s.spec.pin,
            replicas=s.spec.replicas, memory_bytes=s.bytes, last_used=s.last_used, loads=s.loads,
            unloads=s.unloads, load_seconds=round(s.load_seconds, 3),
            last_load_seconds=round(s.last_load_seconds, 3), error=s.error,
            error_code=s.error_code, error_at=s.error_at, retry_after=s.retry_after,
            configured_at=self.configured_at)
            for s in self.slots.values()]

    async def publish(self) -> None:
        self.changed.clear()
        await quietly(self.loads.publish(self.snapshot()))

    async def _publish_loop(self) -> None:
        while True:
            await self.publish()
            try:
                await asyncio.wait_for(self.changed.wait(), PUBLISH_PERIOD)
            except asyncio.TimeoutError:
                pass


def _busy(children: list[Child]) -> bool:
    """Whether any of these running backends has a request queued or running, or does
    not answer its /health (a long prefill can hold it up): then it may be busy."""
    for child in children:
        if child.proc is None or child.proc.returncode is not None:
            continue
        body = health_body(child.url, timeout=5)
        if body is None:
            return True
        try:
            engine = orjson.loads(body).get("engine", {})
        except ValueError:
            return True
        if engine.get("queued", 0) + engine.get("prefilling", 0) + engine.get("decoding", 0):
            return True
    return False

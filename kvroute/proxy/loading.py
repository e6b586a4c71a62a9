"""Requests for a model that is not loaded: ask for it, hold them, answer when it is.

`kvroute serve` publishes the state of every configured model in Redis
(kvroute/core/model_loads.py). A request for a configured model with no live backend
appends a load request to the Redis stream, which the `kvroute serve` of each
machine configured for that model reads. The request then waits, up to
`load_timeout`, until a backend serving the model is live; concurrent requests for
the same model share one wait (and one load request, resent while the wait lasts,
so a machine that restarted meanwhile still hears it).

A streaming client gets its SSE headers at once and a `: loading` comment every few
seconds while it waits, so that neither it nor a gateway in between gives up; the
stream then carries the answer, or the error in the client API's own error event. A
model whose load failed answers its error at once until its machine retries it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import orjson
from aiohttp import web

from kvroute.api.errors import APIError
from kvroute.api.http import SSE_HEADERS
from kvroute.core.model_loads import (FAILED, LOAD_FAILED, LOADED, LOADING, NO_CAPACITY,
                                      UNLOADED, UNLOADING, ModelLoads, ModelState, quietly)

log = logging.getLogger("kvroute.proxy.loading")

HELD = "kvroute_held_stream"  # request key: the SSE response started while its model loaded

KEEPALIVE = 2.0  # seconds between `: loading` comments
POLL = 0.2  # seconds between looks at the states and the registry while a load runs
RESEND = 3.0  # seconds between load requests of one wait
REFRESH = 0.5  # seconds between refreshes of the states this proxy shows
TOUCH_EVERY = 1.0  # seconds between two last-use marks of one model by this proxy

# How the client's API ends a started stream with an error: its own error event.
ErrorEvent = Callable[[APIError], bytes]


@dataclass
class OnDemand:
    """This proxy's view of the configured models, and the loads it waits on."""

    states: ModelLoads
    load_timeout: float
    summaries: dict[str, ModelState] = field(default_factory=dict)
    waits: dict[str, asyncio.Future] = field(default_factory=dict)
    touched: dict[str, float] = field(default_factory=dict)
    background: set = field(default_factory=set)
    closing: bool = False  # the proxy is stopping: held requests are answered at once

    def accepted(self, model: str) -> bool:
        """Whether the model's machine has taken its load (or has it loaded)."""
        s = self.summaries.get(model)
        return s is not None and s.state in (LOADING, LOADED)

    def needs_load(self, model: str, serving: bool) -> bool:
        """A configured model that is not loaded (or being unloaded), or whose backend this
        proxy has not seen yet. Records of an unloaded model's backends linger a few
        seconds in the proxy's view: the published state decides."""
        s = self.summaries.get(model)
        if s is None:
            return False  # not managed by a `kvroute serve` (a standalone backend), or unknown
        return s.state != LOADED or not serving

    async def must_wait(self, model: str, serving: bool) -> bool:
        """`needs_load`, with the published states read again where a backend serves
        the model but this proxy's copy of them (refreshed every `REFRESH`) does not
        say it is loaded yet: a load that just ended. Without the second look the
        first requests after it were held, and waited a `POLL` in `_load` before
        they were routed (0.2-0.3 s on the 2-core VM)."""
        if not self.needs_load(model, serving):
            return False
        if not serving:
            return True
        await self.refresh()
        return self.needs_load(model, serving)

    def recent_failure(self, model: str) -> APIError | None:
        """The error of a load that failed moments ago and is not being retried yet."""
        s = self.summaries.get(model)
        if s is not None and s.state == FAILED and time.time() - s.error_at < s.retry_after:
            return error_of(model, s)
        return None

    def touch(self, model: str) -> None:
        """Mark a use of a managed model (for LRU and idle unloading), once a second."""
        now = time.time()
        if model not in self.summaries or now - self.touched.get(model, 0.0) < TOUCH_EVERY:
            return
        self.touched[model] = now
        task = asyncio.ensure_future(quietly(self.states.touch(model, now)))
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def refresh(self) -> None:
        summaries = await quietly(self.states.summaries())
        if summaries is not None:
            self.summaries = summaries

    async def refresh_loop(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(REFRESH)

    async def wait_loaded(self, model: str, serving: Callable[[], "asyncio.Future[bool]"]) -> None:
        """Until a backend serving `model` is live; APIError when its load fails, is
        refused, or takes longer than load_timeout."""
        if self.closing:
            raise shutting_down()
        if (failed := self.recent_failure(model)) is not None:
            raise failed  # answered at once: no wait to log
        wait = self.waits.get(model)
        if wait is None or wait.done():
            s = self.summaries.get(model)
            log.info("requests for %s wait for a live backend (model state %s, up to %.0fs)",
                     model, s.state if s else "unknown", self.load_timeout)
            wait = self.waits[model] = asyncio.ensure_future(self._load(model, serving))
            wait.add_done_callback(_consume_exception)
        try:
            await asyncio.wait_for(asyncio.shield(wait), self.load_timeout)
        except asyncio.TimeoutError:
            raise self._timed_out(model) from None

    async def _load(self, model: str, serving) -> None:
        started = time.time()
        deadline = time.monotonic() + self.load_timeout
        sent = 0.0
        while time.monotonic() < deadline:
            if self.closing:
                raise shutting_down()
            s = self.summaries.get(model)
            if s is not None and s.error and s.error_at >= started - 0.5 and s.state in (FAILED, UNLOADED):
                raise error_of(model, s)
            if (failed := self.recent_failure(model)) is not None:
                raise failed  # failed a moment ago: no new attempt yet
            if s is not None and s.state == LOADED and await serving():
                log.info("%s serves: its waiting requests go on after %.1fs", model,
                         time.time() - started)
                return
            if time.monotonic() - sent > RESEND and (s is None or s.state != LOADED):
                sent = time.monotonic()
                await quietly(self.states.request_load(model, "proxy"))
            await asyncio.sleep(POLL)
            await self.refresh()
        raise self._timed_out(model)

    def _timed_out(self, model: str) -> APIError:
        return APIError(503, f"Model '{model}' had no live backend within "
                        f"{self.load_timeout:.0f}s (load_timeout): its load or restart did not "
                        "finish.", "server_error", "model", "model_load_timeout")

    def listing(self, live: dict[str, float], images: set[str] = frozenset()) -> list[dict]:
        """/v1/models: every configured model, and any other model a live backend serves
        (`live`: each with when its backends loaded it); for a live one, what it takes
        (`input_modalities`: text, and image for `images`)."""
        out = []
        for model in sorted(set(self.summaries) | set(live)):
            s = self.summaries.get(model)
            entry = {"id": model, "object": "model", "created": _created(model, live, s),
                     "owned_by": "kvroute", "state": public_state(s, model in live)}
            if model in live:
                entry["input_modalities"] = ["text", "image"] if model in images else ["text"]
            if s is not None and s.state == FAILED and s.error:
                entry["error"] = s.error
            out.append(entry)
        return out

    def entry(self, model: str, live: dict[str, float],
              images: set[str] = frozenset()) -> dict | None:
        """/v1/models/{id}: the listing's entry for `model`, None when it lists none."""
        return next((e for e in self.listing(live, images) if e["id"] == model), None)

    def stats(self) -> list[dict]:
        return [{"model": m, "state": s.state, "machine": s.machine, "pinned": s.pinned,
                 "memory_bytes": s.memory_bytes, "last_used": s.last_used, "loads": s.loads,
                 "unloads": s.unloads, "load_seconds": s.load_seconds,
                 "last_load_seconds": s.last_load_seconds, "error": s.error}
                for m, s in sorted(self.summaries.items())]


def _created(model: str, live: dict[str, float], s: ModelState | None) -> int:
    """A Unix time for `created`: when the live backends loaded the model; for one not
    loaded, when its machine's `kvroute serve` began to offer it (it has no load time
    now; not its state's publication time, which moves every few seconds)."""
    if model in live:
        return int(live[model])
    return int(s.configured_at) if s is not None else 0


def public_state(s: ModelState | None, live: bool) -> str:
    """loaded, loading or unloaded. Loaded means a backend of it is live in this
    proxy's view (it answers /health, and a request routes at once): a model published
    loaded whose backend this proxy has not seen yet is still loading. A model being
    unloaded still answers."""
    if s is None:
        return LOADED if live else UNLOADED
    if s.state in (LOADED, UNLOADING):
        return LOADED if live else LOADING
    return LOADING if s.state == LOADING else UNLOADED


def shutting_down() -> APIError:
    err = APIError(503, "The proxy is shutting down; send the request again.", "server_error",
                   None, "shutting_down")
    err.retry_after = 1.0  # type: ignore[attr-defined]
    return err


def error_of(model: str, s: ModelState) -> APIError:
    if s.error_code == NO_CAPACITY:
        err = APIError(503, s.error[:1].upper() + s.error[1:] + ".", "server_error", "model",
                       NO_CAPACITY)
    else:
        err = APIError(503, f"Model '{model}' could not be loaded: {s.error}", "server_error",
                       "model", s.error_code or LOAD_FAILED)
    left = s.retry_after - (time.time() - s.error_at)
    err.retry_after = max(1.0, left if s.error_code != NO_CAPACITY else s.retry_after)  # type: ignore[attr-defined]
    return err


def _consume_exception(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # the waiters raise it; no "never retrieved" warning when none is left


# -- holding a request ---------------------------------------------------------------


async def hold(request: web.Request, models: OnDemand, model: str, stream: bool, serving,
               error_event: ErrorEvent) -> web.StreamResponse | None:
    """Wait for `model` to load. A streaming request gets its SSE response started and
    keep-alive comments; it is left in request[HELD] for the relay to continue. Returns
    a finished response when the wait failed on a started stream (the error written as
    `error_event` encodes it), else None (raises APIError when nothing was sent yet)."""
    if not stream:
        await models.wait_loaded(model, serving)
        return None
    wait = asyncio.ensure_future(models.wait_loaded(model, serving))
    resp = held(request)  # a second wait (a restart after a load) goes on in it
    if resp is None:
        try:
            # The stream starts once the model's machine has taken the load (a refusal,
            # for room or a failed path, is then a plain 503 with Retry-After), or after
            # a keep-alive's time at most: a client or gateway must not wait on silence.
            deadline = time.monotonic() + KEEPALIVE
            while not wait.done() and not models.accepted(model) and time.monotonic() < deadline:
                await asyncio.wait([wait], timeout=POLL)
            if wait.done():
                wait.result()  # raises the error: nothing was sent yet
                return None
        except BaseException:
            wait.cancel()
            raise
    try:
        if resp is None:
            resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
            await resp.prepare(request)
            request[HELD] = resp
        while not wait.done():
            await resp.write(b": loading\n\n")
            await asyncio.wait([wait], timeout=KEEPALIVE)
        wait.result()
    except APIError as err:
        return await write_error(request, err, error_event)
    except ConnectionError:
        return resp  # the client left while it waited; the load goes on for the others
    finally:
        if not wait.done():
            wait.cancel()
    return None


def held(request: web.Request) -> web.StreamResponse | None:
    """The SSE response started while the request's model loaded; None if it did not wait."""
    return request.get(HELD)


async def write_error(request: web.Request, err: APIError,
                      error_event: ErrorEvent) -> web.StreamResponse:
    """End a started stream with `err` in the client API's own error event."""
    resp = request[HELD]
    try:
        await resp.write(error_event(err))
        await resp.write_eof()
    except ConnectionError:
        pass
    return resp


async def finish(request: web.Request, resp: web.StreamResponse,
                 error_event: ErrorEvent) -> web.StreamResponse:
    """After a held stream was routed: an answer that is not the stream itself (a whole
    JSON error from the backend) goes into the stream as an error event."""
    started = held(request)
    if started is None or resp is started:
        return resp
    try:
        err = orjson.loads(resp.body)["error"]
        error = APIError(resp.status, str(err.get("message")), str(err.get("type")),
                         err.get("param"), err.get("code"))
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        error = APIError(502, "The backend answered a stream with a whole body.", "server_error",
                         None, "backend_failed")
    return await write_error(request, error, error_event)

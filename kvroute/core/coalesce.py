"""Coalesced script calls: the calls issued within one event-loop tick share one
pipeline (one write, one read, one connection), whatever the burst size; a call with
nothing else queued or in flight can go at once, alone (`call_alone`).

Each caller waits for its own answer under its own deadline; a call that misses it
answers "unknown" to that caller only, while the pipeline carries on for the others.
Only Redis itself failing (refused, errored, or silent for `stall_after` seconds, as
a pipeline or a run of lone calls sees it) says something about Redis: `on_failure`
is then told, and the registry stops asking for a moment.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass
from typing import Any, Callable

from redis.exceptions import NoScriptError


@dataclass
class _Call:
    script: str
    sha: str
    keys: list[str]
    args: list[Any]
    future: asyncio.Future


class Unanswered(Exception):
    """The call's pipeline failed; the message says why."""


class ScriptBatcher:
    def __init__(self, redis, *, stall_after: float, on_failure: Callable[[str], None],
                 on_success: Callable[[], None]):
        self._redis = redis
        self.stall_after = stall_after
        self._on_failure = on_failure
        self._on_success = on_success
        self._queue: list[_Call] = []
        self._scheduled = False
        self._tasks: set[asyncio.Task] = set()
        self._shas: dict[str, str] = {}
        self._alone = 0  # calls sent by call_alone and not answered yet
        # When the first of a run of lone calls that missed their callers' deadlines was
        # sent (None once Redis answers): cancelled calls cannot time the pipeline out,
        # so a Redis silent for stall_after is noticed through them.
        self._late_since: float | None = None
        self.pipelines = 0  # pipelines sent (for tests and benchmarks)
        self.calls = 0

    def idle(self) -> bool:
        """Nothing queued or in flight: a call made now would travel alone."""
        return not self._queue and not self._tasks and not self._alone

    async def call_alone(self, script: str, keys: list[str], args: list[Any]) -> Any:
        """One EVALSHA sent at once from the caller's own task. A lone call through the
        pipeline waits two extra turns of the event loop (its task starts on the next
        turn, and its answer wakes the caller one turn after the task), each as long as
        whatever else the loop is relaying; under a burst the calls that follow this one
        find it in flight and share a pipeline. Raises Unanswered on any Redis trouble.
        """
        sha = self._sha(script)
        self._alone += 1
        self.calls += 1
        sent = time.monotonic()
        try:
            try:
                reply = await self._redis.execute_command("EVALSHA", sha, len(keys), *keys, *args)
            except NoScriptError:
                await self._redis.script_load(script)
                reply = await self._redis.execute_command("EVALSHA", sha, len(keys), *keys, *args)
        except asyncio.CancelledError:  # the caller's deadline (or the caller) went
            if self._late_since is None:
                self._late_since = sent
            elif sent - self._late_since >= self.stall_after:
                self._on_failure(f"no answer within {self.stall_after:.2f}s (lone calls)")
            raise
        except Exception as exc:  # any Redis trouble: this caller answers "unknown"
            why = f"{type(exc).__name__}: {exc}"
            self._on_failure(f"{why} (alone)")
            raise Unanswered(why) from None
        finally:
            self._alone -= 1
        self._answered()
        return reply

    def _answered(self) -> None:
        self._late_since = None
        self._on_success()

    def _sha(self, script: str) -> str:
        sha = self._shas.get(script)
        if sha is None:
            sha = self._shas[script] = hashlib.sha1(script.encode()).hexdigest()
        return sha

    def call(self, script: str, keys: list[str], args: list[Any]) -> asyncio.Future:
        """Queue one EVALSHA of `script`; the future gets its reply or Unanswered."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue.append(_Call(script, self._sha(script), keys, args, fut))
        if not self._scheduled:
            # The task takes the queue when it first runs, on the loop's next turn:
            # every call made in this tick joins its pipeline. (A task started from
            # a call_soon callback would cost a lone call one more turn of the loop.)
            self._scheduled = True
            task = loop.create_task(self._run())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return fut

    async def _run(self) -> None:
        self._scheduled = False
        batch, self._queue = self._queue, []
        self.pipelines += 1
        self.calls += len(batch)
        t0 = time.monotonic()
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for runs the
            # pipeline in a task of its own, one more turn of the loop per lookup.
            async with asyncio.timeout(self.stall_after):
                replies = await self._execute(batch)
        except TimeoutError:
            why = f"no answer within {self.stall_after:.2f}s"
        except Exception as exc:  # any Redis trouble: the callers answer "unknown"
            why = f"{type(exc).__name__}: {exc}"
        else:
            for call, reply in zip(batch, replies):
                if not call.future.done():
                    if isinstance(reply, Exception):
                        call.future.set_exception(Unanswered(f"{type(reply).__name__}: {reply}"))
                    else:
                        call.future.set_result(reply)
            self._answered()
            return
        self._on_failure(f"{why} (pipeline of {len(batch)}, {time.monotonic() - t0:.3f}s)")
        for call in batch:
            if not call.future.done():
                call.future.set_exception(Unanswered(why))

    async def _execute(self, batch: list[_Call]) -> list[Any]:
        replies = await self._pipeline(batch)
        missing = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
        if missing:
            # A restarted (or new cluster) Redis lost the scripts: load and ask again.
            for script in {batch[i].script for i in missing}:
                await self._redis.script_load(script)
            again = await self._pipeline([batch[i] for i in missing])
            for i, reply in zip(missing, again):
                replies[i] = reply
        return replies

    async def _pipeline(self, batch: list[_Call]) -> list[Any]:
        pipe = self._redis.pipeline(transaction=False)
        for c in batch:
            # execute_command: redis-py blocks the evalsha method on cluster pipelines,
            # but a script touching one slot is as safe there as any single-key command.
            pipe.execute_command("EVALSHA", c.sha, len(c.keys), *c.keys, *c.args)
        return await pipe.execute(raise_on_error=False)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

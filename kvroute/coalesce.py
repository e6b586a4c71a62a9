"""Coalesced script calls: the calls issued within one event-loop tick share one
pipeline (one write, one read, one connection), whatever the burst size.

Each caller waits for its own answer under its own deadline; a call that misses it
answers "unknown" to that caller only, while the pipeline carries on for the others.
Only the pipeline itself failing (Redis refused, errored, or stayed silent for
`stall_after` seconds) says something about Redis: `on_failure` is then told, and the
registry stops asking for a moment.
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
        self.pipelines = 0  # pipelines sent (for tests and benchmarks)
        self.calls = 0

    def call(self, script: str, keys: list[str], args: list[Any]) -> asyncio.Future:
        """Queue one EVALSHA of `script`; the future gets its reply or Unanswered."""
        loop = asyncio.get_running_loop()
        sha = self._shas.get(script)
        if sha is None:
            sha = self._shas[script] = hashlib.sha1(script.encode()).hexdigest()
        fut = loop.create_future()
        self._queue.append(_Call(script, sha, keys, args, fut))
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
            self._on_success()
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

"""The processes `kvroute serve` runs, and what the loader may ask of them.

The launcher owns the processes; the loader decides when a model's backends start and
stop and asks the launcher through `Processes`, so neither module imports the other.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field
from typing import Protocol

from kvroute.config import ServeConfig


@dataclass
class Child:
    name: str
    args: list[str]
    url: str  # health is at url + /health
    color: str
    env: dict[str, str] = field(default_factory=dict)  # secrets: never on the command line
    proc: asyncio.subprocess.Process | None = None
    restarts: int = 0
    started: float = 0.0
    pumps: list[asyncio.Task] = field(default_factory=list)
    wanted: bool = True  # False once its model is unloaded: an exit is then no crash
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=8))


class Processes(Protocol):
    """What the loader needs of the launcher."""

    config: ServeConfig
    stopping: asyncio.Event

    async def spawn(self, child: Child) -> None: ...

    async def wait_healthy(self, children: list[Child], timeout: float,
                           enough: int | None = None) -> None: ...

    async def stop_children(self, children: list[Child]) -> None: ...

    async def watch(self, child: Child) -> None: ...

    def repick_port(self, child: Child) -> None: ...

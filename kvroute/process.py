"""Process lifecycle helpers shared by the backend and the proxy."""

from __future__ import annotations

import asyncio
import logging
import os

log = logging.getLogger("kvroute.process")


async def watch_parent(stop: asyncio.Event, period: float = 1.0) -> None:
    """Under `kvroute serve`, stop when the launcher is gone.

    Children run in sessions of their own (so Ctrl-C reaches only the launcher,
    which stops them in order); if the launcher itself is killed, this is what
    keeps them from living on as orphans. Works on Linux and macOS alike.
    """
    parent = os.environ.get("KVROUTE_PARENT_PID")
    if not parent or not parent.isdigit():
        return
    while not stop.is_set():
        if os.getppid() != int(parent):
            log.warning("the kvroute launcher (pid %s) is gone; shutting down", parent)
            stop.set()
            return
        try:
            await asyncio.wait_for(stop.wait(), period)
        except asyncio.TimeoutError:
            pass

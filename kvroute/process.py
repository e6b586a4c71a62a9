"""Process lifecycle helpers shared by the backend and the proxy."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from aiohttp import web

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


async def start_site(app: web.Application, host: str, port: int) -> web.AppRunner:
    # handler_cancellation: a client that disconnects cancels its handler, which is
    # how a disconnect reaches the engine (backend) or the upstream request (proxy).
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


async def wait_for_stop() -> None:
    """Until SIGINT or SIGTERM, or until the launcher that started us is gone."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    watcher = asyncio.create_task(watch_parent(stop))
    await stop.wait()
    await watcher

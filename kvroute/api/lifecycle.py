"""A server's lifecycle, shared by the backend and the proxy: its port bound before it
loads, its site started, health polls, and the signals that stop it."""

from __future__ import annotations

import asyncio
import http.client
import logging
import os
import signal
import socket
import urllib.request

import orjson
from aiohttp import web

log = logging.getLogger("kvroute.lifecycle")


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


def health_pid(body: bytes | None) -> int | None:
    """The pid a /health body names (proxies and backends both say it)."""
    try:
        return orjson.loads(body).get("pid") if body else None
    except (orjson.JSONDecodeError, AttributeError):
        return None


def health_body(url: str, timeout: float) -> bytes | None:
    """The body of `url`/health when it answers 200; None when nothing answers there,
    it answers an error, or what answers is not HTTP (HTTPException). While a child's
    port is not listening yet, a local connect can even meet itself (TCP simultaneous
    open: the client's ephemeral port is the port it dials) and read its own request."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as r:
            return r.read() if r.status == 200 else None
    except (OSError, http.client.HTTPException):
        return None


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """The server's sockets, bound but not listening yet (connections are refused).

    A backend binds these before it loads its model: `kvroute serve` picked the port as
    free before the process started, and through a load of seconds to minutes an
    outgoing connection (which takes any unbound port) could otherwise claim it.
    """
    socks: list[socket.socket] = []
    seen = set()
    try:
        for family, type_, proto, _, addr in socket.getaddrinfo(
                host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE):
            if (family, addr) in seen:
                continue
            seen.add((family, addr))
            try:
                sock = socket.socket(family, type_, proto)
            except OSError:  # a family this host lacks (IPv6 off): skipped, as asyncio does
                continue
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # as asyncio does: one socket per family
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(addr)
            except OSError as e:
                raise OSError(e.errno, f"cannot listen on {addr[0]}:{port}: {e.strerror}") from None
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    if not socks:
        raise OSError(f"cannot listen on {host}:{port}: no usable address")
    return socks


async def start_site(app: web.Application, host: str, port: int,
                     socks: list[socket.socket] | None = None) -> web.AppRunner:
    """Serve `app` on host:port, or on `socks` from bind_sockets()."""
    # handler_cancellation: a client that disconnects cancels its handler, which is
    # how a disconnect reaches the engine (backend) or the upstream request (proxy).
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    try:
        if socks is None:
            await web.TCPSite(runner, host, port).start()
        for sock in socks or ():
            await web.SockSite(runner, sock).start()
    except BaseException:
        # The app's startup hooks already run background tasks; left running they keep
        # the process from exiting (asyncio.run waits for them), silently.
        await runner.cleanup()
        raise
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

"""Start and stop a child `redis-server` on a free loopback port.

Used by the tests and the benchmark, and later by `kvroute serve` when no Redis URL
is given. The server keeps nothing on disk (`--save '' --appendonly no`), so a
restart comes back empty: exactly what a crashed production Redis looks like.
"""

from __future__ import annotations

import atexit
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

log = logging.getLogger("kvroute.redis_server")

INSTALL_HINT = "install it with `apt-get install redis-server` (Debian/Ubuntu) or `brew install redis` (macOS)"

# Servers still running at interpreter exit are stopped, so a crashed test run
# does not leave redis-server processes behind.
_running: "weakref.WeakSet[RedisServer]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for server in list(_running):
        server.stop()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; macOS and Windows start theirs higher


def free_port(spare: int = 32) -> int:
    """A port that was free a moment ago (the caller retries if it got taken), below
    the kernel's ephemeral range with `spare` ports above it still below (a serve's
    replicas take the next ones). Ports from bind(port 0) lie inside that range, where
    any outgoing connection (a Redis client, a health poll) can take one before the
    server it was picked for binds it."""
    high = _ephemeral_low() - spare
    for _ in range(200):
        port = random.randrange(max(1024, high - 12000), high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port found below {high}")


def _resp(*args: str) -> bytes:
    out = [f"*{len(args)}\r\n".encode()]
    for a in args:
        b = a.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def ping(port: int, password: str | None = None, timeout: float = 0.5) -> bool:
    """True if a Redis on 127.0.0.1:port answers PING (raw RESP: no client library needed)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.settimeout(timeout)
            request = (_resp("AUTH", password) if password else b"") + _resp("PING")
            s.sendall(request)
            data = b""
            while b"PONG" not in data and b"-" not in data:
                chunk = s.recv(256)
                if not chunk:
                    return False
                data += chunk
            return b"+PONG" in data
    except OSError:
        return False


def _die_with_parent() -> None:
    """Linux: the kernel sends SIGTERM to redis-server when its owner dies, even by
    SIGKILL. (Elsewhere the owner's clean shutdown is what stops it.)"""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class RedisServer:
    """A throwaway redis-server child process.

        with RedisServer() as server:
            registry = Registry(server.url)
    """

    def __init__(
        self,
        *,
        password: str | None = None,
        port: int | None = None,
        binary: str = "redis-server",
        startup_timeout: float = 10.0,
        extra_args: list[str] | None = None,
    ):
        self.password = password
        self.port = port
        self.binary = binary
        self.startup_timeout = startup_timeout
        self.extra_args = list(extra_args or [])
        self.proc: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None
        self._paused = False

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        assert self._dir is not None, "server not started"
        return Path(self._dir.name) / "redis.log"

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> "RedisServer":
        """Start the server (on self.port if set, else a free port) and wait for PING."""
        if self.proc is not None:
            return self
        exe = shutil.which(self.binary)
        if exe is None:
            raise RuntimeError(f"`{self.binary}` not found on PATH; {INSTALL_HINT}")
        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="kvroute-redis-")
        fixed_port = self.port is not None
        # An auto-picked port can be grabbed between free_port() and redis binding it.
        for attempt in range(5):
            if not fixed_port:
                self.port = free_port()
            if self._spawn(exe):
                _running.add(self)
                return self
            if fixed_port:
                break
        raise RuntimeError(f"redis-server did not start on port {self.port}:\n{self._log_tail()}")

    def _spawn(self, exe: str) -> bool:
        args = [
            exe,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self._dir.name,
            "--logfile", str(self.log_path),
            "--daemonize", "no",
        ]
        if self.password:
            args += ["--requirepass", self.password]
        args += self.extra_args
        # A session of its own: a terminal's Ctrl-C must reach the owner, which stops
        # Redis last (after backends withdrew), not Redis directly.
        self.proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + self.startup_timeout
        delay = 0.002
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:  # exited: e.g. port taken
                self.proc = None
                return False
            if ping(self.port, self.password):
                self._paused = False
                return True
            time.sleep(delay)  # polling backoff, not a wait-and-hope: PING decides
            delay = min(delay * 2, 0.05)
        self._kill()
        return False

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, wait, then SIGKILL. Keeps the port so restart() can reuse it."""
        proc = self.proc
        if proc is None:
            return
        if self._paused:
            self.resume()  # a stopped process cannot act on SIGTERM
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("redis-server on port %s ignored SIGTERM for %ss; killing it", self.port, timeout)
            proc.kill()
            proc.wait()
        self.proc = None
        _running.discard(self)

    def _kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def restart(self) -> "RedisServer":
        """Stop and start again on the same port. Comes back empty (no persistence)."""
        self.stop()
        return self.start()

    def pause(self) -> None:
        """SIGSTOP: connections stay open but nothing answers (a hung Redis)."""
        if self.proc is not None and not self._paused:
            os.kill(self.proc.pid, signal.SIGSTOP)
            self._paused = True

    def resume(self) -> None:
        if self.proc is not None and self._paused:
            os.kill(self.proc.pid, signal.SIGCONT)
            self._paused = False

    def close(self) -> None:
        """Stop and remove the server's scratch directory."""
        self.stop()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

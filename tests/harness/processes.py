"""kvroute's processes as a test starts them: backends, proxies, `kvroute serve`, and a
fleet of them around one redis-server. Each logs to a file the test can read."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from tests.harness.http import get_json, request
from tests.harness.paths import ROOT
from tests.harness.polling import wait_until
from tests.harness.redis import RedisServer, free_port


def terminate(proc: subprocess.Popen | None, timeout: float, kill_wait: float | None = 5.0) -> None:
    """SIGTERM `proc` and wait up to `timeout`; past it, SIGKILL and wait `kill_wait`.
    A graceful stop lets in-flight requests finish, and streams a test left open could
    hold it for a whole shutdown timeout: tests of shutdown itself check exit codes on
    their own processes."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(kill_wait)


class BackendProcess:
    def __init__(self, model: Path | str, model_id: str, log_dir: Path, extra: list[str] | None = None,
                 port: int | None = None, backend_id: str | None = None, env: dict | None = None):
        self.model = str(model)
        self.model_id = model_id
        self.port = port or free_port()
        self.backend_id = backend_id or f"test-{self.port}"
        self.extra = extra or []
        self.log_path = Path(log_dir) / f"{self.backend_id}.log"
        self.env = env or {}
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 90.0) -> None:
        cmd = [sys.executable, "-m", "kvroute.cli", "backend", "--model", self.model,
               "--model-id", self.model_id, "--port", str(self.port), "--id", self.backend_id,
               *self.extra]
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **self.env})
        wait_until(self._ready, timeout, interval=0.05, what=f"backend {self.backend_id} health")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"backend exited with {self.proc.returncode}; log:\n{self.log()}")
        return request(self.url + "/health", timeout=2)[0] == 200

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def health(self) -> dict:
        return get_json(self.url + "/health")

    def cache(self) -> list[dict]:
        return get_json(self.url + "/debug/cache")["entries"]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        terminate(self.proc, 15)
        if getattr(self, "_log", None):
            self._log.close()


def start_all(procs: Iterable[BackendProcess]) -> None:
    """Start side by side: each start mostly waits for its process to load the model."""
    procs = list(procs)
    errors = []

    def start(p: BackendProcess) -> None:
        try:
            p.start()
        except Exception as exc:  # surfaced below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(p,)) for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert all(p.alive() for p in procs)


class ProxyProcess:
    """`kvroute proxy` on a free port; `args` are its flags past --redis-url and --port."""

    def __init__(self, redis_url: str, log_dir: Path, args: list[str] | None = None):
        self.port = free_port()
        self.redis_url = redis_url
        self.args = args or []
        self.log_path = Path(log_dir) / f"proxy-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, expect_backends: int) -> None:
        cmd = [sys.executable, "-m", "kvroute.cli", "proxy", "--redis-url", self.redis_url,
               "--port", str(self.port), *self.args]
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        wait_until(lambda: len(self.health()["backends"]) == expect_backends, 30,
                   what="the proxy to see every backend")

    def health(self) -> dict:
        if self.proc.poll() is not None:
            raise RuntimeError(f"proxy exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
        return json.loads(request(self.url + "/health", timeout=2)[2])

    def backend(self, backend_id: str) -> dict:
        return next(b for b in self.health()["backends"] if b["id"] == backend_id)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        terminate(self.proc, 10, kill_wait=10)
        if getattr(self, "_log", None):
            self._log.close()


@contextlib.contextmanager
def fleet(backends: Callable[[str], list[BackendProcess]],
          proxies: Callable[[str], list[ProxyProcess]], redis: Any = None) -> Iterator[dict]:
    """The backends that advertise to a Redis and the proxies that route over them,
    each given its URL. `redis` (anything with a `url`: the session's database) is
    shared; without it the fleet starts a redis-server of its own, which its tests may
    stop or pause. Yields {"redis", "backends" (by id), "proxies"}; a test may swap a
    backend in that dict, and the one there at the end is stopped."""
    own = redis is None
    redis = RedisServer().start() if own else redis
    running: dict = {"redis": redis, "backends": {}, "proxies": []}
    try:
        running["backends"] = {b.backend_id: b for b in backends(redis.url)}
        start_all(running["backends"].values())
        running["proxies"] = proxies(redis.url)
        for p in running["proxies"]:
            p.start(expect_backends=len(running["backends"]))
        yield running
    finally:
        # Every process is stopped even when stopping one fails: a fleet left running
        # would slow down (and share ports with) every test after it.
        with contextlib.ExitStack() as stack:
            if own:
                stack.callback(redis.close)
            for proc in [*running["backends"].values(), *running["proxies"]]:
                stack.callback(proc.stop)


def toml_text(config: dict) -> str:
    """As much TOML as a serve config needs: scalars, then tables and arrays of tables."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v, ensure_ascii=False)  # a TOML basic string
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        raise TypeError(f"no TOML for {v!r}")

    def pairs(table: dict) -> list[str]:
        return [f"{k} = {value(v)}" for k, v in table.items()]

    def tables(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)

    # Plain keys first: after a [table] header they would belong to that table.
    lines = pairs({k: v for k, v in config.items() if not isinstance(v, dict) and not tables(v)})
    for k, v in config.items():
        if isinstance(v, dict):
            lines += [f"[{k}]", *pairs(v)]
        elif tables(v):
            for item in v:
                lines += [f"[[{k}]]", *pairs(item)]
    return "\n".join(lines) + "\n"


class ServeProcess:
    """`kvroute serve` from `config` (a dict; its [proxy] port and [backends] port_base
    are picked here), in a session of its own so that one signal reaches every process
    it starts. Writes NAME.toml and NAME.log in `workdir`, and keeps the disk tiers of
    models whose config names no folder in NAME-disk there."""

    def __init__(self, config: dict, workdir: Path, name: str = "serve", env: dict | None = None):
        self.port = free_port()
        # Each serve's disk tiers in a folder of its own: serve's default, under the
        # user's cache directory, carried one test's prompts (and one run's) into the
        # next, where a restore from them changed what was cached and where it ran.
        disk = str(Path(workdir) / f"{name}-disk")
        models = [m if "disk_cache_dir" in m else {**m, "disk_cache_dir": disk}
                  for m in config.get("models", [])]
        config = {**config, "proxy": {**config.get("proxy", {}), "port": self.port},
                  "backends": {**config.get("backends", {}), "port_base": free_port()},
                  **({"models": models} if models else {})}
        self.config_path = Path(workdir) / f"{name}.toml"
        self.config_path.write_text(toml_text(config))
        self.log_path = Path(workdir) / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvroute.cli", "serve", "--config", str(self.config_path)],
            cwd=ROOT, env={**os.environ, **(env or {})}, stdout=self._log,
            stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, ready: Callable[[], Any], timeout: float, interval: float = 0.2,
                   what: str = "kvroute serve to be ready") -> Any:
        """Poll `ready` until it holds; fails at once, with the log, if serve exits."""

        def check() -> Any:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvroute serve exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            return ready()

        return wait_until(check, timeout, interval=interval, what=what)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0, group: bool = True) -> float | None:
        """SIGTERM and wait; past `timeout`, SIGKILL to the whole session. group=False
        signals the launcher alone, to test that it stops its children itself.
        Returns how long it took to exit (None: already gone, or killed)."""
        elapsed = None
        if self.proc.poll() is None:
            t0 = time.monotonic()
            if group:
                os.killpg(self.proc.pid, signal.SIGTERM)
            else:
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
                elapsed = time.monotonic() - t0
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._log.close()
        return elapsed

"""The system under test: an external redis-server (so that faults can restart, stop
and pause it) and `kvroute serve` with 2 replicas of the demo model."""

from __future__ import annotations

from pathlib import Path

import orjson
import psutil

from kvroute.serve.redis_server import RedisServer
from tests.harness import ServeProcess, get_json, request

MODEL = "kvroute-demo"
SECRET = "reliability"


class Deployment:
    """An external redis-server plus `kvroute serve` (2 demo backends and the proxy)."""

    def __init__(self, workdir: Path, cache_bytes: str = "64MiB", model_cache: str | None = None):
        self.workdir = Path(workdir)
        self.cache_bytes = cache_bytes
        self.model_cache = model_cache
        self.redis = RedisServer()
        self.serve: ServeProcess | None = None
        self._tokens: dict[int, str] = {}

    @property
    def url(self) -> str:
        return self.serve.url

    def start(self, timeout: float = 180.0) -> None:
        self.redis.start()
        env = {"PYTHONUNBUFFERED": "1"}
        if self.model_cache:
            env["KVROUTE_CACHE_DIR"] = str(self.model_cache)
        self.serve = ServeProcess(
            {"secret": SECRET, "redis": {"url": self.redis.url},
             "models": [{"path": "demo", "alias": MODEL, "replicas": 2,
                         "cache_bytes": self.cache_bytes}]},
            self.workdir, env=env)
        self.serve.wait_ready(
            lambda: len(get_json(self.url + "/health", timeout=2)["backends"]) == 2, timeout)

    def log_tail(self, n: int = 4000) -> str:
        return self.serve.log_tail(n) if self.serve else ""

    def log_mark(self) -> int:
        """A position in the serve log, for log_since()."""
        try:
            return self.serve.log_path.stat().st_size
        except OSError:
            return 0

    def log_since(self, mark: int) -> str:
        with open(self.serve.log_path, "rb") as f:
            f.seek(mark)
            return f.read().decode(errors="replace")

    def stop(self, timeout: float = 15.0) -> float | None:
        """SIGTERM to the launcher alone (its own shutdown is under test); returns how
        long it took to exit (None: it had to be killed)."""
        elapsed = self.serve.stop(timeout, group=False) if self.serve else None
        self.redis.close()
        return elapsed

    # -- what it runs ------------------------------------------------------------------

    def proxy_health(self) -> dict:
        return get_json(self.url + "/health", timeout=5)

    def backends(self) -> list[dict]:
        """[{id, url, ...}] as the proxy lists them, with each backend's own /health merged in."""
        out = []
        for b in self.proxy_health()["backends"]:
            out.append({**b, "health": get_json(b["url"] + "/health", timeout=5)})
        return out

    def backend_urls(self) -> dict[str, str]:
        return {b["id"]: b["url"] for b in self.proxy_health()["backends"]}

    def pids(self) -> dict[str, int]:
        pids = {b["id"]: b["health"]["pid"] for b in self.backends()}
        pids["proxy"] = self.proxy_health()["pid"]
        return pids

    def token(self, pid: int) -> str:
        """The launcher's internal token, from the backend's environment."""
        if pid not in self._tokens:
            token = psutil.Process(pid).environ().get("KVROUTE_INTERNAL_TOKEN")
            if not token:
                raise RuntimeError(f"no KVROUTE_INTERNAL_TOKEN in the environment of pid {pid}")
            self._tokens[pid] = token
        return self._tokens[pid]

    def cache_entries(self, url: str, pid: int) -> list[dict]:
        status, _, data = request(url + "/debug/cache", headers={"x-kvroute-token": self.token(pid)},
                                  timeout=10)
        if status != 200:
            raise RuntimeError(f"{url}/debug/cache answered {status}: {data[:200]!r}")
        return orjson.loads(data)["entries"]


def rss_bytes(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss

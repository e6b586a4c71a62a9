"""A real redis-server on a free port (kvroute serve's own), for tests and benchmarks;
and one shared by a whole test session, a database of its own to each user."""

from __future__ import annotations

from dataclasses import dataclass

import redis as redis_py

from kvroute.serve.redis_server import RedisServer, free_port

__all__ = ["Database", "RedisServer", "SharedRedis", "free_port"]


@dataclass(frozen=True)
class Database:
    """One numbered database of a shared server: what a test, or the fleet of one test
    module, reads and writes. No test sees another's keys: kvroute keeps all its state
    in keys (no pub/sub, which would cross databases)."""

    url: str
    port: int
    number: int


class SharedRedis:
    """One redis-server for the session. `database()` hands out the next database,
    emptied first; they are reused round-robin, far more of them than tests or modules
    alive at once. Tests that stop, pause or reconfigure Redis (or need a Cluster or
    Sentinels) start a RedisServer of their own."""

    DATABASES = 64

    def __init__(self) -> None:
        self.server = RedisServer(extra_args=["--databases", str(self.DATABASES)]).start()
        self._last = 0

    def database(self) -> Database:
        # Database 0 stays empty: whatever still uses the server's own URL sees nothing.
        self._last = self._last % (self.DATABASES - 1) + 1
        url = f"redis://127.0.0.1:{self.server.port}/{self._last}"
        with redis_py.Redis.from_url(url) as client:
            client.flushdb()
        return Database(url, self.server.port, self._last)

    def close(self) -> None:
        self.server.close()

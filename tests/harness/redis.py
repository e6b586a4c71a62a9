"""A real redis-server on a free port (kvroute serve's own), for tests and benchmarks."""

from __future__ import annotations

from kvroute.serve.redis_server import RedisServer, free_port

__all__ = ["RedisServer", "free_port"]

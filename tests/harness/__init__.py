"""The test harness: real processes, real sockets, polling with deadlines (no sleeps).
Tests and benchmarks import it as `from tests.harness import ...`.

    paths       ROOT, the repository
    polling     wait_until
    redis       RedisServer, free_port; SharedRedis (one per session) and its Database
    http        request, post_json, get_json, SSEStream, metric_sum
    chat        chat (the official client) and its Reply, client, tool, TOOLS
    processes   BackendProcess, ProxyProcess, ServeProcess, fleet, start_all, terminate, toml_text
    disk        small_tmpfs
    netns       several machines on this one (imported as tests.harness.netns)
"""

from tests.harness.chat import TOOLS, Reply, chat, client, tool
from tests.harness.disk import small_tmpfs
from tests.harness.http import SSEStream, get_json, metric_sum, post_json, request
from tests.harness.paths import ROOT
from tests.harness.polling import wait_until
from tests.harness.processes import (BackendProcess, ProxyProcess, ServeProcess, fleet, start_all,
                                     terminate, toml_text)
from tests.harness.redis import Database, RedisServer, SharedRedis, free_port

__all__ = ["ROOT", "TOOLS", "BackendProcess", "Database", "ProxyProcess", "RedisServer", "Reply",
           "SSEStream", "ServeProcess", "SharedRedis", "chat", "client", "fleet", "free_port",
           "get_json", "metric_sum", "post_json", "request", "small_tmpfs", "start_all",
           "terminate", "tool", "toml_text", "wait_until"]

"""One async Redis client from a URL: a single server, a Redis Cluster or a Sentinel-
managed primary.

    redis://[user:pass@]host:port[/db]            one server (rediss:// for TLS)
    redis+cluster://[user:pass@]host:port[,host:port...]
                                                  a Redis Cluster, from any of its
                                                  nodes (rediss+cluster:// for TLS)
    redis+sentinel://[user:pass@]host:port[,host:port...]/<service>[/db]
                                                  the primary that Sentinels name
                                                  <service> (rediss+sentinel:// for TLS
                                                  to the primary)

Query options (ssl_ca_certs=..., ssl_certfile=..., ssl_keyfile=..., ssl_cert_reqs=...)
pass through to redis-py. A Sentinel URL's password is the primary's, and the
Sentinels' too unless `sentinel_password=...` gives theirs (Sentinels often run
without one, or with another). The registry's keys carry hash tags (`{m:<model>}`) and each
Lua script touches the keys of one slot only, so every command works on a cluster.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelManagedSSLConnection
from redis.backoff import NoBackoff

SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster", "redis+sentinel",
           "rediss+sentinel")

# Query options we pass through, converted from their string form.
_OPTIONS = {"ssl_ca_certs": str, "ssl_certfile": str, "ssl_keyfile": str, "ssl_cert_reqs": str,
            "ssl_check_hostname": lambda v: v.lower() in ("1", "true", "yes"),
            "sentinel_password": str}


def _hosts(netloc: str) -> tuple[list[tuple[str, int]], str | None, str | None]:
    auth, _, hosts = netloc.rpartition("@")
    user, _, password = auth.partition(":") if auth else ("", "", "")
    out = []
    for part in hosts.split(","):
        host, _, port = part.rpartition(":") if ":" in part else (part, "", "")
        out.append((host.strip("[]") or "localhost", int(port or 6379)))
    return out, unquote(user) or None, unquote(password) or None


def _options(query: str) -> dict[str, Any]:
    opts = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if not value and name != "sentinel_password":
            continue
        if name not in _OPTIONS:
            raise ValueError(f"unsupported Redis URL option {name!r}")
        opts[name] = _OPTIONS[name](value)
    return opts


def check_url(url: str) -> str:
    """The URL's scheme; ValueError, saying what is accepted, for one no client takes."""
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme not in SCHEMES:
        raise ValueError(f"Redis URL must start with one of {', '.join(s + '://' for s in SCHEMES)}")
    if scheme.endswith("+sentinel") and not [p for p in urlsplit(url).path.split("/") if p]:
        raise ValueError("redis+sentinel:// URLs name the service: redis+sentinel://host:port/<service>")
    return scheme


def connect(url: str, **kwargs: Any):
    """A redis.asyncio client (Redis or RedisCluster) for `url`; kwargs go to redis-py."""
    scheme = check_url(url)
    if scheme in ("redis", "rediss", "unix"):
        return aioredis.from_url(url, **kwargs)
    parts = urlsplit(url)
    hosts, user, password = _hosts(parts.netloc)
    tls = scheme.startswith("rediss")
    opts = {**_options(parts.query), **kwargs}
    sentinel_password = opts.pop("sentinel_password", password)
    if scheme.endswith("+cluster"):
        opts.pop("retry", None)  # the cluster client retries by rediscovering nodes
        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in hosts], username=user,
                            password=password, ssl=tls, **opts)
    path = [p for p in parts.path.split("/") if p]
    if not path:
        raise ValueError("redis+sentinel:// URLs name the service: redis+sentinel://host:port/<service>")
    db = int(path[1]) if len(path) > 1 else 0
    # One try per Sentinel: redis-py's default retries a dead Sentinel with seconds of
    # backoff before asking the next, longer than any registry deadline, so a client
    # whose first-listed Sentinel died never found the new primary.
    sentinel_opts: dict[str, Any] = {"retry": Retry(NoBackoff(), 0)}
    for name in ("socket_timeout", "socket_connect_timeout"):
        if kwargs.get(name) is not None:
            sentinel_opts[name] = kwargs[name]
    if sentinel_password:  # an empty `sentinel_password=` means Sentinels without one
        sentinel_opts["password"] = sentinel_password
    sentinel = Sentinel(hosts, sentinel_kwargs=sentinel_opts)
    if tls:
        opts["connection_class"] = SentinelManagedSSLConnection
    return sentinel.master_for(path[0], username=user, password=password, db=db, **opts)

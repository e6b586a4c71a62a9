"""The registry through Redis Sentinel, live: a primary, a replica and three Sentinels
started locally, reached through a redis+sentinel:// URL, across a real failover."""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import redis

from tests.harness import terminate, wait_until
from kvroute.core.redis_keys import record_key
from kvroute.core.prefix import chat_chain, make_salt
from kvroute.serve.redis_server import RedisServer, _die_with_parent, free_port, ping
from kvroute.core.registry import BackendRecord, Registry, RegistryUnavailable, new_instance_id

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")

SERVICE = "mymaster"
MODEL = "sentinel-model"
SALT = make_salt("sentinel-test")


class SentinelUnsupported(RuntimeError):
    pass


def _admin(port: int) -> redis.Redis:
    return redis.Redis(port=port, socket_timeout=1.0, socket_connect_timeout=1.0, decode_responses=True)


def _ask(port: int, fn):
    """fn(client) on a fresh connection; None when that server cannot answer (yet)."""
    client = _admin(port)
    try:
        return fn(client)
    except redis.RedisError:
        return None
    finally:
        client.close()


class SentinelProcess:
    """`redis-server <conf> --sentinel` on a free loopback port. Sentinel rewrites its
    config file (ids, peers, the current primary), so each one gets its own directory."""

    def __init__(self, directory: Path, primary_port: int):
        self.dir = directory
        self.primary_port = primary_port
        self.port = 0
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 10.0) -> "SentinelProcess":
        self.dir.mkdir(parents=True, exist_ok=True)
        stderr = self.dir / "stderr.txt"
        # A free port can be taken between free_port() and the bind: try another.
        for _ in range(5):
            self.port = free_port()
            conf = self.dir / "sentinel.conf"
            conf.write_text("\n".join([
                f"port {self.port}",
                "bind 127.0.0.1",
                f"dir {self.dir}",
                f"logfile {self.dir / 'sentinel.log'}",
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary_port} 1",
                f"sentinel down-after-milliseconds {SERVICE} 1000",
                # Also how long a split leader vote waits before the next try (twice this).
                f"sentinel failover-timeout {SERVICE} 2000",
                "",
            ]))
            with open(stderr, "wb") as err:
                self.proc = subprocess.Popen(
                    ["redis-server", str(conf), "--sentinel"], stdin=subprocess.DEVNULL,
                    stdout=err, stderr=subprocess.STDOUT, start_new_session=True,
                    preexec_fn=_die_with_parent)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                if ping(self.port):
                    return self
                time.sleep(0.02)
            if self.proc.poll() is None:
                self.stop()
                break
            output = stderr.read_text(errors="replace")
            # A redis-server without Sentinel mode rejects the `sentinel` lines themselves.
            if ">>> 'sentinel" in output and ("not in sentinel mode" in output or "Bad directive" in output):
                raise SentinelUnsupported(output.strip()[-300:])
        raise RuntimeError(f"redis sentinel did not start:\n{self.log()}")

    def log(self, n: int = 30) -> str:
        text = ""
        for name in ("stderr.txt", "sentinel.log"):
            try:
                text += (self.dir / name).read_text(errors="replace")
            except OSError:
                pass
        return "\n".join(text.splitlines()[-n:])

    def master(self) -> dict | None:
        return _ask(self.port, lambda c: c.sentinel_master(SERVICE))

    def primary_port_named(self) -> int | None:
        addr = _ask(self.port, lambda c: c.sentinel_get_master_addr_by_name(SERVICE))
        return int(addr[1]) if addr else None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        terminate(self.proc, 5, kill_wait=None)
        self.proc = None


def info(port: int) -> dict:
    return _ask(port, lambda c: c.info("replication")) or {}


class Deployment:
    def __init__(self, tmp: Path):
        # Diskless sync with no delay: the replica's first sync takes milliseconds, not 5 s.
        fast_sync = ["--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0"]
        self.primary = RedisServer(extra_args=fast_sync)
        self.replica = RedisServer(extra_args=fast_sync)
        self.tmp = tmp
        self.sentinels: list[SentinelProcess] = []

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels) + f"/{SERVICE}"

    def start(self) -> "Deployment":
        self.primary.start()
        self.replica.extra_args += ["--replicaof", "127.0.0.1", str(self.primary.port)]
        self.replica.start()
        wait_until(lambda: info(self.replica.port).get("master_link_status") == "up", 15,
                   interval=0.02, what="the replica's link to the primary")
        # Sentinels start after the replica is attached: a Sentinel learns of replicas
        # from the primary's INFO, which it asks for at once and then only every 10 s.
        for i in range(3):
            self.sentinels.append(SentinelProcess(self.tmp / f"sentinel-{i}", self.primary.port).start())
        for s in self.sentinels:
            wait_until(lambda s=s: self._sentinel_ready(s), 20, interval=0.05,
                       what=f"sentinel {s.port} to see the primary, the replica and its 2 peers "
                            f"(log:\n{s.log()})")
        return self

    def _sentinel_ready(self, s: SentinelProcess) -> bool:
        master = s.master()
        if not master or master.get("port") != self.primary.port or master.get("num-other-sentinels") != 2:
            return False
        replicas = _ask(s.port, lambda c: c.sentinel_slaves(SERVICE)) or []
        return any(r["port"] == self.replica.port and not r["is_sdown"] and
                   r.get("master-link-status") == "ok" for r in replicas)

    def close(self) -> None:
        for s in self.sentinels:
            s.stop()
        self.replica.close()
        self.primary.close()


@pytest.fixture
def deployment(tmp_path):
    d = Deployment(tmp_path)
    try:
        try:
            d.start()
        except SentinelUnsupported as e:
            pytest.skip(f"this redis-server cannot run as a Sentinel: {e}")
        yield d
    finally:
        d.close()


def record(bid: str) -> BackendRecord:
    return BackendRecord(backend_id=bid, instance_id=new_instance_id(), url=f"http://127.0.0.1:9/{bid}",
                         models=[MODEL], prefill_tps=500.0, started_at=time.time())


def conv(n: int) -> list[int]:
    msgs = [{"role": "system", "content": "You are a sentinel test."}]
    msgs += [{"role": "user" if i % 2 == 0 else "assistant", "content": f"{i} " + "text " * 80}
             for i in range(n)]
    return chat_chain({"messages": msgs}, model=MODEL, salt=SALT)


async def eventually(make, timeout: float, what: str):
    """Await make() until it answers (not None, no RegistryUnavailable) or the deadline."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            value = await make()
            if value is not None:
                return value
        except RegistryUnavailable as e:
            last = e
        await asyncio.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last error: {last})")


def test_registry_follows_a_sentinel_failover(deployment):
    d = deployment
    # The record must outlive the failover with no heartbeat in between, so finding it
    # afterwards shows it was replicated, not written again.
    reg = Registry(d.url, record_ttl=60.0)
    rec = record("b1")

    async def before():
        assert await reg.heartbeat(rec) is False  # first beat
        await reg.advertise("b1", rec.instance_id, MODEL, conv(3))
        found = await reg.lookup(MODEL, conv(5), timeout=2.0)
        assert found["b1"].depth == len(conv(3)) > 0
        assert [r.backend_id for r in await reg.live_backends()] == ["b1"]

    async def during_outage():
        # The primary is gone and not yet replaced: lookups say "unknown", writes raise
        # the registry's own error; neither hangs past its deadline.
        assert await reg.lookup(MODEL, conv(5), timeout=2.0) is None
        with pytest.raises(RegistryUnavailable):
            await reg.heartbeat(rec)

    async def after():
        # Same Registry, same pools: it must find the new primary through the Sentinels.
        # The new primary never saw the Lua scripts (Redis 7 does not replicate SCRIPT
        # LOAD), so these calls also take the NOSCRIPT-and-reload path.
        still_there = await eventually(lambda: reg.heartbeat(rec), 15, "a heartbeat on the new primary")
        assert still_there is True  # the record replicated: no full re-publish needed
        found = await eventually(lambda: reg.lookup(MODEL, conv(5), timeout=2.0), 5,
                                 "a lookup on the new primary")
        assert found["b1"].depth == len(conv(3))
        assert await reg.advertised("b1", MODEL) == set(conv(3))
        await reg.advertise("b1", rec.instance_id, MODEL, conv(5))
        assert (await reg.lookup(MODEL, conv(7), timeout=2.0))["b1"].depth == len(conv(5))
        await reg.mark_route(MODEL, conv(7), "b1", 3000)
        assert (await reg.lookup(MODEL, conv(7), timeout=2.0))["b1"].marked_depth == len(conv(7))
        assert _ask(d.replica.port, lambda c: c.exists(record_key("b1"))) == 1
        await reg.withdraw_all("b1", rec.instance_id)
        assert "b1" not in await reg.lookup(MODEL, conv(5), timeout=2.0)
        assert await reg.live_backends() == []

    with asyncio.Runner() as runner:
        try:
            runner.run(before())
            assert _ask(d.primary.port, lambda c: c.exists(record_key("b1"))) == 1
            # Kill the primary only once the replica has everything written so far.
            offset = info(d.primary.port)["master_repl_offset"]
            wait_until(lambda: info(d.replica.port).get("slave_repl_offset", -1) >= offset, 10,
                       what="the replica to catch up with the primary")

            # The primary dies, and with it the Sentinel the client asks first (as when
            # they share a host): the client must fall through to the next Sentinel.
            d.primary.proc.send_signal(signal.SIGKILL)
            d.primary.proc.wait()
            d.sentinels[0].kill()
            runner.run(during_outage())

            t0 = time.monotonic()
            wait_until(lambda: d.sentinels[1].primary_port_named() == d.replica.port, 25, interval=0.05,
                       what=f"the Sentinels to promote the replica (log:\n{d.sentinels[1].log()})")
            assert info(d.replica.port).get("role") == "master"
            print(f"failover took {time.monotonic() - t0:.1f}s after the primary died")
            runner.run(after())
        finally:
            runner.run(reg.close())


def test_serve_on_sentinel_keeps_serving_through_a_failover(deployment, tmp_path, model_cache):
    """`kvroute serve --redis-url redis+sentinel://...`: turn 2 cached on turn 1's backend;
    the primary killed while clients keep sending: no request fails (Redis is an
    accelerator, invariant 4), and once the Sentinels promote the replica the backends
    advertise again and a new conversation's turn 2 hits on its backend."""
    import openai

    from tests.harness import ServeProcess, get_json
    from kvroute.devtools import demo_model

    d = deployment
    model = demo_model.ensure("text", cache_dir=model_cache)
    serve = ServeProcess({"redis": {"url": d.url},
                          "models": [{"path": str(model), "alias": "demo", "replicas": 2}]},
                         tmp_path)
    client = openai.OpenAI(base_url=f"{serve.url}/v1", api_key="unused", max_retries=0)

    def conversation(tag: str) -> tuple[str, str, object]:
        messages = [{"role": "system", "content": f"{tag}: a sentinel conversation. " * 40},
                    {"role": "user", "content": "Hello?"}]
        first = client.chat.completions.with_raw_response.create(model="demo", messages=messages)
        messages += [{"role": "assistant", "content": first.parse().choices[0].message.content},
                     {"role": "user", "content": "More?"}]
        second = client.chat.completions.with_raw_response.create(model="demo", messages=messages)
        return (first.headers["x-kvroute-backend"], second.headers["x-kvroute-backend"],
                second.parse().usage)

    def hit(result) -> bool:
        b1, b2, usage = result
        return b1 == b2 and usage.prompt_tokens_details.cached_tokens >= 0.8 * usage.prompt_tokens

    try:
        serve.wait_ready(lambda: len(get_json(f"{serve.url}/health")["backends"]) == 2, 120)
        assert hit(conversation("before"))
        offset = info(d.primary.port)["master_repl_offset"]
        wait_until(lambda: info(d.replica.port).get("slave_repl_offset", -1) >= offset, 10,
                   what="the replica to catch up with the primary")
        d.primary.proc.send_signal(signal.SIGKILL)
        d.primary.proc.wait()
        # Traffic through the outage and the promotion: every request answered.
        deadline = time.monotonic() + 30
        n = 0
        while d.sentinels[1].primary_port_named() != d.replica.port:
            assert time.monotonic() < deadline, "the Sentinels did not promote the replica"
            conversation(f"during-{n}")  # raises on any failed request
            n += 1
        assert n > 0
        wait_until(lambda: hit(conversation(f"after-{time.monotonic()}")), 30, interval=0.5,
                   what="conversations to hit again on the new primary")
    finally:
        serve.stop()

"""The registry on a real Redis Cluster: three masters started locally, joined with
`redis-cli --cluster create`, reached through a redis+cluster:// URL."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time

import pytest
from redis.cluster import key_slot

from kvroute.core.limit_counters import LimitCounters
from kvroute.core.prefix import chat_chain, make_salt
from kvroute.serve.redis_server import RedisServer
from kvroute.backend.publisher import Publisher
from kvroute.core.registry import BackendRecord, Registry, new_instance_id

pytestmark = pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli not installed")

SALT = make_salt("cluster-test")


class LocalCluster:
    """Three cluster-enabled redis-servers, no replicas, all 16384 slots assigned;
    `host`: the address clients reach them at (loopback too, for the admin calls; off
    loopback only on a private test network, hence no protected mode)."""

    def __init__(self, n: int = 3, host: str = "127.0.0.1"):
        self.host = host
        on_host = [] if host == "127.0.0.1" else ["--bind", "127.0.0.1", host,
                                                  "--cluster-announce-ip", host,
                                                  "--protected-mode", "no"]
        self.nodes = [RedisServer(extra_args=["--cluster-enabled", "yes",
                                              "--cluster-config-file", "nodes.conf",
                                              "--cluster-node-timeout", "2000", *on_host])
                      for _ in range(n)]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"{self.host}:{n.port}" for n in self.nodes)

    def cli(self, port: int, *args: str) -> str:
        return subprocess.run(["redis-cli", "-p", str(port), *args], check=True, text=True,
                              capture_output=True, timeout=30).stdout

    def start(self) -> "LocalCluster":
        for node in self.nodes:
            node.start()
        subprocess.run(["redis-cli", "--cluster", "create",
                        *(f"{self.host}:{n.port}" for n in self.nodes),
                        "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        deadline = time.monotonic() + 30
        while not all("cluster_state:ok" in self.cli(n.port, "cluster", "info") for n in self.nodes):
            if time.monotonic() > deadline:
                raise TimeoutError("cluster did not reach cluster_state:ok")
            time.sleep(0.05)
        return self

    def node_of(self, key: str) -> int:
        """The port of the master that serves `key`'s slot."""
        slot = key_slot(key.encode())
        for line in self.cli(self.nodes[0].port, "cluster", "nodes").splitlines():
            fields = line.split()
            if "master" not in fields[2]:
                continue
            for spec in fields[8:]:
                lo, _, hi = spec.partition("-")
                if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                    return int(fields[1].split(":")[1].split("@")[0])
        raise AssertionError(f"no master serves slot {slot}")

    def keys(self) -> dict[int, list[str]]:
        return {n.port: self.cli(n.port, "--scan").split() for n in self.nodes}

    def close(self) -> None:
        for node in self.nodes:
            node.close()


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster()
    try:
        yield c.start()
    finally:
        c.close()


def record(bid: str, models: list[str]) -> BackendRecord:
    return BackendRecord(backend_id=bid, instance_id=new_instance_id(), url=f"http://127.0.0.1:9/{bid}",
                         models=models, prefill_tps=500.0, started_at=time.time())


def conv(n: int, model: str) -> list[int]:
    msgs = [{"role": "system", "content": "You are a cluster test."}]
    msgs += [{"role": "user" if i % 2 == 0 else "assistant", "content": f"{i} " + "text " * 80}
             for i in range(n)]
    return chat_chain({"messages": msgs}, model=model, salt=SALT)


def models_on_different_masters(cluster: LocalCluster) -> list[str]:
    """Three model ids whose slots live on three different masters."""
    by_node: dict[int, str] = {}
    for i in range(200):
        model = f"model-{i}"
        by_node.setdefault(cluster.node_of("kvr:{m:" + model + "}:backends"), model)
        if len(by_node) == len(cluster.nodes):
            return list(by_node.values())
    raise AssertionError("could not spread models over the masters")


def test_usage_limits_on_a_three_master_cluster(cluster):
    """Each limit subject's counters live in one slot; subjects spread over the masters."""
    subjects = [f"scope:team-{i}" for i in range(12)]

    async def main():
        c = LimitCounters(cluster.url, timeout=2.0)
        for s in subjects:
            assert [(await c.admit(s, f"r{i}", requests_per_minute=1, concurrent=2))[0]
                    for i in range(2)] == ["", "requests_per_minute"]
            await c.charge(s, 10, per_minute=True, per_day=True)
            assert (await c.admit(s, "t", tokens_per_minute=10))[0] == "tokens_per_minute"
            await c.renew(s, ["r0"])
            await c.release(s, "r0")
        await c.close()

    asyncio.run(main())
    where: dict[str, set[int]] = {}
    for port, found in cluster.keys().items():
        for key in found:
            if key.startswith("kvr:{lim:"):
                where.setdefault(key.split("}")[0], set()).add(port)
    assert len(where) == len(subjects)
    assert all(len(ports) == 1 for ports in where.values()), where
    assert len(set().union(*where.values())) > 1


def test_registry_on_a_three_master_cluster(cluster):
    models = models_on_different_masters(cluster)

    async def main():
        reg = Registry(cluster.url)
        b1, b2 = record("b1", models), record("b2", models[:1])
        assert await reg.heartbeat(b1) is False  # first beat: nothing there yet
        assert await reg.heartbeat(b2) is False
        assert await reg.heartbeat(b1) is True
        for m in models:
            await reg.advertise("b1", b1.instance_id, m, conv(3, m))
        # The models' keys really are spread over the three masters.
        holders = {port for port, keys in cluster.keys().items()
                   if any(k.startswith("kvr:{m:") for k in keys)}
        assert len(holders) == 3
        found = await reg.lookup(models[0], conv(5, models[0]))
        assert found["b1"].depth == len(conv(3, models[0])) and found["b2"].depth == 0
        # A pending mark, read back by the lookup script on the model's master.
        await reg.mark_route(models[0], conv(5, models[0]), "b2", 3000)
        found = await reg.lookup(models[0], conv(5, models[0]))
        assert found["b2"].marked_depth == len(conv(5, models[0]))
        for m in models[1:]:
            assert (await reg.lookup(m, conv(3, m)))["b1"].depth == len(conv(3, m))
        assert [r.backend_id for r in await reg.live_backends()] == ["b1", "b2"]
        assert await reg.advertised("b1", models[2]) == set(conv(3, models[2]))
        await reg.withdraw("b1", b1.instance_id, models[1], conv(3, models[1])[2:])
        assert (await reg.lookup(models[1], conv(3, models[1])))["b1"].depth == 2
        assert await reg.purge("b1", models) > 0
        assert (await reg.lookup(models[2], conv(3, models[2])))["b1"].depth == 0
        await reg.withdraw_all("b1", b1.instance_id)
        assert "b1" not in (await reg.lookup(models[0], conv(3, models[0])))
        await reg.close()

    asyncio.run(main())


def test_publisher_keeps_a_cluster_in_sync(cluster):
    model = models_on_different_masters(cluster)[1]

    async def main():
        reg = Registry(cluster.url)
        chains = {model: [conv(3, model)]}
        rec = record("pub", [model])
        pub = Publisher(reg, lambda: rec, lambda: chains, period=0.1)
        await pub.start()
        deadline = time.monotonic() + 10
        while (m := (await reg.lookup(model, conv(3, model)) or {}).get("pub")) is None or \
                m.depth < len(conv(3, model)):
            assert time.monotonic() < deadline, "publisher never advertised on the cluster"
            await asyncio.sleep(0.05)
        pub.on_insert(model, conv(5, model))
        while (await reg.lookup(model, conv(5, model)))["pub"].depth < len(conv(5, model)):
            assert time.monotonic() < deadline, "insert event never reached the cluster"
            await asyncio.sleep(0.05)
        await pub.stop(withdraw=True)
        assert "pub" not in (await reg.lookup(model, conv(3, model)))
        await reg.close()

    asyncio.run(main())


def test_redis_urls():
    from redis.asyncio.cluster import RedisCluster
    from redis.asyncio.sentinel import SentinelManagedSSLConnection

    from kvroute.core.redis_client import connect

    assert isinstance(connect("redis+cluster://a:7000,b:7001"), RedisCluster)
    tls = connect("rediss+sentinel://u:pw@s1:26379,s2:26379/mymaster/2")
    assert tls.connection_pool.connection_class is SentinelManagedSSLConnection
    assert tls.connection_pool.service_name == "mymaster"
    def sentinel_password(url: str) -> str | None:
        sentinel = connect(url).connection_pool.sentinel_manager.sentinels[0]
        return sentinel.connection_pool.connection_kwargs.get("password")

    # The URL's password is the primary's, and the Sentinels' unless they have their own.
    assert sentinel_password("redis+sentinel://u:pw@s1:26379/mymaster") == "pw"
    assert sentinel_password("redis+sentinel://u:pw@s1:26379/mymaster?sentinel_password=sp") == "sp"
    assert sentinel_password("redis+sentinel://u:pw@s1:26379/mymaster?sentinel_password=") is None
    primary = connect("redis+sentinel://u:pw@s1:26379/mymaster?sentinel_password=sp")
    assert primary.connection_pool.connection_kwargs["password"] == "pw"
    for bad in ("http://x", "redis+sentinel://s1:26379", "redis+cluster://a:1?nope=1"):
        with pytest.raises(ValueError):
            connect(bad)


def test_models_state_on_a_cluster(cluster):
    """Every models_state operation on a cluster, the last machine's two-key clean-up
    included (a CROSSSLOT error if the keys did not share a slot)."""
    from kvroute.core import redis_keys
    from kvroute.core.model_loads import LOADED, ModelLoads, ModelState

    assert len({key_slot(k.encode()) for k in (redis_keys.MODEL_STATES, redis_keys.MODELS_USED,
                                              redis_keys.MODEL_LOADS)}) == 1

    async def main():
        states = ModelLoads(cluster.url)
        try:
            await states.publish([ModelState(model="m", machine="a", state=LOADED)])
            assert [s.state for s in (await states.states())["m"]] == [LOADED]
            await states.touch("m", 123.0)
            assert (await states.used()) == {"m": 123.0}
            start = await states.last_request_id()
            await states.request_load("m", origin="test")
            after, wanted = await states.load_requests(start, 1.0)
            assert wanted == ["m"] and after != start
            await states.withdraw("a", ["m"])
            assert await states.states() == {} and await states.used() == {}
        finally:
            await states.close()

    asyncio.run(main())


def test_serve_on_a_cluster_keeps_a_conversation_on_its_backend(cluster, tmp_path, model_cache):
    """`kvroute serve --redis-url redis+cluster://...`: ready, and turn 2 cached on turn 1's backend."""
    import openai

    from tests.harness import ServeProcess, get_json
    from kvroute.devtools import demo_model

    model = demo_model.ensure("text", cache_dir=model_cache)
    serve = ServeProcess({"redis": {"url": cluster.url},
                          "models": [{"path": str(model), "alias": "demo", "replicas": 2}]},
                         tmp_path)
    try:
        serve.wait_ready(lambda: len(get_json(f"{serve.url}/health")["backends"]) == 2, 120)
        client = openai.OpenAI(base_url=f"{serve.url}/v1", api_key="unused", max_retries=0)
        messages = [{"role": "system", "content": "A cluster conversation. " * 40},
                    {"role": "user", "content": "Hello?"}]
        first = client.chat.completions.with_raw_response.create(model="demo", messages=messages)
        reply = first.parse().choices[0].message.content
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "More?"}]
        second = client.chat.completions.with_raw_response.create(model="demo", messages=messages)
        usage = second.parse().usage
        assert usage.prompt_tokens_details.cached_tokens >= 0.8 * usage.prompt_tokens
        assert second.headers["x-kvroute-backend"] == first.headers["x-kvroute-backend"]
    finally:
        serve.stop()

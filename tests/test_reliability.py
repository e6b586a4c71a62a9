"""Reliability under load and faults (the quick variant of `python -m bench.reliability`), and
regression tests for the bugs its runs found.

The first part runs `kvroute serve` (2 demo backends, the proxy) against an external
redis-server: a load of concurrent streaming clients, one in five disconnecting, then
four faults under a steady workload, with the bench script's own checks. The tests
run in file order and share one deployment. `KVROUTE_SOAK=1` runs the full 200-client
load (three rounds) and longer fault windows (SIGSTOP 15 s, Redis unreachable 30 s).

The second part pins each bug down with a small, fast setup: fake backends (in this
process, able to freeze like a SIGSTOPped process) behind a real proxy process and a
real Redis, or the shared demo backend.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import orjson
import pytest
from aiohttp import web
from tests.harness import SSEStream, free_port, get_json, request, wait_until

from kvroute.core.prefix import DEFAULT_BLOCK_BYTES, chat_chain, fingerprint, make_salt
from kvroute.core.registry import BackendRecord, Registry, new_instance_id

from bench import reliability as rel

SOAK = os.environ.get("KVROUTE_SOAK", "") not in ("", "0")
# Soak: 200 clients in three rounds, SIGSTOP 15 s, Redis unreachable 30 s.
PROFILE = rel.soak_profile(0) if SOAK else rel.PROFILES["quick"]
RECOVERY_BOUND_S = 20.0


# -- the whole system under load and faults ----------------------------------------------


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, model_cache):
    dep = rel.Deployment(tmp_path_factory.mktemp("reliability"), PROFILE.cache_bytes,
                         model_cache=str(model_cache))
    dep.start()
    yield dep
    elapsed = dep.stop()
    assert elapsed is not None and elapsed < 10, f"kvroute serve took {elapsed}s to stop"


def test_load_leaves_no_errors_busy_slots_leaks_or_stale_registry(deployment):
    assert PROFILE.clients >= 50 and PROFILE.disconnect_share >= 0.2
    report = rel.Report(PROFILE)
    rel.load_phase(deployment, PROFILE, report, time.monotonic(), log=lambda m: None)
    failed = [f"{c.name}: {c.detail}" for c in report.checks if not c.ok]
    assert not failed, "\n".join(failed) + "\n" + deployment.log_tail()
    for r in report.load:
        assert r.clients == PROFILE.clients
        # Every dropper disconnects, unless it got 429s on every attempt.
        assert r.disconnects >= round(PROFILE.clients * PROFILE.disconnect_share) - r.gave_up_429
        assert r.ok > 0


@pytest.fixture(scope="module")
def workload(deployment):
    wl = rel.SteadyWorkload(deployment.url, rate=PROFILE.rate, conversations=PROFILE.conversations,
                            long_streams=PROFILE.long_streams)
    wl.start()
    time.sleep(PROFILE.baseline_s)
    yield wl
    wl.stop()


@pytest.mark.parametrize("fault", rel.FAULTS)
def test_fault_under_steady_workload(deployment, workload, fault):
    res = rel.inject(fault, deployment, workload, PROFILE)
    assert not res.errors, f"{fault}: client errors {res.errors}\n{deployment.log_tail()}"
    assert res.requests > 0
    assert res.recovery_s is not None and res.recovery_s < RECOVERY_BOUND_S, (
        f"{fault}: routing not back to cache hits within {PROFILE.recover_max_s}s")
    assert res.registry.ok, f"{fault}: {res.registry.detail}"


def test_after_the_faults_slots_are_free_and_redis_matches(deployment, workload):
    workload.stop()
    assert not [o for o in workload.snapshot() if not o.end], "a request never finished"
    for check in (rel.check_slots_free(deployment), rel.check_registry(deployment)):
        assert check.ok, f"{check.name}: {check.detail}"


# -- regressions: fake backends behind a real proxy ---------------------------------------

SECRET = "reliability-test"
MODEL = "fake-model"
REPLY = "fake reply"


class FakeBackend:
    """An OpenAI-ish backend in a thread of its own. `frozen` makes it behave like a
    SIGSTOPped process: connections are accepted, nothing is answered (not even
    /health) until it is cleared."""

    def __init__(self, backend_id: str):
        self.backend_id = backend_id
        self.port = free_port()
        self.frozen = threading.Event()
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _thaw(self) -> None:
        while self.frozen.is_set():
            await asyncio.sleep(0.02)

    async def _health(self, request):
        await self._thaw()
        return web.json_response({"status": "ok"})

    async def _chat(self, request):
        body = await request.json()
        await self._thaw()
        chunks = int(body.get("max_tokens") or 3)
        headers = {"x-kvroute-prompt-tokens": "10", "x-kvroute-cached-tokens": "0"}
        if not body.get("stream"):
            return web.json_response({"object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": REPLY},
                 "finish_reason": "stop"}]}, headers=headers)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **headers})
        await resp.prepare(request)
        for i in range(chunks):
            await self._thaw()
            chunk = {"object": "chat.completion.chunk",
                     "choices": [{"index": 0, "delta": {"content": f"{i} "}}]}
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            await asyncio.sleep(0.005)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/chat/completions", self._chat)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self.loop.run_forever()

    def close(self) -> None:
        self.frozen.clear()
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


class Heartbeats:
    """Keeps the records of chosen backends alive in Redis (1 s TTL), as their
    publishers would; dropping one from `live` is its heartbeat stopping."""

    def __init__(self, redis_url: str):
        self.registry = None
        self.redis_url = redis_url
        self.records: dict[str, BackendRecord] = {}
        self.live: set[str] = set()
        self.loop = asyncio.new_event_loop()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def add(self, backend_id: str, url: str) -> BackendRecord:
        # With the deployment's fingerprint, as a real backend's record carries it.
        rec = BackendRecord(backend_id=backend_id, instance_id=new_instance_id(), url=url,
                            models=[MODEL], prefill_tps=1000.0,
                            **fingerprint(SECRET, DEFAULT_BLOCK_BYTES))
        self.records[backend_id] = rec
        self.call(self.registry.heartbeat(rec))
        self.live.add(backend_id)
        return rec

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.registry = Registry(self.redis_url, record_ttl=1.0)

        async def beat():
            while not self._stop.is_set():
                for bid in list(self.live):
                    await self.registry.heartbeat(self.records[bid])
                await asyncio.sleep(0.2)
            await self.registry.close()

        self.loop.run_until_complete(beat())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


class Proxy:
    def __init__(self, redis_url: str, log_dir: Path):
        self.port = free_port()
        self.log_path = log_dir / f"proxy-{self.port}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvroute.cli", "proxy", "--redis-url", redis_url, "--port",
             str(self.port), "--secret", SECRET, "--request-timeout", "60"],
            stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def backends(self) -> set[str]:
        return {b["id"] for b in get_json(self.url + "/health", timeout=2)["backends"]}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def fakes(tmp_path, redis_db):
    """Redis, two fake backends (heartbeats not started) and a proxy process."""
    redis = redis_db
    beats = Heartbeats(redis.url)
    backends = {bid: FakeBackend(bid) for bid in ("b1", "b2")}
    proxy = Proxy(redis.url, tmp_path)
    yield {"redis": redis, "beats": beats, "backends": backends, "proxy": proxy}
    proxy.stop()
    beats.close()
    for b in backends.values():
        b.close()


def _conversation() -> dict:
    return {"model": MODEL, "messages": [
        {"role": "system", "content": f"{uuid.uuid4().hex} you help engineers. " * 4},
        {"role": "user", "content": "Hello."}]}


def _advertise(beats: Heartbeats, backend_id: str, body: dict) -> None:
    chain = chat_chain(body, model=MODEL, salt=make_salt(SECRET))
    beats.call(beats.registry.advertise(backend_id, beats.records[backend_id].instance_id, MODEL,
                                        chain))


def _start(fakes, ids=("b1", "b2")) -> None:
    for bid in ids:
        fakes["beats"].add(bid, fakes["backends"][bid].url)
    wait_until(lambda: fakes["proxy"].backends() == set(ids), 20, interval=0.1,
               what="the proxy to list the fake backends")


def test_regression_stopped_backend_fails_over_instead_of_hanging(fakes):
    """A SIGSTOPped backend accepts connections and answers nothing: a request routed
    to it in the seconds before its record lapsed waited for --request-timeout."""
    _start(fakes)
    body = _conversation()
    _advertise(fakes["beats"], "b1", body)  # its cache is on b1: the proxy picks b1
    fakes["backends"]["b1"].frozen.set()
    fakes["beats"].live.discard("b1")  # stopped: no more heartbeats (record lapses in 1 s)
    t0 = time.monotonic()
    status, headers, data = request(fakes["proxy"].url + "/v1/chat/completions", "POST", body,
                                    timeout=30)
    elapsed = time.monotonic() - t0
    assert status == 200, data
    assert headers["x-kvroute-backend"] == "b2"
    assert elapsed < 10, elapsed
    assert "b1 failed before answering" in fakes["proxy"].log()


def test_regression_stopped_backend_ends_its_streams_instead_of_hanging(fakes):
    """A stream in flight on a backend that froze (SIGSTOP) hung for --request-timeout;
    it now ends with an error event and [DONE] once the backend is known gone."""
    _start(fakes)
    body = {**_conversation(), "max_tokens": 100000}
    _advertise(fakes["beats"], "b1", body)
    stream = SSEStream(fakes["proxy"].url + "/v1/chat/completions", body, timeout=30)
    events = stream.events()
    assert stream.headers["x-kvroute-backend"] == "b1"
    next(events)
    fakes["backends"]["b1"].frozen.set()
    fakes["beats"].live.discard("b1")
    t0 = time.monotonic()
    rest = list(events)
    assert time.monotonic() - t0 < 10
    assert rest[-1] == "[DONE]" and "error" in rest[-2], rest[-3:]
    stream.close()


def test_regression_failover_reaches_backends_missing_from_the_registry(fakes):
    """When the registry listed only part of the fleet (Redis restarted, heartbeats not
    all back) and the listed backend failed, the client got a 502 although the proxy
    knew a healthy backend (tests/test_proxy.py's SIGKILL test failed this way when run
    right after its Redis test)."""
    beats = fakes["beats"]
    beats.add("gone", f"http://127.0.0.1:{free_port()}")  # nothing listens: connection refused
    beats.add("b2", fakes["backends"]["b2"].url)
    wait_until(lambda: fakes["proxy"].backends() == {"gone", "b2"}, 20, interval=0.1,
               what="the proxy to list both")
    # b2's record disappears from Redis (as after a restart, before its next heartbeat).
    beats.live.discard("b2")
    beats.call(beats.registry.withdraw_all("b2", beats.records["b2"].instance_id))
    status, headers, data = request(fakes["proxy"].url + "/v1/chat/completions", "POST",
                                    _conversation(), timeout=30)
    assert status == 200, data
    assert headers["x-kvroute-backend"] == "b2"


def _rst_close(sock: socket.socket) -> None:
    # SO_LINGER 0: close() sends a RST, as a crashed client's kernel would.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def test_regression_client_disconnect_is_not_a_backend_failure(fakes):
    """A client that went away mid-stream made the proxy's next write fail; that error
    (an aiohttp ClientConnectionError) was taken for a backend failure: a warning
    blaming the backend, then an unhandled-error traceback on writing the error event."""
    _start(fakes)
    proxy = fakes["proxy"]
    body = orjson.dumps({**_conversation(), "stream": True, "max_tokens": 400})
    for _ in range(20):
        sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                     + body)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        _rst_close(sock)
    wait_until(lambda: all(b["inflight"] == 0 for b in get_json(proxy.url + "/health")["backends"]),
               10, what="the proxy to finish the abandoned streams")
    log = proxy.log()
    assert "failed mid-stream" not in log and "unhandled error" not in log, log[-3000:]


def test_regression_backend_counts_a_client_disconnect_as_499(backend):
    """The backend's own write to a client that had gone away raised out of the handler:
    logged as an unhandled error and counted as a 500 in kvroute_backend_requests_total."""
    def count(status: str) -> float:
        _, _, data = request(backend.url + "/metrics")
        total = 0.0
        for line in data.decode().splitlines():
            if (line.startswith("kvroute_backend_requests_total") and 'endpoint="/v1/completions"' in line
                    and f'status="{status}"' in line):
                total += float(line.rsplit(" ", 1)[1])
        return total

    errors_before, gone_before = count("500"), count("499")
    mark = backend.log_path.stat().st_size
    body = orjson.dumps({"model": "demo", "prompt": "count 1 2 3", "stream": True, "max_tokens": 3000})
    for _ in range(10):
        sock = socket.create_connection(("127.0.0.1", backend.port), timeout=10)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        time.sleep(0.05)
        _rst_close(sock)
    wait_until(lambda: backend.health()["engine"]["decoding"] == 0, 10, what="decoding to stop")
    wait_until(lambda: count("499") - gone_before >= 10, 10, what="ten disconnects counted")
    assert count("500") == errors_before
    with open(backend.log_path, "rb") as f:
        f.seek(mark)
        assert b"unhandled error" not in f.read()


def test_regression_redis_outage_longer_than_forget_after_keeps_the_fleet():
    """After Redis was unreachable for longer than forget_after (10 s), the first answer
    of a Redis whose records had expired made the proxy forget every backend: requests
    got 404 model_not_found until the heartbeats came back."""
    from kvroute.proxy.fleet import Fleet

    b = Fleet()
    rec = BackendRecord(backend_id="b1", instance_id="i1", url="http://127.0.0.1:1", models=[MODEL])
    b.update([rec], keep_for=10.0)
    b.backends["b1"].listed_at -= 30  # last listed 30 s ago: Redis did not answer since
    b.update([], keep_for=10.0)  # back, empty (records expired during the outage)
    assert [x.id for x in b.serving(MODEL)] == ["b1"]
    b.backends["b1"].absent_since -= 11  # now missing from answers for longer than keep_for
    b.update([], keep_for=10.0)
    assert b.serving(MODEL) == []

"""`kvroute serve`: the README's command, supervision, shutdown, multi-model configs."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import psutil
import pytest
from tests.harness import free_port, get_json, request, wait_until


ROOT = Path(__file__).resolve().parent.parent


def readme_serve_command() -> str:
    """The serve line of the README's quick start, exactly as written."""
    text = (ROOT / "README.md").read_text()
    quick = text[text.index("## Quick start"):]
    block = quick[quick.index("```bash") + 7: quick.index("```", quick.index("```bash") + 7)]
    (line,) = [l for l in block.splitlines() if l.startswith("scripts/serve")]
    return line.split("#")[0].strip()


def start_serve(cmd: list[str] | str, env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, shell=isinstance(cmd, str),
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_proxy(port: int, backends: int, proc: subprocess.Popen, log: Path) -> dict:
    def ready():
        if proc.poll() is not None:
            raise AssertionError(f"serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        health = get_json(f"http://127.0.0.1:{port}/health")
        return health if len(health["backends"]) == backends else None

    return wait_until(ready, 120, interval=0.2, what="kvroute serve to be ready")


def stop(proc: subprocess.Popen, timeout: float = 15) -> float:
    """SIGTERM to the whole process group: with a shell in front (the README's
    command), the launcher is the shell's child, and it must get the signal too."""
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout)
    return time.monotonic() - t0


def deployment_pids(port: int) -> list[int]:
    health = get_json(f"http://127.0.0.1:{port}/health")
    return [health["pid"]] + [get_json(b["url"] + "/health")["pid"] for b in health["backends"]]


def gone(pid: int) -> bool:
    # A zombie awaiting its reaper is gone for our purposes.
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_readme_serve_command_serves_and_caches(tmp_path, model_cache):
    cmd = readme_serve_command()
    assert cmd.startswith("scripts/serve.sh")
    port = free_port()
    log = tmp_path / "serve.log"
    proc = start_serve(cmd, {"KVROUTE_PORT": str(port), "KVROUTE_CACHE_DIR": str(model_cache)}, log)
    try:
        wait_proxy(port, 2, proc, log)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "Hello, kvroute."}]
        r1 = c.chat.completions.create(model="kvroute-demo", messages=messages)
        messages += [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "Once more."}]
        r2 = c.chat.completions.create(model="kvroute-demo", messages=messages)
        assert r2.usage.prompt_tokens_details.cached_tokens > 0
        assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens
        pids = deployment_pids(port)
    finally:
        stop(proc, 30)
    # Regression: the shell in front of the launcher used to take the SIGTERM alone,
    # and every run of this test left a whole deployment behind.
    # 30 s: a backend inside an fsync of its disk tier cannot die, even by SIGKILL, until
    # the drive answers, which a loaded CI disk can take seconds to do.
    wait_until(lambda: all(gone(pid) for pid in pids), 30, interval=0.1,
               what="the README deployment's processes to exit")

    # Started again as typed (no secret set): the conversation's next turn is routed to
    # the backend whose disk tier holds it. A new random salt per start made every
    # record's prefix keys unfindable, and the turn went by load to a cold backend.
    proc = start_serve(cmd, {"KVROUTE_PORT": str(port), "KVROUTE_CACHE_DIR": str(model_cache)}, log)
    try:
        wait_proxy(port, 2, proc, log)
        messages += [{"role": "assistant", "content": r2.choices[0].message.content},
                     {"role": "user", "content": "And after a restart?"}]
        raw = c.chat.completions.with_raw_response.create(model="kvroute-demo", messages=messages)
        assert raw.headers["x-kvroute-route-reason"] == "disk-hit", dict(raw.headers)
        assert raw.parse().usage.prompt_tokens_details.cached_tokens >= r2.usage.prompt_tokens
    finally:
        stop(proc, 30)


CONFIG = """
secret = "test-secret"

[redis]
url = "{redis}"

[proxy]
port = {port}
api_keys = ["sk-serve-test:team"]
fetch_images = true
fetch_images_allow = ["127.0.0.1"]

[backends]
port_base = {base}

[[models]]
path = "demo"
alias = "small"
replicas = {replicas}
cache_bytes = "64MiB"

[[models]]
path = "demo"
alias = "large"
replicas = 1
cache_bytes = "{large}"
"""


def write_config(tmp_path, redis_url, port, replicas=1, large="128MiB") -> Path:
    path = tmp_path / "kvroute.toml"
    path.write_text(CONFIG.format(redis=redis_url, port=port, base=free_port(), replicas=replicas,
                                  large=large))
    return path


def serve_cmd(config: Path) -> list[str]:
    return [sys.executable, "-m", "kvroute.cli", "serve", "--config", str(config)]


def test_two_models_supervision_and_clean_shutdown(tmp_path, model_cache, redis_db):
    redis = redis_db
    port = free_port()
    log = tmp_path / "serve.log"
    proc = start_serve(serve_cmd(write_config(tmp_path, redis.url, port)),
                       {"KVROUTE_CACHE_DIR": str(model_cache)}, log)
    try:
        health = wait_proxy(port, 2, proc, log)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-serve-test",
                          max_retries=0)
        assert {m.id for m in c.models.list()} == {"small", "large"}
        for model in ("small", "large"):
            raw = c.chat.completions.with_raw_response.create(
                model=model, messages=[{"role": "user", "content": "hi"}])
            assert raw.parse().choices[0].finish_reason == "stop"
            assert raw.headers["x-kvroute-backend"] == f"{model}-1"
        budgets = {b["id"]: get_json(b["url"] + "/health")["cache"]["budget_bytes"]
                   for b in health["backends"]}
        assert budgets == {"small-1": 64 << 20, "large-1": 128 << 20}

        # SIGKILL of a model's only backend: the launcher restarts it (a new instance),
        # and a request sent meanwhile waits for it instead of failing.
        small = next(b for b in health["backends"] if b["id"] == "small-1")
        before = get_json(small["url"] + "/health")
        os.kill(before["pid"], signal.SIGKILL)
        r = c.chat.completions.create(model="small", messages=[{"role": "user", "content": "still?"}])
        assert r.choices[0].finish_reason == "stop"
        after = wait_until(
            lambda: (h := get_json(small["url"] + "/health"))["instance_id"] != before["instance_id"] and h,
            30, interval=0.2, what="the killed backend to be restarted")
        assert after["pid"] != before["pid"]
        r = c.chat.completions.create(model="small", messages=[{"role": "user", "content": "again"}])
        assert r.choices[0].finish_reason == "stop"
        # Again, streamed: the stream starts at once and carries the answer once it is back.
        os.kill(after["pid"], signal.SIGKILL)
        chunks = list(c.chat.completions.create(
            model="small", messages=[{"role": "user", "content": "streamed"}], stream=True))
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"

        pids = [get_json(b["url"] + "/health")["pid"] for b in health["backends"]]
        proxy_pid = get_json(f"http://127.0.0.1:{port}/health")["pid"]
        pids.append(proxy_pid)
        # Secrets reach the children in their environment, never on a command line
        # (`ps` shows those to every user); API keys reach the proxy alone.
        for pid in pids:
            cmdline = " ".join(psutil.Process(pid).cmdline())
            for secret in ("test-secret", "sk-serve-test", redis.url):
                assert secret not in cmdline, (secret, cmdline)
        assert psutil.Process(proxy_pid).environ()["KVROUTE_API_KEYS"] == "sk-serve-test:team"
        # The file's image fetching reaches the proxy: it tries a URL (nothing listens there).
        assert psutil.Process(proxy_pid).environ()["KVROUTE_FETCH_IMAGES_ALLOW"] == "127.0.0.1/32"
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="small", messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": f"http://127.0.0.1:{free_port()}/a"}}]}])
        assert "no connection could be made" in e.value.body["message"], e.value.body
        assert all("KVROUTE_API_KEYS" not in psutil.Process(pid).environ() for pid in pids[:-1])
        assert all(psutil.Process(pid).environ()["KVROUTE_SECRET"] == "test-secret" for pid in pids)
        # Only backends load MLX: on a CUDA machine a process that loads it holds a
        # context (~0.5 GiB) on the card its replicas share.
        def loads_mlx(pid: int) -> bool:
            return any("libmlx" in m.path for m in psutil.Process(pid).memory_maps())

        assert not loads_mlx(proc.pid) and not loads_mlx(proxy_pid) and loads_mlx(pids[0])
    finally:
        elapsed = stop(proc)
    assert elapsed < 10, elapsed
    assert proc.returncode == 0, log.read_text()[-2000:]
    assert all(gone(pid) for pid in pids), pids
    # Nothing of this deployment stays advertised (pending routing marks expire in seconds).
    import redis as redis_py

    r = redis_py.Redis.from_url(redis.url)
    try:
        wait_until(lambda: not list(r.scan_iter("kvr:*")), 10, interval=0.2,
                   what="Redis to hold no key of the stopped deployment")
    except TimeoutError:
        raise AssertionError(f"left in Redis: {list(r.scan_iter('kvr:*'))}\n{log.read_text()[-3000:]}")
    r.close()


def test_config_over_memory_is_refused_with_the_numbers(tmp_path, model_cache):
    port = free_port()
    config = write_config(tmp_path, "redis://127.0.0.1:1/0", port, replicas=3, large="100TiB")
    out = subprocess.run(serve_cmd(config), cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "KVROUTE_CACHE_DIR": str(model_cache), "COLUMNS": "200"})
    assert out.returncode == 2
    message = out.stderr
    assert "do not fit in memory" in message
    assert re.search(r"small: 3 x \(.*weights \+ 64\.0 MiB cache", message), message
    assert "total" in message and "physical memory" in message
    # Refused before anything started: nothing listens on the proxy port.
    with pytest.raises(OSError):
        request(f"http://127.0.0.1:{port}/health", timeout=1)


@pytest.mark.parametrize("args, code, reason", [
    (["--redis-url", "redis+clustr://127.0.0.1:1"], 2, "--redis-url: Redis URL must start with"),
    (["--model", "/no/such/model"], 2, "model '/no/such/model': no such directory"),
])
def test_a_setting_no_component_can_start_with_stops_serve_at_once(model_cache, args, code, reason):
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "kvroute.cli", "serve", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "KVROUTE_CACHE_DIR": str(model_cache)})
    assert out.returncode == code, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("kvroute serve: ") and reason in last, out.stderr[-2000:]
    assert time.monotonic() - t0 < 30


def test_a_proxy_port_held_by_another_server_stops_serve_with_the_reason(tmp_path, model_cache):
    """Another kvroute (or anything answering /health 200) already on the proxy port: the
    launcher must not take that server's answer for its own proxy's, and the proxy, which
    cannot bind, exits at once (its startup tasks once kept it alive, silently)."""
    import http.server
    import threading

    class Healthy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'{"status": "ok", "pid": 1}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    stranger = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Healthy)
    threading.Thread(target=stranger.serve_forever, daemon=True).start()
    try:
        t0 = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-m", "kvroute.cli", "serve", "--port", str(stranger.server_port),
             "--backend-port-base", str(free_port())], cwd=ROOT, capture_output=True, text=True,
            timeout=120, env={**os.environ, "KVROUTE_CACHE_DIR": str(model_cache)})
    finally:
        stranger.shutdown()
    assert out.returncode == 1, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last == (f"kvroute serve: proxy exited with 1 while starting: kvroute proxy: cannot "
                    f"listen on 127.0.0.1:{stranger.server_port}: Address already in use"), last
    assert time.monotonic() - t0 < 60


def test_bad_config_is_refused_clearly(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[[models]]\npath = 'demo'\nrelicas = 2\n")
    out = subprocess.run(serve_cmd(path), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "unknown keys relicas (did you mean replicas?)" in out.stderr


def test_a_health_poll_answered_by_something_not_http_means_not_ready():
    """A regression: the launcher polled a child's port before the child listened, the
    connect met itself (TCP simultaneous open) and read back its own request line; the
    http.client error it raised killed `kvroute serve`. Here an echo server plays that
    part: the poll says "not ready" instead of raising."""
    import socket
    import threading

    from kvroute.api.lifecycle import health_body

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def echo() -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(conn.recv(4096))

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    try:
        assert health_body(f"http://127.0.0.1:{server.getsockname()[1]}", timeout=1) is None
    finally:
        thread.join(5)
        server.close()


def test_a_backend_holds_its_port_from_start_to_serving():
    """A regression: `kvroute serve` picks each backend's port before the backend starts,
    and while one loaded its model an outgoing connection of another process took the
    port; the backend died on bind. A backend now binds first: nothing else can take the
    port (an outgoing connection's local port is a bind too), a health poll is refused
    until it listens, and then it serves on those same sockets. The tests' own ports lie
    below the ephemeral range, where outgoing connections never land."""
    import asyncio
    import socket

    import aiohttp
    from aiohttp import web

    from kvroute.api.lifecycle import bind_sockets, start_site
    from kvroute.serve.redis_server import _ephemeral_low

    port = free_port()
    assert port < _ephemeral_low()
    socks = bind_sockets("127.0.0.1", port)
    try:
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()

        async def ok(_: web.Request) -> web.Response:
            return web.json_response({"status": "ok"})

        async def health() -> dict:
            app = web.Application()
            app.router.add_get("/health", ok)
            runner = await start_site(app, "127.0.0.1", port, socks)
            try:
                async with aiohttp.ClientSession() as session:
                    async with session.get(f"http://127.0.0.1:{port}/health") as resp:
                        return await resp.json()
            finally:
                await runner.cleanup()

        assert asyncio.run(health()) == {"status": "ok"}
    finally:
        for sock in socks:
            sock.close()


def test_a_model_is_loaded_once_one_replica_answers_and_loading_before(tmp_path, model_cache):
    """/v1/models says `loading` while no backend of a model answers /health (a request
    meanwhile waits, then is answered), and `loaded` as soon as one replica does, while
    the other is still starting. The replicas are held back with SIGSTOP: slow starts."""
    import threading

    from tests.harness import ServeProcess

    serve = ServeProcess({"models": [{"path": "demo", "alias": "d", "replicas": 2,
                                      "cache_bytes": "32MiB", "disk_cache_bytes": "0"}]},
                         tmp_path, env={"KVROUTE_CACHE_DIR": str(model_cache)})
    stopped: dict[str, psutil.Process] = {}
    try:
        def replicas() -> bool:
            for p in psutil.Process(serve.proc.pid).children():
                try:
                    cmd = p.cmdline()
                except psutil.Error:  # gone already (a short-lived helper)
                    continue
                if "backend" in cmd and "--id" in cmd and cmd[cmd.index("--id") + 1] not in stopped:
                    p.send_signal(signal.SIGSTOP)
                    stopped[cmd[cmd.index("--id") + 1]] = p
            return len(stopped) == 2

        serve.wait_ready(replicas, 60, interval=0.01, what="both replicas to start")

        def state() -> str | None:
            try:
                listed = get_json(serve.url + "/v1/models")["data"]
                return {m["id"]: m for m in listed}["d"]["state"]
            except (OSError, KeyError):
                return None

        serve.wait_ready(state, 60, what="the proxy to list d")
        assert state() == "loading"
        client = openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0,
                               timeout=120)
        answers = []
        early = threading.Thread(target=lambda: answers.append(client.chat.completions.create(
            model="d", messages=[{"role": "user", "content": "Hello there."}], max_tokens=4)))
        early.start()
        time.sleep(0.5)  # it is held: nothing can answer it yet
        assert not answers and state() == "loading"
        stopped["d-1"].send_signal(signal.SIGCONT)
        serve.wait_ready(lambda: state() == "loaded", 60, what="d to be loaded")
        early.join(60)
        assert answers and answers[0].choices[0].finish_reason in ("stop", "length")
        # d-2 is still stopped: one replica is enough to be loaded and to serve.
        assert stopped["d-2"].status() == psutil.STATUS_STOPPED
        assert client.chat.completions.create(
            model="d", messages=[{"role": "user", "content": "Hi."}], max_tokens=4).choices
    finally:
        for p in stopped.values():
            try:
                p.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass
        serve.stop()


def test_the_memory_check_counts_the_running_budget_the_serve_flag_sets(tmp_path, model_cache):
    """The demo model's full batch (32 x 8,192 tokens of KV) does not fit a 700 MiB
    budget; with --max-running-tokens 16384 the KV term is 16 MiB, and serve starts."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvroute.cli", "serve", "--port", str(port), "--replicas", "1",
           "--cache-bytes", "32MiB", "--memory-budget", "700MiB",
           "--backend-port-base", str(free_port())]
    env = {**os.environ, "KVROUTE_CACHE_DIR": str(model_cache), "COLUMNS": "200"}
    out = subprocess.run([*cmd, "--max-running-tokens", "0"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env=env)
    assert out.returncode == 2 and "KV (32 x 8192 tokens x 1.0 KiB)" in out.stderr, out.stderr
    assert "max_running_tokens" in out.stderr  # the refusal names what to lower
    log = tmp_path / "serve.log"
    proc = start_serve([*cmd, "--max-running-tokens", "16384"],
                       {"KVROUTE_CACHE_DIR": str(model_cache)}, log)
    try:
        health = wait_proxy(port, 1, proc, log)
        backend = get_json(health["backends"][0]["url"] + "/health")
        assert backend["engine"]["max_running_tokens"] == 16384
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0)
        assert client.chat.completions.create(
            model="kvroute-demo", messages=[{"role": "user", "content": "Hi."}],
            max_tokens=4).choices
    finally:
        stop(proc)

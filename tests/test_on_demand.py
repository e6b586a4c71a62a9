"""Models on demand with real processes: one `kvroute serve` with more models than it
may hold at once (max_loaded_models = 2, one pinned), shared by the tests in order.

The models are the demo model under different aliases: each alias is its own backend
process, loaded and unloaded as a unit. The shared deployment's last test stops it
while a load runs; the test after it starts two deployments of its own (two machines).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import psutil
import pytest
from tests.harness import ServeProcess, SSEStream, chat, get_json, request, wait_until

DEMO = {"path": "demo", "cache_bytes": "32MiB"}


def config(idle: str, empty_dir: Path) -> dict:
    return {
        "max_loaded_models": 2,
        "proxy": {"load_timeout": 120},
        "models": [
            {**DEMO, "alias": "m1", "pin": True},
            {**DEMO, "alias": "m2", "preload": False},
            {**DEMO, "alias": "m3", "preload": False, "idle_unload": idle},
            # A folder with no model in it: its backend starts and fails to load.
            {"path": str(empty_dir), "alias": "broken", "preload": False},
            # No such folder (nor a repo id): refused before anything is started or unloaded.
            {"path": "/nonexistent/kvroute-model", "alias": "ghost", "preload": False},
        ],
    }


MODELS = {"m1", "m2", "m3", "broken", "ghost"}


MESSAGES = [{"role": "user", "content": "Hello there."}]


class Deployment:
    def __init__(self, tmp: Path, model_cache: Path, idle: str = "6s"):
        (tmp / "empty-model").mkdir()
        self.serve = ServeProcess(config(idle, tmp / "empty-model"), tmp,
                                  env={"KVROUTE_CACHE_DIR": str(model_cache)})
        self.proc, self.log, self.url = self.serve.proc, self.serve.log_path, self.serve.url
        self.pids: set[int] = set()  # every process of the deployment seen so far
        self.most_backends = 0
        self._watching = True
        self.serve.wait_ready(lambda: any(m["state"] == "loaded" for m in self.models().values()),
                              180)
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    def backends(self) -> list[psutil.Process]:
        """The launcher's backend children (not their own short-lived forks, which
        carry the same command line until they exec)."""
        try:
            launcher = psutil.Process(self.proc.pid)
            self.pids.update(p.pid for p in launcher.children(recursive=True))
            children = launcher.children()
        except psutil.NoSuchProcess:
            return []
        out = []
        for p in children:
            try:
                if "backend" in p.cmdline():
                    out.append(p)
            except psutil.NoSuchProcess:
                pass
        return out

    def _watch(self) -> None:
        while self._watching:
            self.most_backends = max(self.most_backends, len(self.backends()))
            time.sleep(0.05)

    def models(self) -> dict[str, dict]:
        return {m["id"]: m for m in get_json(self.url + "/v1/models")["data"]}

    def stats(self) -> dict[str, dict]:
        return {m["model"]: m for m in get_json(self.url + "/stats")["model_states"]}

    def finish_of(self, model: str) -> str:
        """How a short answer of `model` finished."""
        reply = chat(self, MESSAGES, model, timeout=180, max_tokens=8)
        return reply.completion.choices[0].finish_reason

    def stop(self) -> None:
        self._watching = False
        self.serve.stop()


@pytest.fixture(scope="module")
def dep(tmp_path_factory, model_cache):
    d = Deployment(tmp_path_factory.mktemp("on-demand"), model_cache)
    yield d
    d.stop()


def test_models_in_any_order_never_more_than_the_limit(dep):
    listed = dep.models()
    assert set(listed) == MODELS
    # A model not loaded has a `created` all the same: when serve began to offer it.
    created = listed["ghost"]["created"]
    assert time.time() - 600 < created <= time.time(), listed["ghost"]
    assert listed["m1"]["state"] == "loaded"
    assert {listed[m]["state"] for m in MODELS - {"m1"}} == {"unloaded"}
    for model in ("m1", "m2", "m3", "m1", "m3", "m2"):
        assert dep.finish_of(model) in ("stop", "length")
        assert dep.models()[model]["state"] == "loaded"
        assert set(dep.models()) == MODELS
    assert dep.most_backends <= 2, dep.most_backends
    assert dep.models()["ghost"]["created"] == created  # not the last publication's time
    stats = dep.stats()
    # The pinned model was loaded once and never unloaded; the others took turns.
    assert (stats["m1"]["loads"], stats["m1"]["unloads"]) == (1, 0)
    assert stats["m2"]["loads"] >= 2 and stats["m3"]["loads"] >= 1
    assert stats["m3"]["unloads"] >= 1
    assert stats["m2"]["memory_bytes"] > 0 and stats["m2"]["last_load_seconds"] > 0


def test_concurrent_requests_for_a_cold_model_share_one_load(dep):
    assert dep.models()["m3"]["state"] == "unloaded"
    loads = dep.stats()["m3"]["loads"]
    stream = SSEStream(dep.url + "/v1/chat/completions",
                       {"model": "m3", "messages": MESSAGES, "max_tokens": 8}, timeout=180)
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        answers = list(pool.map(dep.finish_of, ["m3"] * 5))
    assert all(a in ("stop", "length") for a in answers)
    # The stream started during the load: keep-alive comments, then the answer.
    assert stream.status == 200
    first = stream.resp.readline()
    assert first == b": loading\n", first
    events = list(stream.events())
    assert events[-1] == "[DONE]" and any(e["choices"] for e in events[:-1] if e != "[DONE]")
    assert dep.stats()["m3"]["loads"] == loads + 1
    assert dep.most_backends <= 2


def test_idle_model_is_unloaded(dep):
    unloads = dep.stats()["m3"]["unloads"]
    wait_until(lambda: dep.models()["m3"]["state"] == "unloaded", 60, interval=0.5,
               what="m3 (idle_unload 6s) to be unloaded")
    assert dep.stats()["m3"]["unloads"] == unloads + 1
    assert dep.models()["m1"]["state"] == "loaded"  # pinned, and idle as well
    # The same states in the proxy's metrics and in `kvroute stats`.
    _, _, metrics = request(dep.url + "/metrics")
    assert b'kvroute_model_state{model="m3",state="unloaded"} 1.0' in metrics
    assert b'kvroute_model_state{model="m1",state="loaded"} 1.0' in metrics
    out = subprocess.run([sys.executable, "-m", "kvroute.cli", "stats", "--url", dep.url],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    assert "model states" in out.stdout and re.search(r"m1\s.*loaded \(pinned\)", out.stdout)


def _sse_lines(url: str, body: dict, headers: dict | None = None) -> list[bytes]:
    s = SSEStream(url, body, headers=headers, timeout=180)
    assert s.status == 200
    lines = []
    while line := s.resp.readline():
        lines.append(line.strip())
    return lines


def test_responses_and_messages_streams_keep_alive_while_loading(dep):
    # m3 is unloaded (idle): Responses loads it; m2 was unloaded to make room.
    lines = _sse_lines(dep.url + "/v1/responses", {"model": "m3", "input": "Hi", "max_output_tokens": 8})
    assert lines[0] == b": loading"
    assert {b"event: response.completed", b"event: response.incomplete"} & set(lines), lines[-6:]
    assert dep.models()["m2"]["state"] == "unloaded"
    lines = _sse_lines(dep.url + "/v1/messages", {"model": "m2", "max_tokens": 8,
                                                  "messages": MESSAGES})
    assert lines[0] == b": loading"
    assert b"event: message_stop" in lines, lines[-6:]
    assert dep.most_backends <= 2


def test_broken_model_gets_a_clear_error_and_the_others_keep_serving(dep):
    # A streaming client waits through the failed load and gets the error as an event.
    s = SSEStream(dep.url + "/v1/chat/completions", {"model": "broken", "messages": MESSAGES},
                  timeout=120)
    assert s.status == 200
    (event, done) = list(s.events())
    assert event["error"]["code"] == "model_load_failed" and done == "[DONE]", event
    # Then at once, from the recorded failure: a plain 503 that says why, no new attempt.
    with pytest.raises(openai.APIStatusError) as err:
        dep.finish_of("broken")
    assert err.value.status_code == 503
    body = err.value.body if isinstance(err.value.body, dict) else {}
    assert body.get("code") == "model_load_failed", err.value.body
    assert "'broken'" in body["message"] and "could not be loaded" in body["message"], body
    assert int(err.value.response.headers["Retry-After"]) >= 1
    s = SSEStream(dep.url + "/v1/chat/completions", {"model": "broken", "messages": MESSAGES})
    assert s.status == 503 and s.headers["Content-Type"].startswith("application/json")
    log = dep.log.read_text()
    assert len(re.findall(r"loading broken", log)) == 1  # no retry storm
    # serve's own log says it failed and for how long requests get the error.
    assert re.search(r"loading model 'broken' failed: .*then it is tried again", log)
    assert dep.models()["broken"]["state"] == "unloaded"
    assert dep.finish_of("m1") in ("stop", "length")


def test_a_model_whose_path_is_not_there_unloads_nothing(dep):
    # Its load fails before room is made: the loaded models stay, and even a streaming
    # client gets a plain 503 naming the path (the machine refused before a byte).
    before = {m: e["state"] for m, e in dep.models().items()}
    unloads = {m: e["unloads"] for m, e in dep.stats().items()}
    s = SSEStream(dep.url + "/v1/chat/completions", {"model": "ghost", "messages": MESSAGES},
                  timeout=60)
    assert s.status == 503 and s.headers["Content-Type"].startswith("application/json")
    assert int(s.headers["Retry-After"]) >= 1
    err = json.loads(s.resp.read())["error"]
    assert err["code"] == "model_load_failed", err
    assert "'/nonexistent/kvroute-model': no such directory" in err["message"], err
    assert {m: e["state"] for m, e in dep.models().items()} == before
    assert {m: e["unloads"] for m, e in dep.stats().items()} == unloads
    assert "loading ghost" not in dep.log.read_text()


def test_no_room_answers_503_naming_the_limit(dep):
    # m1 is pinned and m2 loading (it cannot be unloaded before it is up): no room for m3.
    assert {dep.models()[m]["state"] for m in ("m2", "m3")} == {"unloaded"}
    stream = SSEStream(dep.url + "/v1/chat/completions",
                       {"model": "m2", "messages": MESSAGES, "max_tokens": 8}, timeout=180)
    wait_until(lambda: dep.models()["m2"]["state"] == "loading", 30, interval=0.05,
               what="m2 to be loading")
    # A streaming request that the machine refuses gets a plain 503 too, not a stream.
    refused = SSEStream(dep.url + "/v1/chat/completions", {"model": "m3", "messages": MESSAGES},
                        timeout=60)
    assert refused.status == 503 and int(refused.headers["Retry-After"]) >= 1
    assert json.loads(refused.resp.read())["error"]["code"] == "model_capacity"
    with pytest.raises(openai.APIStatusError) as err:
        dep.finish_of("m3")
    assert err.value.status_code == 503, err.value.body
    assert err.value.body["code"] == "model_capacity", err.value.body
    assert "max_loaded_models (2)" in err.value.body["message"], err.value.body
    assert "m1 (pinned)" in err.value.body["message"] and "m2 (loading)" in err.value.body["message"]
    assert int(err.value.response.headers["Retry-After"]) >= 1
    assert stream.status == 200 and list(stream.events())[-1] == "[DONE]"
    assert dep.models()["m2"]["state"] == "loaded"


def test_a_refusal_after_the_load_ends_the_started_stream_with_an_error_event(dep):
    # The stream started while m3 loaded; the backend then refuses the request (400):
    # the error comes as the stream's error event, not as a second response.
    s = SSEStream(dep.url + "/v1/chat/completions",
                  {"model": "m3", "messages": MESSAGES, "temperature": "hot"}, timeout=180)
    assert s.status == 200
    assert s.resp.readline() == b": loading\n"
    (event, done) = list(s.events())
    assert event["error"]["type"] == "invalid_request_error", event
    assert event["error"]["param"] == "temperature" and done == "[DONE]", event
    assert dep.models()["m3"]["state"] == "loaded"


def test_sigterm_during_a_load_leaves_no_process(dep):
    cold = next(m for m in ("m2", "m3") if dep.models()[m]["state"] == "unloaded")
    stream = SSEStream(dep.url + "/v1/chat/completions", {"model": cold, "messages": MESSAGES},
                       timeout=60)
    wait_until(lambda: dep.models()[cold]["state"] == "loading", 30, interval=0.05,
               what=f"{cold} to be loading")
    dep.backends()  # note the pids of the load in progress
    pids = set(dep.pids) | {dep.proc.pid}
    assert stream.resp.readline() == b": loading\n"
    got: list = []
    reader = threading.Thread(target=lambda: got.extend([*stream.events(), time.monotonic()]))
    reader.start()
    t0 = time.monotonic()
    dep.stop()
    assert dep.proc.returncode == 0, dep.log.read_text()[-2000:]
    reader.join(30)
    # The held stream is answered as the proxy begins to stop, not cut when it ends.
    event, done, at = got
    assert event["error"]["code"] == "shutting_down" and done == "[DONE]", event
    assert at - t0 < 4.5, at - t0  # not after the 5 s the proxy gives its handlers

    def gone(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    wait_until(lambda: all(gone(p) for p in pids), 15, interval=0.1,
               what="every process of the deployment to exit")
    stream.close()


def test_a_proxy_wakes_a_model_on_another_machine(tmp_path, model_cache, redis_db):
    """Two `kvroute serve` on one Redis: machine a serves `here`, machine b may load
    `there`. A request to a's proxy for `there` is loaded by b and answered."""
    redis = redis_db
    machines = []
    try:
        for machine, alias, preload in (("a", "here", True), ("b", "there", False)):
            machines.append(ServeProcess(
                {"machine": machine, "secret": "shared-secret", "internal_token": "shared-token",
                 "redis": {"url": redis.url},
                 "models": [{**DEMO, "alias": alias, "preload": preload}]},
                tmp_path, name=machine, env={"KVROUTE_CACHE_DIR": str(model_cache)}))
        url = machines[0].url

        def listed():
            models = {m["id"]: m["state"] for m in get_json(url + "/v1/models")["data"]}
            return models == {"here": "loaded", "there": "unloaded"}

        machines[0].wait_ready(listed, 120, what="a's model loaded and b's listed, unloaded")
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                               timeout=180)
        raw = client.chat.completions.with_raw_response.create(
            model="there", messages=MESSAGES, max_tokens=8)
        assert raw.headers["x-kvroute-backend"] == "b-there-1"
        assert raw.parse().choices[0].finish_reason in ("stop", "length")
        states = {m["model"]: m for m in get_json(url + "/stats")["model_states"]}
        assert states["there"]["machine"] == "b" and states["there"]["loads"] == 1
    finally:
        for m in machines:
            m.stop()

"""End to end through the proxy: real Redis, 2 proxies, 3 backend processes
(2 serving model A, 1 serving model B), and the official `openai` client.

The tests run in file order: the fault tests (Redis stopped, a backend killed)
come last and restore what they break.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path

import openai
import pytest
from tests import harness
from tests.harness import BackendProcess, SSEStream, chat, client, request, wait_until

from kvroute.devtools.demo_model import DEMO_REPLY

SECRET = "test-secret"
TOKEN = "internal-test-token"
KEY = "sk-test-key"
MODEL_A, MODEL_B = "model-a", "model-b"


class ProxyProcess(harness.ProxyProcess):
    """A proxy of this deployment (test_disk_tier and bench_disk start one too)."""

    def __init__(self, redis_url: str, log_dir: Path, extra: list[str] | None = None):
        super().__init__(redis_url, log_dir, ["--secret", SECRET, "--internal-token", TOKEN,
                                              "--api-key", KEY, *(extra or [])])


@pytest.fixture(scope="module")
def fleet(text_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("fleet")

    def backends(redis_url: str) -> list[BackendProcess]:
        common = ["--redis-url", redis_url, "--secret", SECRET, "--internal-token", TOKEN,
                  "--enable-faults"]
        return [BackendProcess(text_model, MODEL_A, logs, backend_id="a1", extra=common),
                BackendProcess(text_model, MODEL_A, logs, backend_id="a2", extra=common),
                BackendProcess(text_model, MODEL_B, logs, backend_id="b1",
                               extra=common + ["--max-queue", "1"])]

    with harness.fleet(backends, lambda url: [ProxyProcess(url, logs), ProxyProcess(url, logs)]) as f:
        yield f


def new_conversation(system: str | None = None) -> list[dict]:
    system = system or f"{uuid.uuid4().hex}: you help a team of engineers. " * 4
    return [{"role": "system", "content": system}, {"role": "user", "content": "Hello there."}]


def run_turns(proxy, messages, turns, start=0):
    """Runs turns, appending replies; returns [(backend, prompt_tokens, cached_tokens)]."""
    out = []
    for i in range(turns):
        r = chat(proxy, messages, MODEL_A, key=KEY)
        out.append((r.headers["x-kvroute-backend"], r.completion.usage.prompt_tokens,
                    r.completion.usage.prompt_tokens_details.cached_tokens))
        messages += [{"role": "assistant", "content": r.completion.choices[0].message.content},
                     {"role": "user", "content": f"Tell me more ({start + i})."}]
    return out


def test_six_turns_land_on_one_backend_and_hit(fleet):
    proxy = fleet["proxies"][0]
    turns = run_turns(proxy, new_conversation(), 6)
    assert len({b for b, _, _ in turns}) == 1, turns
    for (_, prev_prompt, _), (_, _, cached) in zip(turns, turns[1:]):
        assert cached >= prev_prompt - 3, turns


def test_token_id_prompts_route_back_to_the_backend_that_holds_them(fleet, text_model):
    """A completions prompt given as token ids is keyed by its ids: the same ids again,
    through either proxy, go to the backend that prefilled them and hit its cache."""
    from transformers import AutoTokenizer

    text = f"{uuid.uuid4().hex}: count with me. " * 8
    ids = AutoTokenizer.from_pretrained(str(text_model)).encode(text)
    first = client(fleet["proxies"][0], key=KEY).completions.with_raw_response.create(
        model=MODEL_A, prompt=ids, max_tokens=4)
    holder = first.headers["x-kvroute-backend"]
    assert first.parse().usage.prompt_tokens == len(ids)
    for proxy in fleet["proxies"]:
        again = client(proxy, key=KEY).completions.with_raw_response.create(
            model=MODEL_A, prompt=ids, max_tokens=4)
        assert again.headers["x-kvroute-backend"] == holder
        assert again.headers["x-kvroute-route-reason"] == "cache-hit"
        assert again.parse().usage.prompt_tokens_details.cached_tokens >= len(ids) - 3


def test_other_proxy_keeps_hitting_the_same_backend(fleet):
    p1, p2 = fleet["proxies"]
    messages = new_conversation()
    first = run_turns(p1, messages, 2)
    more = run_turns(p2, messages, 2, start=2)
    assert {b for b, _, _ in first + more} == {first[0][0]}
    turns = first + more
    for (_, prev_prompt, _), (_, _, cached) in zip(turns, turns[1:]):
        assert cached >= prev_prompt - 3, turns


def live_pending_marks(redis_url: str) -> list[bytes]:
    import redis

    r = redis.Redis.from_url(redis_url)
    try:
        secs, micros = r.time()
        now_ms = secs * 1000 + micros // 1000
        return [k for k in r.scan_iter("kvr:*:p:*") if r.zrangebyscore(k, now_ms, "+inf")]
    finally:
        r.close()


def test_partial_prefill_regression_retry_returns_to_turn1_backend(fleet):
    """A client that gives up during turn 2's prefill and retries: the partial
    entry used to replace turn 1's with no prefix keys, so the retry was routed by
    load. It must go back to turn 1's backend and find more than turn 1 cached."""
    proxy = fleet["proxies"][0]
    messages = new_conversation()
    first = chat(proxy, messages, MODEL_A, key=KEY)
    home = fleet["backends"][first.headers["x-kvroute-backend"]]
    turn1 = first.completion.usage.prompt_tokens + first.completion.usage.completion_tokens
    log = " ".join(f"line {i}: request served in {i % 17} ms." for i in range(300))
    messages += [{"role": "assistant", "content": first.completion.choices[0].message.content},
                 {"role": "user", "content": f"Here is the log:\n{log}"}]
    stream = SSEStream(proxy.url + "/v1/chat/completions",
                       {"model": MODEL_A, "messages": messages, "max_tokens": 2,
                        "kvroute_fault": "slow_prefill:0.2"},
                       headers={"Authorization": f"Bearer {KEY}"})

    def past_turn1():
        jobs = home.health()["engine"]["jobs"]
        return [j for j in jobs if j["phase"] == "prefill" and j["processed"] > turn1 + 256]

    wait_until(past_turn1, timeout=60, what="turn 2's prefill to pass turn 1 on its backend")
    stream.close()
    wait_until(lambda: not home.health()["engine"]["jobs"], timeout=20,
               what="the abandoned prefill to leave the batch")
    # Routing marks left by turn 2's first try would steer the retry by themselves.
    wait_until(lambda: not live_pending_marks(fleet["redis"].url), timeout=10,
               what="turn 2's routing marks to lapse")
    # Through the other proxy: it knows only what Redis says, not this proxy's choices.
    retry = chat(fleet["proxies"][1], messages, MODEL_A, key=KEY, max_tokens=2)
    assert retry.headers["x-kvroute-backend"] == home.backend_id
    # Sent there because Redis still lists turn 1's prefix for it, not by a tie.
    assert int(retry.headers["x-kvroute-prefix-blocks"]) > 0, dict(retry.headers)
    assert retry.completion.usage.prompt_tokens_details.cached_tokens > turn1 + 256


def _concurrently(fn, n):
    results, errors = [None] * n, []

    def run(i):
        try:
            results[i] = fn(i)
        except Exception as exc:  # surfaced below, with the thread's own error
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


def test_new_conversations_spread_over_both_backends(fleet):
    proxy = fleet["proxies"][0]
    # Longer prompts give each request prefill work, which is what spreads a burst.
    backends = _concurrently(
        lambda i: chat(proxy, new_conversation(f"{uuid.uuid4().hex} " * 60), MODEL_A,
                       key=KEY).headers["x-kvroute-backend"], 8)
    counts = {b: backends.count(b) for b in set(backends)}
    assert set(counts) == {"a1", "a2"}, counts


def test_burst_sharing_a_new_system_prompt_lands_together(fleet):
    proxy = fleet["proxies"][0]
    system = f"{uuid.uuid4().hex}: shared instructions for the whole team. " * 6
    backends = _concurrently(
        lambda i: chat(proxy, [{"role": "system", "content": system},
                               {"role": "user", "content": f"Question {i}"}], MODEL_A,
                       key=KEY).headers["x-kvroute-backend"], 4)
    assert len(set(backends)) == 1, backends


def test_model_b_never_reaches_model_a_backends(fleet):
    proxy = fleet["proxies"][1]
    for _ in range(4):
        r = chat(proxy, new_conversation(), model=MODEL_B, key=KEY)
        assert r.headers["x-kvroute-backend"] == "b1"
        assert r.completion.choices[0].message.content == DEMO_REPLY


def test_models_lists_the_union(fleet):
    ids = {m.id for m in client(fleet["proxies"][0], KEY).models.list()}
    assert ids == {MODEL_A, MODEL_B}


def test_errors_unknown_model_bad_json_wrong_key(fleet):
    proxy = fleet["proxies"][0]
    with pytest.raises(openai.NotFoundError):
        chat(proxy, new_conversation(), model="no-such-model", key=KEY)
    status, _, data = request(proxy.url + "/v1/chat/completions", "POST", raw=b"{bad json",
                              headers={"Authorization": f"Bearer {KEY}"})
    assert status == 400 and json.loads(data)["error"]["code"] == "invalid_json"
    with pytest.raises(openai.AuthenticationError):
        client(proxy, key="wrong").chat.completions.create(model=MODEL_A, messages=new_conversation())
    status, _, data = request(proxy.url + "/v1/models")
    assert status == 401 and json.loads(data)["error"]["type"] == "authentication_error"


def test_backends_answer_only_with_the_internal_token(fleet):
    backend = fleet["backends"]["a1"]
    body = {"model": MODEL_A, "messages": new_conversation()}
    status, _, data = request(backend.url + "/v1/chat/completions", "POST", body)
    assert status == 401 and json.loads(data)["error"]["code"] == "invalid_internal_token"
    status, _, _ = request(backend.url + "/v1/chat/completions", "POST", body,
                           headers={"x-kvroute-token": TOKEN})
    assert status == 200


def test_streaming_relays_and_a_disconnect_stops_the_backend(fleet):
    proxy = fleet["proxies"][0]
    stream = SSEStream(proxy.url + "/v1/completions",
                       {"model": MODEL_A, "prompt": f"{uuid.uuid4().hex} count 1 2 3", "max_tokens": 6000},
                       headers={"Authorization": f"Bearer {KEY}"})
    events = stream.events()
    texts = [next(events)["choices"][0]["text"] for _ in range(10)]
    assert "".join(texts).isdigit()
    backend = fleet["backends"][stream.headers["x-kvroute-backend"]]
    assert backend.health()["engine"]["decoding"] >= 1
    stream.close()
    wait_until(lambda: backend.health()["engine"]["decoding"] == 0, 10,
               what="the backend to stop decoding after the client left")


def test_429_when_every_candidate_is_full(fleet):
    proxy = fleet["proxies"][0]
    hold = SSEStream(proxy.url + "/v1/completions",
                     {"model": MODEL_B, "prompt": "count 1 2 3", "max_tokens": 6000},
                     headers={"Authorization": f"Bearer {KEY}"})
    next(hold.events())
    status, headers, data = request(
        proxy.url + "/v1/completions", "POST", {"model": MODEL_B, "prompt": "hi", "max_tokens": 2},
        headers={"Authorization": f"Bearer {KEY}"})
    hold.close()
    assert status == 429, data
    assert json.loads(data)["error"]["type"] == "rate_limit_error"
    assert int(headers["Retry-After"]) >= 1


def test_redis_stopped_requests_still_succeed(fleet):
    proxy = fleet["proxies"][0]
    redis = fleet["redis"]
    redis.stop()
    try:
        for _ in range(3):
            r = chat(proxy, new_conversation(), MODEL_A, key=KEY)
            assert r.completion.choices[0].message.content == DEMO_REPLY
            assert r.headers["x-kvroute-route-reason"] == "no-registry"
    finally:
        redis.restart()
    # Back to cache-aware routing once Redis answers and backends re-advertise.
    messages = new_conversation()
    run_turns(proxy, messages, 1)
    wait_until(lambda: chat(proxy, messages[:2], MODEL_A, key=KEY).headers["x-kvroute-route-reason"]
               == "cache-hit", 15, interval=0.2, what="cache-aware routing to resume")


def test_sigkill_of_the_holding_backend_fails_over_without_client_error(fleet):
    proxy = fleet["proxies"][1]
    messages = new_conversation()
    turns = run_turns(proxy, messages, 2)
    holder = turns[-1][0]
    other = "a2" if holder == "a1" else "a1"
    # A stream in flight on the holder ends with an error event, not a hang. A fresh
    # prompt has no cache anywhere and goes to the less loaded backend: a stream that
    # lands on the other one stays open, adding to its load, until one lands on the holder.
    others, stream = [], None
    for _ in range(6):
        candidate = SSEStream(proxy.url + "/v1/completions",
                              {"model": MODEL_A, "prompt": f"{uuid.uuid4().hex} count 1 2 3",
                               "max_tokens": 6000},
                              headers={"Authorization": f"Bearer {KEY}"})
        events = candidate.events()
        next(events)
        if candidate.headers["x-kvroute-backend"] == holder:
            stream = candidate
            break
        others.append(candidate)
    for other_stream in others:
        other_stream.close()
    assert stream is not None, "no stream landed on the holder"
    fleet["backends"][holder].proc.kill()
    fleet["backends"][holder].proc.wait(5)
    rest = list(events)
    assert rest[-1] == "[DONE]" and "error" in rest[-2], rest[-3:]
    t0 = time.monotonic()
    r = chat(proxy, messages, MODEL_A, key=KEY)  # no client-visible error
    assert r.headers["x-kvroute-backend"] == other
    assert r.completion.choices[0].message.content == DEMO_REPLY
    assert time.monotonic() - t0 < 10
    # Restore the fleet for anything that runs after.
    restarted = BackendProcess(fleet["backends"][holder].model, MODEL_A,
                               fleet["backends"][holder].log_path.parent, backend_id=holder,
                               extra=fleet["backends"][holder].extra)
    restarted.start()
    fleet["backends"][holder] = restarted

"""Routing under load, end to end: real Redis, real backend processes with the demo
model, two proxy processes, the official `openai` client.

- new conversations started one after another spread over both backends, while
  their follow-up turns stay where their prefix is cached;
- a backend whose batch is full of decoding sequences loses new prefixes;
- a backend with another secret is reported (health, metrics, one log line), not
  silently missed.
"""

from __future__ import annotations

import json
import uuid

import pytest
import redis
from tokenizers import Tokenizer
from tests import harness
from tests.harness import BackendProcess, ProxyProcess, SSEStream, chat, request, wait_until

SECRET = "routing-secret"
TOKEN = "routing-token"
MODEL, ODD = "routing-model", "odd-model"


@pytest.fixture(scope="module")
def fleet(text_model, tmp_path_factory, redis_server):
    logs = tmp_path_factory.mktemp("routing")

    def backends(redis_url: str) -> list[BackendProcess]:
        common = ["--redis-url", redis_url, "--internal-token", TOKEN, "--max-batch", "2",
                  "--cache-bytes", "256MiB"]
        return [
            BackendProcess(text_model, MODEL, logs, backend_id="r1",
                           extra=common + ["--secret", SECRET]),
            BackendProcess(text_model, MODEL, logs, backend_id="r2",
                           extra=common + ["--secret", SECRET]),
            # Another secret: its keys can never match this deployment's.
            BackendProcess(text_model, ODD, logs, backend_id="odd",
                           extra=common + ["--secret", "some-other-secret"]),
        ]

    def proxies(redis_url: str) -> list[ProxyProcess]:
        return [ProxyProcess(redis_url, logs, ["--secret", SECRET, "--internal-token", TOKEN])
                for _ in range(2)]

    with harness.fleet(backends, proxies, redis_server.database()) as f:
        yield f


def system_prompt() -> str:
    return (f"{uuid.uuid4().hex}: you are the assistant of a small team of engineers; "
            "answer briefly and keep a log of every decision. ") * 8


def test_new_conversations_spread_and_follow_ups_stick(fleet):
    proxies = fleet["proxies"]
    conversations = []
    for i in range(6):  # one after another: each answered before the next starts
        messages = [{"role": "system", "content": system_prompt()},
                    {"role": "user", "content": "Hello there."}]
        r = chat(proxies[i % 2], messages, MODEL, max_tokens=8)
        messages.append({"role": "assistant", "content": r.completion.choices[0].message.content})
        conversations.append((r.headers["x-kvroute-backend"], messages))
    homes = [bid for bid, _ in conversations]
    assert min(homes.count("r1"), homes.count("r2")) >= 2, homes  # each at least a third

    prompt = cached = 0
    for i, (home, messages) in enumerate(conversations):
        for turn in range(2):
            messages.append({"role": "user", "content": f"And then ({turn})?"})
            r = chat(proxies[(i + turn + 1) % 2], messages, MODEL, max_tokens=8)
            assert r.headers["x-kvroute-backend"] == home, (i, turn, r.headers)
            assert r.headers["x-kvroute-route-reason"] == "cache-hit"
            prompt += r.completion.usage.prompt_tokens
            cached += r.completion.usage.prompt_tokens_details.cached_tokens
            messages.append({"role": "assistant", "content": r.completion.choices[0].message.content})
    assert cached >= 0.8 * prompt, (cached, prompt)

    # Backends publish their bytes per token: the proxy's predictions come out close
    # to what the backend reports cached.
    decisions = [d for p in proxies for d in json.loads(request(p.url + "/stats")[2])["decisions"]
                 if d["reason"] == "cache-hit" and d["cached_tokens"]]
    assert decisions
    for d in decisions:
        assert 0.7 <= d["predicted_tokens"] / d["cached_tokens"] <= 1.3, d


def test_a_batch_full_of_decodes_loses_new_prefixes(fleet, text_model):
    busy = fleet["backends"]["r1"]
    proxy = fleet["proxies"][0]
    # A strong bias on a printable token: the demo model never reaches EOS, and each
    # token streams out at once.
    token = Tokenizer.from_file(str(text_model / "tokenizer.json")).encode(" story").ids[0]
    # Fill r1's batch (--max-batch 2) with long decodes, sent to it directly, and queue
    # more behind them so that it stays full while the test routes.
    streams = [SSEStream(busy.url + "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 4000, "logit_bias": {str(token): 100},
        "messages": [{"role": "user", "content": f"Write a long story {i}."}]},
        headers={"x-kvroute-token": TOKEN}) for i in range(8)]
    try:
        for s in streams[:2]:
            assert s.status == 200
            next(s.events())
        wait_until(lambda: proxy.backend("r1")["decoding"] == 2, 10,
                   what="r1's heartbeat to report a full batch")
        homes = []
        for _ in range(3):
            messages = [{"role": "system", "content": system_prompt()},
                        {"role": "user", "content": "Hello there."}]
            homes.append(chat(proxy, messages, MODEL, max_tokens=8).headers["x-kvroute-backend"])
        # Still full while they were routed: otherwise this run proves nothing.
        assert busy.health()["engine"]["decoding"] == 2
        assert homes == ["r2"] * 3, homes
    finally:
        for s in streams:
            s.close()


def test_a_backend_with_another_secret_is_reported(fleet):
    proxy = fleet["proxies"][1]
    odd = proxy.backend("odd")
    assert odd["mismatch"] == "secret"
    assert proxy.backend("r1")["mismatch"] is None
    metrics = request(proxy.url + "/metrics")[2].decode()
    assert 'kvroute_proxy_backend_fingerprint_mismatch{backend="odd",field="secret"} 1.0' in metrics
    # It still serves (by load), it just never counts as holding a prefix.
    messages = [{"role": "system", "content": system_prompt()},
                {"role": "user", "content": "Hello there."}]
    for _ in range(2):
        r = chat(proxy, messages, model=ODD, max_tokens=8)
        assert r.headers["x-kvroute-backend"] == "odd"
        assert r.headers["x-kvroute-route-reason"] != "cache-hit"
        messages += [{"role": "assistant", "content": r.completion.choices[0].message.content},
                     {"role": "user", "content": "More."}]
    # Loud, once: one warning that names the backend and what differs.
    lines = [line for line in proxy.log().splitlines() if "odd" in line and "secret" in line]
    assert len(lines) == 1, lines


def test_a_prefill_cut_short_is_found_again_by_its_retry(fleet):
    """A client gone halfway through a long new message (an agent interrupted while it
    sends a file): the backend keeps what it prefilled, and now also advertises the
    messages it holds whole, so the retry goes back there and starts from it. A model
    that keeps no checkpoints mid-prompt (full attention, as here) used to advertise
    nothing for it, and the retry went wherever load sent it."""
    proxy = fleet["proxies"][0]
    head = [{"role": "system", "content": system_prompt()},
            {"role": "user", "content": "Read this file."},
            {"role": "assistant", "content": "Send it."}]
    long = {"role": "user", "content": uuid.uuid4().hex + " the quick brown fox jumps over "
            "the lazy dog, and a journey of a thousand miles begins with a step." * 250}
    stream = SSEStream(proxy.url + "/v1/chat/completions",
                       {"model": MODEL, "messages": [*head, long], "max_tokens": 8})

    def half() -> tuple[str, int] | None:
        for bid in ("r1", "r2"):
            for job in fleet["backends"][bid].health()["engine"]["jobs"]:
                if job["phase"] == "prefill" and job["processed"] >= job["prompt"] // 2:
                    return bid, job["processed"]
        return None

    try:
        holder, processed = wait_until(half, 60, interval=0.01, what="a half-done prefill")
    finally:
        stream.close()
    wait_until(lambda: not any(fleet["backends"][b].health()["engine"]["jobs"]
                               for b in ("r1", "r2")), 30, what="the dropped request to end")
    # Past the routing marks (3 s) both proxies set for the first request: only what
    # the backend advertises can send the retry back.
    marks = redis.Redis.from_url(fleet["redis"].url)
    wait_until(lambda: not list(marks.scan_iter(f"kvr:{{m:{MODEL}}}:p:*")), 30, interval=0.2,
               what="the routing marks to expire")
    r = chat(fleet["proxies"][1], [*head, long], MODEL, max_tokens=8)
    assert r.headers["x-kvroute-backend"] == holder
    assert r.completion.usage.prompt_tokens_details.cached_tokens >= processed

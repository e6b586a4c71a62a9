"""A conversation stays on its backend when the registry cannot say where its prefix
is: real Redis, two real backends with the demo model, real proxies, the official
`openai` client.

A lookup past its deadline (a busy host) or a hung Redis answers "unknown"; the proxy
then routes by load, except a turn of a conversation it routed before, which goes to
the backend it last sent that conversation to (proxy/policy/recent.py LiveRoutes) and is
served from that backend's cache.
"""

from __future__ import annotations

import uuid

import pytest

from tests import harness
from tests.harness import BackendProcess, ProxyProcess, chat, metric_sum, request

SECRET = "live-routes-secret"
TOKEN = "live-routes-token"
MODEL = "live-model"


@pytest.fixture(scope="module")
def fleet(text_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("live-routes")

    def backends(redis_url: str) -> list[BackendProcess]:
        common = ["--redis-url", redis_url, "--internal-token", TOKEN, "--secret", SECRET,
                  "--cache-bytes", "256MiB"]
        return [BackendProcess(text_model, MODEL, logs, backend_id=bid, extra=common)
                for bid in ("r1", "r2")]

    def proxies(redis_url: str) -> list[ProxyProcess]:
        common = ["--secret", SECRET, "--internal-token", TOKEN]
        # The first one's every lookup misses its deadline: "unknown", deterministically.
        return [ProxyProcess(redis_url, logs, common + ["--lookup-timeout-ms", "0"]),
                ProxyProcess(redis_url, logs, common)]

    with harness.fleet(backends, proxies) as f:
        yield f


def start_conversations(proxy: ProxyProcess, n: int) -> list[tuple[str, list[dict]]]:
    conversations = []
    for _ in range(n):  # one after another: each answered (and committed) before the next
        messages = [{"role": "system", "content": f"{uuid.uuid4().hex}: you keep the team's "
                     "log; answer briefly and note every decision. " * 8},
                    {"role": "user", "content": "Hello there."}]
        r = chat(proxy, messages, MODEL, max_tokens=8)
        messages.append({"role": "assistant", "content": r.completion.choices[0].message.content})
        conversations.append((r.headers["x-kvroute-backend"], messages))
    homes = [home for home, _ in conversations]
    # Both backends hold conversations: otherwise staying put proves nothing.
    assert {"r1", "r2"} <= set(homes), homes
    return conversations


def follow_ups_stay_home(proxy: ProxyProcess, conversations: list, turns: int = 2) -> None:
    routes, reasons, usages = [], [], []
    for home, messages in conversations:
        for turn in range(turns):
            messages.append({"role": "user", "content": f"And then ({turn})?"})
            r = chat(proxy, messages, MODEL, max_tokens=8)
            routes.append((home, r.headers["x-kvroute-backend"]))
            reasons.append(r.headers["x-kvroute-route-reason"])
            usage = r.completion.usage
            usages.append((usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens))
            messages.append({"role": "assistant", "content": r.completion.choices[0].message.content})
    assert [home for home, _ in routes] == [got for _, got in routes], routes
    assert set(reasons) == {"live-route"}, reasons
    assert all(cached >= 0.5 * prompt for prompt, cached in usages), usages
    assert sum(c for _, c in usages) >= 0.8 * sum(p for p, _ in usages), usages


def test_lookups_past_their_deadline_keep_conversations_on_their_backend(fleet):
    blind = fleet["proxies"][0]
    # Its first turns are routed by load too: spread over both backends in turn.
    conversations = start_conversations(blind, 6)
    follow_ups_stay_home(blind, conversations)
    metrics = request(blind.url + "/metrics")[2].decode()
    assert metric_sum(metrics, "kvroute_proxy_registry_unknown_total") >= 18


def test_a_hung_redis_keeps_conversations_on_their_backend(fleet):
    proxy, redis = fleet["proxies"][1], fleet["redis"]
    conversations = start_conversations(proxy, 6)  # routed by the registry's answers
    redis.pause()  # SIGSTOP: connections stay open, nothing answers
    try:
        follow_ups_stay_home(proxy, conversations)
    finally:
        redis.resume()
    harness.wait_until(lambda: len(proxy.health()["backends"]) == 2, 30,
                       what="the proxy to see both backends again")

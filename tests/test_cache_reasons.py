"""Every cache reason, caused once each and reported everywhere; two teams apart; a
team over its limits across two proxies.

A real fleet: redis-server, two backends of the demo model (one admits a single request
at a time, so a request it holds sends the next elsewhere), a backend of a copy of the
demo model with a 1 MiB cache whose chat template writes the number of messages into
the system turn (as templates that print the date drift every day), and a backend of a
tiny sliding-window model (gemma3), whose caches cannot be cut back; two proxies with
API keys for three teams and an operator, and usage limits. Requests go through the
official `openai` client (Anthropic's API over plain HTTP).

Each request's reason is checked in its `x-kvroute-cache-reason` header; then all of
them in /stats, the proxy's metrics (and the backends' for the reasons they decide),
the dashboard rendered in headless Chromium, and `kvroute stats` at 100 columns.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
import threading
import uuid
from html.parser import HTMLParser
from pathlib import Path

import openai
import pytest
import redis as redis_py
from tests.harness import (BackendProcess, ProxyProcess, SSEStream, chat, client, get_json, metric_sum,
                           post_json, request, start_all, wait_until)
from tests.test_dashboard import CHROMIUM, chromium_cmd, run_chromium

from kvroute.core import redis_keys as keys
from kvroute.core.misses import REASONS
from kvroute.devtools import arch_models
from kvroute.serve.redis_server import RedisServer

SECRET = "reasons-secret"
KEYS = {"team-a": "sk-team-a", "team-b": "sk-team-b", "limited": "sk-limited",
        "operator": "sk-ops"}
OPS = {"Authorization": "Bearer sk-ops"}
LIMITED_TOKENS = 400  # tokens a day of team "limited"


def drifting_copy(model: Path, where: Path) -> Path:
    """The demo model, its chat template writing the number of messages into the system
    turn: each turn renders the earlier ones differently from how they were cached."""
    out = where / "drifting-demo"
    shutil.copytree(model, out)
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    old = "render_content(messages[0].content) + '<|im_end|>"
    assert old in config["chat_template"]
    config["chat_template"] = config["chat_template"].replace(
        old, "(messages | length | string) + ' ' + " + old)
    path.write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def fleet(text_model, model_cache, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reasons")
    logs = tmp / "logs"
    logs.mkdir()
    redis = RedisServer().start()
    common = ["--redis-url", redis.url, "--secret", SECRET, "--no-warmup"]
    backends = {
        "kvroute-demo-1": BackendProcess(text_model, "demo", logs, backend_id="kvroute-demo-1",
                                         extra=common + ["--max-queue", "1"]),
        "kvroute-demo-2": BackendProcess(text_model, "demo", logs, backend_id="kvroute-demo-2",
                                         extra=common),
        "small-1": BackendProcess(drifting_copy(text_model, tmp), "small", logs,
                                  backend_id="small-1", extra=common + ["--cache-bytes", "1MiB"]),
        "hybrid-1": BackendProcess(arch_models.ensure("gemma3_text", cache_dir=model_cache),
                                   "hybrid", logs, backend_id="hybrid-1", extra=common),
    }
    keys_ = [f"--api-key={key}:{team}" for team, key in KEYS.items()]
    limits = ["--concurrent-requests", "limited=1", "--tokens-per-day",
              f"limited={LIMITED_TOKENS}", "--allowed-models", "limited=demo",
              "--limit-timeout-ms", "2000"]
    # A lookup deadline a busy test machine meets: a late lookup is caused on purpose below.
    proxies = [ProxyProcess(redis.url, logs, ["--secret", SECRET, "--lookup-timeout-ms", "500",
                                              *keys_, *limits]) for _ in range(2)]
    try:
        start_all(backends.values())
        starting = [threading.Thread(target=p.start, args=(len(backends),)) for p in proxies]
        for t in starting:
            t.start()
        for t in starting:
            t.join(60)
        for p in proxies:
            p.health()  # raises, with its log, for a proxy that did not start
        yield {"redis": redis, "backends": backends, "proxies": proxies, "tmp": tmp}
    finally:
        for p in proxies:
            p.stop()
        for b in backends.values():
            b.stop()
        redis.close()


class Run:
    """Requests through one proxy, each with the reason its header gives and the one
    operators see (they differ for other_scope only)."""

    def __init__(self, proxy: ProxyProcess):
        self.proxy = proxy
        self.reasons: collections.Counter = collections.Counter()
        self.teams: collections.Counter = collections.Counter()

    def client(self, team: str) -> openai.OpenAI:
        return client(self.proxy, KEYS[team], timeout=120)

    def ask(self, team: str, model: str, messages: list[dict], expect: str,
            told: str | None = None, stream: bool = False, max_tokens: int = 8) -> dict:
        """A chat request of `team`, whose answer must give `told` (else `expect`) as its
        cache reason; operators must count `expect`."""
        reply = chat(self.proxy, messages, model, key=KEYS[team], timeout=120,
                     max_tokens=max_tokens, stream=stream)
        assert reply.headers["x-kvroute-cache-reason"] == (told or expect), (
            expect, dict(reply.headers), model, team)
        self.count(team, expect)
        return {"text": reply.text, "headers": reply.headers}

    def count(self, team: str, reason: str) -> None:
        self.reasons[reason] += 1
        self.teams[team] += 1


def conversation(words: int = 40, user: str = "Hello there.") -> list[dict]:
    system = f"{uuid.uuid4().hex} You keep the team's release notes. " + "Be brief. " * words
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def price_list(items: int) -> list[dict]:
    """About 16 demo-model tokens an item (tests/test_oversize_commit.py)."""
    facts = " ".join(f"item{i} costs {i * 7 % 100} coins;" for i in range(items))
    return [{"role": "system", "content": f"{uuid.uuid4().hex[:8]} You keep the price list."},
            {"role": "user", "content": f"{facts} Which item costs the most?"}]


def reply(messages: list[dict], answer: dict, user: str) -> list[dict]:
    return messages + [{"role": "assistant", "content": answer["text"]},
                       {"role": "user", "content": user}]


def direct_turn(backend: BackendProcess, messages: list[dict], team: str) -> None:
    """A first turn sent to a backend itself: it holds and advertises the conversation,
    which no proxy has routed (so no proxy remembers where it went)."""
    status, body = post_json(backend.url + "/v1/chat/completions",
                             {"model": backend.model_id, "messages": messages, "max_tokens": 8},
                             headers={"x-kvroute-scope": team})
    assert status == 200, body


def held_stream(backend: BackendProcess) -> SSEStream:
    """A long decode holding the backend busy (the demo model counts on forever)."""
    s = SSEStream(backend.url + "/v1/completions",
                  {"model": backend.model_id, "prompt": "Count: 7", "max_tokens": 4000})
    assert s.status == 200
    next(s.events())
    return s


def test_every_reason_is_reported_everywhere(fleet):
    proxy, other_proxy = fleet["proxies"]
    b1, b2 = fleet["backends"]["kvroute-demo-1"], fleet["backends"]["kvroute-demo-2"]
    run = Run(proxy)

    # new_prefix, then hit (streamed).
    a = conversation()
    answer = run.ask("team-a", "demo", a, "new_prefix")
    run.ask("team-a", "demo", reply(a, answer, "Go on."), "hit", stream=True)

    # template_drift: the keys of turn 1 match turn 2's, its tokens do not (token 3 or so).
    e = conversation()
    answer = run.ask("team-a", "small", e, "new_prefix")
    drift = run.ask("team-a", "small", reply(e, answer, "And then?"), "template_drift")
    assert 0 < int(drift["headers"]["x-kvroute-diverged-at"]) < 8, dict(drift["headers"])

    # other_scope: team-b sends what team-a has cached; team-b is told new_prefix.
    f = conversation(60)
    run.ask("team-a", "small", f, "new_prefix")
    run.ask("team-b", "small", f, "other_scope", told="new_prefix")

    # evicted_ram: two ~600-token prompts in a 1 MiB (1,024-token) cache.
    g, g2 = price_list(36), price_list(36)
    first = run.ask("team-a", "small", g, "new_prefix")
    assert 500 < int(first["headers"]["x-kvroute-prompt-tokens"]) < 1000
    run.ask("team-a", "small", g2, "new_prefix")
    run.ask("team-a", "small", g, "evicted_ram")

    # too_large: a ~1,900-token prompt; RAM keeps its first 1,024 tokens.
    h = price_list(120)
    run.ask("team-a", "small", h, "new_prefix")
    again = run.ask("team-a", "small", h, "too_large")
    assert 900 < int(again["headers"]["x-kvroute-cached-tokens"]) <= 1024

    # no_checkpoint: the same conversation with its last message edited; a sliding
    # window cannot be cut back to where they part, and no checkpoint is there.
    i = conversation(30, user="Which ticket blocks the Thursday release, and who owns it? " * 4)
    run.ask("team-a", "hybrid", i, "new_prefix", max_tokens=4)
    edited = i[:1] + [{"role": "user", "content": i[1]["content"] + " Answer in one line."}]
    run.ask("team-a", "hybrid", edited, "no_checkpoint", max_tokens=4)

    # routed_for_load and lookup_late: two conversations held by kvroute-demo-1, which
    # is kept busy (it admits one request at a time) while their next turns come.
    c1, c2 = conversation(), conversation()
    direct_turn(b1, c1, "team-a")
    direct_turn(b1, c2, "team-a")
    busy = held_stream(b1)
    try:
        wait_until(lambda: proxy.backend(b1.backend_id)["queue_depth"] >= 1, 10,
                   what="the proxy to see kvroute-demo-1 busy")
        routed = run.ask("team-a", "demo", c1 + [{"role": "assistant", "content": "Hi."},
                                                   {"role": "user", "content": "More."}],
                          "routed_for_load")
        assert routed["headers"]["x-kvroute-backend"] == b2.backend_id
        fleet["redis"].pause()  # the lookup misses its deadline; its request goes by load
        try:
            run.ask("team-a", "demo", c2 + [{"role": "assistant", "content": "Hi."},
                                             {"role": "user", "content": "More."}], "lookup_late")
        finally:
            fleet["redis"].resume()
    finally:
        busy.close()

    # All three APIs carry the header, whole and streamed: team-b's own traffic.
    resp = run.client("team-b").responses.with_raw_response.create(
        model="demo", instructions=conversation()[0]["content"], input="Hello.",
        max_output_tokens=16)
    assert resp.headers["x-kvroute-cache-reason"] == "new_prefix"
    run.count("team-b", "new_prefix")
    stream = SSEStream(proxy.url + "/v1/messages", {
        "model": "demo", "max_tokens": 8, "system": conversation()[0]["content"],
        "messages": [{"role": "user", "content": "Hello."}]}, headers={"x-api-key": KEYS["team-b"]})
    assert stream.status == 200 and stream.headers["x-kvroute-cache-reason"] == "new_prefix"
    list(stream.events())
    stream.close()
    run.count("team-b", "new_prefix")

    check_limits(fleet, run)

    # backend_restarted: the backend of a conversation restarts between two turns.
    d = conversation()
    answer = run.ask("team-a", "demo", d, "new_prefix")
    home = fleet["backends"][answer["headers"]["x-kvroute-backend"]]
    before = home.health()["instance_id"]
    home.stop()
    home.start()
    assert home.health()["instance_id"] != before
    run.ask("team-a", "demo", reply(d, answer, "Still there?"), "backend_restarted")

    check_reported(fleet, run)


def check_limits(fleet: dict, run: Run) -> None:
    """One request in flight for team "limited", 400 tokens a day, the demo model only:
    over each, a 429 with Retry-After (a 403 for another model) from either proxy,
    while team-b goes on."""
    proxies = fleet["proxies"]
    limited = {"Authorization": f"Bearer {KEYS['limited']}"}
    body = {"model": "demo", "messages": conversation()[:2], "max_tokens": 8}
    held = SSEStream(proxies[0].url + "/v1/completions",
                     {"model": "demo", "prompt": "Count: 7", "max_tokens": 4000}, headers=limited)
    assert held.status == 200
    run.count("limited", held.headers["x-kvroute-cache-reason"])
    next(held.events())
    try:
        for p in proxies:
            status, headers, data = request(p.url + "/v1/chat/completions", "POST", body,
                                            headers=limited)
            assert status == 429 and int(headers["Retry-After"]) >= 1, (status, data)
            assert json.loads(data)["error"]["code"] == "concurrent_requests"
        # Anthropic's envelope under /v1/messages.
        status, headers, data = request(proxies[1].url + "/v1/messages", "POST", {
            "model": "demo", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]},
            headers={"x-api-key": KEYS["limited"]})
        error = json.loads(data)
        assert status == 429 and "Retry-After" in headers, (status, data)
        assert error["type"] == "error" and error["error"]["type"] == "rate_limit_error"
        # The other team is unaffected, on both proxies.
        for p in proxies:
            b = openai.OpenAI(base_url=p.url + "/v1", api_key=KEYS["team-b"], max_retries=0)
            raw = b.chat.completions.with_raw_response.create(
                model="demo", messages=conversation()[:2], max_tokens=8)
            assert raw.http_response.status_code == 200
            if p is run.proxy:
                run.count("team-b", raw.headers["x-kvroute-cache-reason"])
    finally:
        held.close()
    client = redis_py.Redis.from_url(fleet["redis"].url)
    open_key = keys.limit_tag("scope:limited") + keys.LIMIT_OPEN
    wait_until(lambda: client.zcard(open_key) == 0, 10, what="the held request's release")
    # A model it may not use.
    status, _, data = request(proxies[1].url + "/v1/chat/completions", "POST",
                              {**body, "model": "small"}, headers=limited)
    assert status == 403 and json.loads(data)["error"]["code"] == "model_not_allowed"
    # Its tokens: one ~500-token request takes the team past its day.
    status, _, data = request(proxies[1].url + "/v1/chat/completions", "POST",
                              {**body, "messages": price_list(30)}, headers=limited)
    assert status == 200, data
    day = int(client.time()[0]) // 86400
    used = keys.limit_tag("scope:limited") + f"tpd:{day}"
    wait_until(lambda: int(client.get(used) or 0) >= LIMITED_TOKENS, 10,
               what="the request's tokens charged")
    client.close()
    for p in proxies:
        status, headers, data = request(p.url + "/v1/chat/completions", "POST", body,
                                        headers=limited)
        assert status == 429 and json.loads(data)["error"]["code"] == "tokens_per_day", data
        assert int(headers["Retry-After"]) >= 1
    limited_total = sum(metric_sum(request(p.url + "/metrics")[2].decode(),
                                   "kvroute_proxy_limited_requests_total", team="limited")
                        for p in proxies)
    assert limited_total == 6, limited_total  # 2 + 1 in flight, 1 model, 2 tokens


def check_reported(fleet: dict, run: Run) -> None:
    proxy = run.proxy
    stats = get_json(proxy.url + "/stats", headers=OPS)
    told = {r: m["requests"] for r, m in stats["reasons"].items() if m["requests"]}
    assert told == dict(run.reasons), (told, run.reasons)
    assert set(run.reasons) == set(REASONS) - {"evicted_disk", "backend_gone", "registry_down"}
    decided = collections.Counter(d["cache_reason"] for d in stats["decisions"])
    assert decided == run.reasons, decided
    assert stats["drift"]["small"]["position"] is not None
    # Two teams apart: each team's requests, and generated tokens (streams included).
    teams = stats["teams"]
    for team in ("team-a", "team-b", "limited"):
        assert teams[team]["requests"] == run.teams[team], (team, teams[team], run.teams)
    for team in ("team-a", "team-b"):  # "limited"'s one answer here was cut off by its client
        assert teams[team]["generated_tokens"] > 0 and teams[team]["prompt_tokens"] > 0
    assert teams["team-a"]["seconds_lost"] > 0 and teams["team-a"]["cached_tokens"] > 0
    assert set(teams["team-a"]["models"]) == {"demo", "small", "hybrid"}
    assert teams["limited"]["limited"] == {"concurrent_requests": 1, "tokens_per_day": 1}

    metrics = request(proxy.url + "/metrics")[2].decode()
    # Every non-2xx by class, as the API counters have them: the two 429s of the limits
    # here, and 499s of streams whose clients left (when the handler was cancelled first).
    for cls in ("4xx", "5xx"):
        counted = sum(metric_sum(metrics, "kvroute_proxy_api_requests_total", status=str(code))
                      for code in range(int(cls[0]) * 100, int(cls[0]) * 100 + 100))
        assert stats["statuses"][cls] == counted, (cls, stats["statuses"])
    assert metric_sum(metrics, "kvroute_proxy_api_requests_total", status="429") == 2
    for reason in REASONS:
        assert metric_sum(metrics, "kvroute_proxy_cache_reasons_total", reason=reason) == \
            run.reasons[reason], reason
    for team, n in run.teams.items():
        assert metric_sum(metrics, "kvroute_proxy_team_requests_total", team=team) == n, team
    assert metric_sum(metrics, "kvroute_proxy_prefill_seconds_lost_total",
                      reason="evicted_ram") > 0
    backends = fleet["backends"]
    small = request(backends["small-1"].url + "/metrics")[2].decode()
    for reason in ("evicted_ram", "too_large", "other_scope"):
        assert metric_sum(small, "kvroute_backend_cache_reasons_total", reason=reason) == 1, reason
    hybrid = request(backends["hybrid-1"].url + "/metrics")[2].decode()
    assert metric_sum(hybrid, "kvroute_backend_cache_reasons_total", reason="no_checkpoint") == 1

    check_stats_command(proxy, run)
    if CHROMIUM is not None:
        check_dashboard(fleet, proxy, stats)


def check_stats_command(proxy: ProxyProcess, run: Run) -> None:
    out = subprocess.run([sys.executable, "-m", "kvroute.cli", "stats", "--url", proxy.url],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "COLUMNS": "100", "KVROUTE_API_KEY": KEYS["operator"]})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(map(len, lines)) <= 100, out.stdout
    for name in ("kvroute-demo-1", "kvroute-demo-2", "small-1", "hybrid-1"):
        assert name in out.stdout, out.stdout  # whole, not "kvroute-de…"
    for reason in run.reasons:
        assert reason in out.stdout, reason
    assert "template drift on small" in out.stdout


class _Rows(HTMLParser):
    """data-* attributes of the dashboard's table rows, by table id."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, list[dict]] = collections.defaultdict(list)
        self.table: str | None = None
        self.errors: dict = {}

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table":
            self.table = attrs.get("id")
        elif tag == "tr" and self.table and any(k.startswith("data-") for k in attrs):
            self.rows[self.table].append(attrs)
        elif attrs.get("id") == "errors":
            self.errors = attrs


def check_dashboard(fleet: dict, proxy: ProxyProcess, stats: dict) -> None:
    page = f"{proxy.url}/dashboard?key={KEYS['operator']}"
    dom = run_chromium(chromium_cmd(CHROMIUM, fleet["tmp"] / "profile", "--virtual-time-budget=6000",
                                    "--dump-dom", page))
    assert dom.returncode == 0, dom.stderr.decode(errors="replace")[-3000:]
    rows = _Rows()
    rows.feed(dom.stdout.decode(errors="replace"))
    shown = {r["data-reason"]: int(r["data-requests"]) for r in rows.rows["reasons"]}
    assert shown == {r: m["requests"] for r, m in stats["reasons"].items() if m["requests"]}
    teams = collections.Counter()
    for r in rows.rows["teams"]:
        teams[r["data-team"]] += int(r["data-requests"])
    assert {t: n for t, n in teams.items() if n} == \
        {t: s["requests"] for t, s in stats["teams"].items() if s["requests"]}
    decided = collections.Counter(r["data-cache-reason"] for r in rows.rows["decisions"])
    assert decided == collections.Counter(d["cache_reason"] for d in stats["decisions"])
    non_2xx = sum(n for k, n in stats["statuses"].items() if k != "2xx")
    assert rows.errors.get("data-value") == str(non_2xx), rows.errors
    if os.environ.get("KVROUTE_SAVE_SCREENSHOT"):
        shot = Path(__file__).parent / "output" / "dashboard-reasons.png"
        shot.parent.mkdir(exist_ok=True)
        run_chromium(chromium_cmd(CHROMIUM, fleet["tmp"] / "profile-shot",
                                  "--virtual-time-budget=6000", "--window-size=1400,2200",
                                  f"--screenshot={shot}", page))

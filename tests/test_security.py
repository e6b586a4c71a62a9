"""Security properties as tests: who may talk to whom, what leaks where."""

from __future__ import annotations

import hmac
import json
import subprocess
import sys
import uuid
from unittest import mock

import openai
import pytest
from tests.harness import BackendProcess, free_port, request, wait_until

from kvroute.proxy.auth import check_api_key

TOKEN = "backend-only-token"
KEYS = ["sk-alpha:team-a", "sk-beta:team-b", "sk-ops"]
PHRASE = "purple-elephant-" + uuid.uuid4().hex[:8]


@pytest.fixture(scope="module")
def system(text_model, tmp_path_factory, redis_server):
    logs = tmp_path_factory.mktemp("security")
    redis = redis_server.database()
    backend = BackendProcess(text_model, "demo", logs, backend_id="sec-1",
                             extra=["--redis-url", redis.url, "--secret", "sec",
                                    "--internal-token", TOKEN])
    backend.start()
    port = free_port()
    proxy_log = logs / "proxy.log"
    args = [sys.executable, "-m", "kvroute.cli", "proxy", "--redis-url", redis.url, "--secret", "sec",
            "--internal-token", TOKEN, "--port", str(port)]
    for key in KEYS:
        args += ["--api-key", key]
    proxy = subprocess.Popen(args, stdout=open(proxy_log, "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: len(json.loads(request(url + "/health")[2])["backends"]) == 1, 30)
    yield {"proxy": url, "backend": backend, "redis": redis, "logs": [backend.log_path, proxy_log]}
    proxy.terminate()
    proxy.wait(10)
    backend.stop()


def client(system, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=system["proxy"] + "/v1", api_key=key, max_retries=0)


def test_backend_refuses_requests_without_the_internal_token(system):
    backend = system["backend"]
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for headers in ({}, {"x-kvroute-token": "wrong"}, {"x-kvroute-token": TOKEN + "x"}):
        status, _, data = request(backend.url + "/v1/chat/completions", "POST", body, headers=headers)
        assert status == 401, headers
        assert json.loads(data)["error"]["code"] == "invalid_internal_token"
    assert request(backend.url + "/debug/cache")[0] == 401
    status, _, _ = request(backend.url + "/v1/chat/completions", "POST", body,
                           headers={"x-kvroute-token": TOKEN})
    assert status == 200


def test_api_keys_missing_wrong_and_right(system):
    messages = [{"role": "user", "content": "hi"}]
    status, _, data = request(system["proxy"] + "/v1/chat/completions", "POST",
                              {"model": "demo", "messages": messages})
    assert status == 401 and json.loads(data)["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        client(system, "sk-alph").chat.completions.create(model="demo", messages=messages)
    r = client(system, "sk-ops").chat.completions.create(model="demo", messages=messages, max_tokens=2)
    assert r.choices[0].finish_reason == "length"


def test_api_keys_are_compared_in_constant_time():
    """Every configured key is compared with hmac.compare_digest, whichever matches:
    the time taken does not reveal which key (or how much of one) matched."""
    keys = {k.partition(":")[0]: k.partition(":")[2] or None for k in KEYS}
    for given in ("Bearer sk-alpha", "Bearer sk-ops", "Bearer nope", "", "Basic sk-ops"):
        with mock.patch("kvroute.proxy.auth.hmac.compare_digest", wraps=hmac.compare_digest) as cmp:
            check_api_key(keys, given)
        assert cmp.call_count == len(keys), given
    assert check_api_key(keys, "Bearer sk-beta") == (True, "team-b")
    assert check_api_key(keys, "Bearer sk-ops") == (True, None)
    assert check_api_key(keys, "bearer sk-alpha ") == (True, "team-a")
    assert check_api_key(keys, "Bearer sk-alpha2") == (False, None)


def test_scopes_never_share_a_cache(system):
    messages = [{"role": "system", "content": f"{uuid.uuid4().hex} shared instructions " * 8},
                {"role": "user", "content": "hello"}]
    a = client(system, "sk-alpha")
    a.chat.completions.create(model="demo", messages=messages, max_tokens=2)
    again = a.chat.completions.create(model="demo", messages=messages, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 1
    # The same prompt from another tenant: no hit beyond the template's opening tokens.
    other = client(system, "sk-beta").chat.completions.create(model="demo", messages=messages,
                                                               max_tokens=2)
    assert other.usage.prompt_tokens_details.cached_tokens < 8
    unscoped = client(system, "sk-ops").chat.completions.create(model="demo", messages=messages,
                                                                 max_tokens=2)
    assert unscoped.usage.prompt_tokens_details.cached_tokens < 8


def test_no_prompt_text_in_redis_or_default_logs(system):
    messages = [{"role": "system", "content": f"Remember the {PHRASE}."},
                {"role": "user", "content": f"What is the {PHRASE}?"}]
    c = client(system, "sk-ops")
    c.chat.completions.create(model="demo", messages=messages)
    c.completions.create(model="demo", prompt=f"{PHRASE} 1 2 3", max_tokens=3)
    # Failing requests too: their error messages must not echo prompt text into logs.
    for bad in ({"model": "demo", "messages": [{"role": PHRASE, "content": PHRASE}]},
                {"model": PHRASE, "messages": messages},
                {"model": "demo", "messages": messages, "max_tokens": 10 ** 9}):
        request(system["proxy"] + "/v1/chat/completions", "POST", bad,
                headers={"Authorization": "Bearer sk-ops"})
    import redis as redis_py

    r = redis_py.Redis.from_url(system["redis"].url)
    for key in r.scan_iter("*"):
        kind = r.type(key)
        values = {b"string": lambda: [r.get(key)], b"set": lambda: r.smembers(key),
                  b"zset": lambda: r.zrange(key, 0, -1)}.get(kind, lambda: [])()
        assert PHRASE.encode() not in key and all(PHRASE.encode() not in (v or b"") for v in values)
    r.close()
    for path in system["logs"]:
        assert PHRASE not in path.read_text(errors="replace"), path


def test_header_and_body_limits_hold(system):
    huge_header = {"X-Filler": "a" * 70_000, "Authorization": "Bearer sk-ops"}
    status, _, _ = request(system["proxy"] + "/v1/models", headers=huge_header)
    assert 400 <= status < 500
    body = {"model": "demo", "messages": [{"role": "user", "content": "x" * (9 << 20)}]}
    status, _, data = request(system["proxy"] + "/v1/chat/completions", "POST", body,
                              headers={"Authorization": "Bearer sk-ops"})
    assert status == 413 and json.loads(data)["error"]["code"] == "request_too_large"
    assert json.loads(request(system["proxy"] + "/health")[2])["status"] == "ok"

"""/v1/chat/completions at the edges of what OpenAI accepts, on the backend and through
the proxy: what a replayed OpenAI conversation carries is accepted, what OpenAI refuses
is a 400 naming the parameter with a code, and no refusal leaks pydantic's labels."""

from __future__ import annotations

import json
import time
import uuid

import pytest
from tests import harness
from tests.harness import BackendProcess, ProxyProcess, get_json, post_json, request

from kvroute.devtools.demo_model import DEMO_REPLY

MODEL = "edges"


@pytest.fixture(scope="module")
def fleet(text_model, redis_server, tmp_path_factory):
    logs = tmp_path_factory.mktemp("chat-edges")

    def backends(redis_url: str) -> list[BackendProcess]:
        return [BackendProcess(text_model, MODEL, logs, backend_id="edges-1",
                               extra=["--redis-url", redis_url])]

    def proxies(redis_url: str) -> list[ProxyProcess]:
        return [ProxyProcess(redis_url, logs)]

    with harness.fleet(backends, proxies, redis=redis_server.database()) as f:
        yield f


@pytest.fixture(params=["backend", "proxy"])
def url(request, fleet) -> str:
    """Each test runs against the backend directly and through the proxy."""
    if request.param == "backend":
        return fleet["backends"]["edges-1"].url
    return fleet["proxies"][0].url


def chat(url: str, messages: list[dict] | None = None, **fields) -> tuple[int, dict]:
    messages = messages or [{"role": "user", "content": f"{uuid.uuid4().hex[:8]}: hello."}]
    return post_json(url + "/v1/chat/completions",
                     {"model": MODEL, "messages": messages, "max_tokens": 4, **fields})


def refused(status: int, body: dict) -> dict:
    assert status == 400, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


# -- sampling ---------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1e-39, 1e-100, 5e-324])
def test_a_temperature_too_small_to_sample_with_is_greedy(url, temperature):
    # 1/T overflowed to inf and the logits became NaN: the answer was random tokens.
    messages = [{"role": "user", "content": "Say hello to the team."}]
    status, greedy = chat(url, messages, temperature=0, max_tokens=40)
    assert status == 200 and greedy["choices"][0]["message"]["content"] == DEMO_REPLY, greedy
    status, tiny = chat(url, messages, temperature=temperature, max_tokens=40)
    assert status == 200, tiny
    assert tiny["choices"][0]["message"]["content"] == DEMO_REPLY, tiny


# -- accepted: what OpenAI's own answers put in a conversation ------------------------------


def refusal_turn(refusal: str) -> list[dict]:
    return [{"role": "user", "content": "Write something bad."},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": refusal}]},
            {"role": "user", "content": "Then say hello."}]


def test_assistant_refusal_parts_are_accepted_and_rendered(url):
    status, short = chat(url, refusal_turn("No."))
    assert status == 200, short
    status, long = chat(url, refusal_turn("No. " * 20))
    assert status == 200, long
    # The template got the refusal's text: 19 more "No." make a longer prompt.
    assert long["usage"]["prompt_tokens"] > short["usage"]["prompt_tokens"] + 19


def test_refusal_parts_outside_assistant_messages_are_refused(url):
    err = refused(*chat(url, [{"role": "user", "content": [
        {"type": "text", "text": "Hi"}, {"type": "refusal", "refusal": "No."}]}]))
    assert (err["param"], err["code"]) == ("messages[0].content[1].type", "invalid_value"), err
    assert "assistant" in err["message"], err


# -- refused, naming the parameter with a code ------------------------------------------

MALFORMED = [  # (fields replacing the body's, param, code)
    ({"messages": None}, "messages", "missing_required_parameter"),
    ({"messages": "hi"}, "messages", "invalid_type"),
    ({"messages": ["hi"]}, "messages[0]", "invalid_type"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role", "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_type"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content[0].text", "missing_required_parameter"),
    ({"tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}},
      "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tool_choice", "unsupported_parameter"),
    # What OpenAI refuses too.
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]},
     "messages[1].tool_calls[0].function.arguments", "invalid_type"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]},
     "tools[0].function.name", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f" * 129}}]},
     "tools[0].function.name", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f"}},
                {"type": "function", "function": {"name": "g"}},
                {"type": "function", "function": {"name": "f"}}]},
     "tools[2].function.name", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters", "invalid_value"),
    ({"metadata": "x"}, "metadata", "invalid_value"),
    ({"metadata": {"k": 1}}, "metadata", "invalid_value"),
    ({"metadata": {"k" * 65: "v"}}, "metadata", "invalid_value"),
    ({"metadata": {"k": "v" * 513}}, "metadata", "invalid_value"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "invalid_value"),
]


@pytest.mark.parametrize("fields,param,code", MALFORMED, ids=[f"{c[1]}-{i}" for i, c in
                                                             enumerate(MALFORMED)])
def test_refusals_name_the_parameter_and_a_code(url, fields, param, code):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            **fields}
    if fields.get("messages", "") is None:
        del body["messages"]
    err = refused(*post_json(url + "/v1/chat/completions", body))
    assert (err["param"], err["code"]) == (param, code), err


def test_a_seed_past_64_bits_is_out_of_range(url):
    raw = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                      "seed": 2**64}).encode()
    status, _, data = request(url + "/v1/chat/completions", "POST", raw=raw)
    err = refused(status, json.loads(data))
    assert (err["param"], err["code"]) == ("seed", "invalid_value"), err
    assert "out of range" in err["message"] and "float" not in err["message"], err


def test_what_openai_accepts_still_passes(url):
    tools = [{"type": "function", "function": {"name": "get_weather-2", "parameters": {
        "properties": {"city": {"type": "string"}}}}}]
    status, body = chat(url, tools=tools, metadata={f"k{i}": "v" * 512 for i in range(16)},
                        some_extension={"a": 1})  # unknown fields: clients send extensions
    assert status == 200, body


# -- /v1/models ------------------------------------------------------------------------


def test_models_carry_when_the_backend_loaded_the_model(fleet):
    backend, proxy = fleet["backends"]["edges-1"], fleet["proxies"][0]
    [served] = get_json(backend.url + "/v1/models")["data"]
    assert 1_600_000_000 < served["created"] <= time.time(), served
    listed = {m["id"]: m for m in get_json(proxy.url + "/v1/models")["data"]}
    assert listed[MODEL]["created"] == served["created"], listed
    assert get_json(proxy.url + f"/v1/models/{MODEL}")["created"] == served["created"]

"""Bad input gets the OpenAI error envelope with the right 4xx; the process keeps serving."""

from __future__ import annotations

import json

import pytest
from tests.harness import post_json, request

from tests.test_exit_paths import conversation


def envelope(status, data) -> dict:
    body = json.loads(data)
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    return body["error"]


def chat_body(backend, **kw):
    return {"model": backend.model_id, "messages": conversation(), **kw}


CASES = [
    ("not json", b"{nope", 400, None),
    ("array", b"[1, 2]", 400, None),
    ("empty", b"", 400, None),
]


@pytest.mark.parametrize("name,raw,status,param", CASES, ids=[c[0] for c in CASES])
def test_malformed_bodies(backend, name, raw, status, param):
    got, _, data = request(backend.url + "/v1/chat/completions", "POST", raw=raw)
    assert got == status
    assert envelope(got, data)["type"] == "invalid_request_error"


FIELD_CASES = [
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].image_url"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 10**9}, "max_tokens"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"temperature": 9}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": 3}, "stop"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
     "response_format.json_schema.name"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"best_of": 2}, "best_of"),
    ({"top_k": -1}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_context_size": 0}, "repetition_context_size"),
    ({"model": None}, "model"),
]


@pytest.mark.parametrize("fields,param", FIELD_CASES, ids=[c[1] + str(i) for i, c in enumerate(FIELD_CASES)])
def test_invalid_fields_name_the_parameter(backend, fields, param):
    status, body = post_json(backend.url + "/v1/chat/completions", chat_body(backend, **fields))
    assert status == 400, body
    assert body["error"]["param"] == param, body


def test_unknown_model_404(backend):
    status, body = post_json(backend.url + "/v1/chat/completions", {**chat_body(backend), "model": "x"})
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_prompt_longer_than_limit(backend):
    long = " ".join(["word"] * 7000)
    status, body = post_json(backend.url + "/v1/completions",
                             {"model": backend.model_id, "prompt": long})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert body["error"]["param"] == "prompt"


def test_oversized_body_413(backend):
    raw = json.dumps(chat_body(backend, padding="x" * (2 << 20))).encode()
    status, _, data = request(backend.url + "/v1/chat/completions", "POST", raw=raw)
    assert status == 413
    assert envelope(status, data)["code"] == "request_too_large"


def test_unknown_route_and_method(backend):
    status, _, data = request(backend.url + "/v1/nothing")
    assert status == 404 and envelope(status, data)
    status, _, data = request(backend.url + "/v1/chat/completions")
    assert status == 405 and envelope(status, data)


def test_still_serving_after_bad_input(backend):
    status, body = post_json(backend.url + "/v1/chat/completions", chat_body(backend, max_tokens=2))
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    assert backend.alive()

"""Fuzzing the agent APIs (/v1/responses, /v1/messages, /v1/messages/count_tokens).

The same harness as test_fuzz.py (its `servers` fixture: a real redis-server, ONE
backend with the tiny demo model, ONE proxy, real HTTP) and the same promise:
whatever a client sends, the answer is a valid answer (200) or that API's own error
envelope with a 4xx status: OpenAI's `{"error": {...}}` on /v1/responses, Anthropic's
`{"type": "error", "error": {"type", "message"}}` under /v1/messages. Never a 5xx, a
hang or a dead process (the autouse check after each test). A 200 stream must end with
its API's last event and carry no error event (a 5xx in disguise).

- property-based: type-correct bodies at the edges of every field (these must get a
  200: the translation may not refuse what the API allows, nor the backend what the
  translation builds), and bodies with up to three fields replaced by wrong types,
  odd Unicode, enormous numbers, unknown item and block types;
- raw bodies (random bytes, truncated JSON, deep nesting);
- HTTP-level: oversized bodies and wrong methods still get the API's envelope.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.test_fuzz import (  # noqa: F401  (servers and alive_after_each_test are fixtures)
    CONTEXT, DELETE, FUZZ, MAX_BODY, MODEL, _padded, alive_after_each_test, any_json,
    anthropic_envelope, big_ints, bodies, dumps, envelope, json_values, maybe, name_text,
    numbers, odd_text, post, raw_bodies, servers, text, token_counts, valid_bodies)

RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"


def check(path: str, status: int, headers: dict, data: bytes, what: str = "") -> None:
    assert status == 200 or 400 <= status < 500, (what, status, data[:500])
    if status != 200:
        (envelope if path == RESPONSES else anthropic_envelope)(data)
        return
    if not headers.get("content-type", "").startswith("text/event-stream"):
        body = json.loads(data)
        if path == RESPONSES:
            assert body["object"] == "response" and body["status"] in ("completed", "incomplete")
            assert isinstance(body["usage"]["input_tokens_details"]["cached_tokens"], int)
        elif path == MESSAGES:
            assert body["type"] == "message" and body["stop_reason"], body
            assert isinstance(body["usage"]["cache_read_input_tokens"], int), body
        else:
            assert isinstance(body["input_tokens"], int), body
        return
    events = [(block.split(b"\n")[0], json.loads(block.split(b"\ndata: ", 1)[1]))
              for block in data.split(b"\n\n") if block.startswith(b"event: ")]
    names = [name[7:].decode() for name, _ in events]
    assert names, (what, data[-500:])
    assert "error" not in names and "response.failed" not in names, (what, data[-800:])
    assert all(d["type"] == n for n, (_, d) in zip(names, events)), (what, names)
    if path == RESPONSES:
        assert names[0] == "response.created", names
        assert names[-1] in ("response.completed", "response.incomplete"), names
        assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    else:
        assert names[0] == "message_start" and names[-1] == "message_stop", names


def send(servers, path: str, raw: bytes) -> int:
    status, headers, data = post(servers.proxy_url, path, raw)
    check(path, status, headers, data, f"{path} {raw[:300]!r}")
    assert servers.backend.alive() and servers.proxy.poll() is None, servers.describe()
    return status


# -- strategies: the Responses API ---------------------------------------------------------

text_parts = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text"]),
                                             "text": odd_text}), max_size=2)
response_item = maybe(st.one_of(
    st.fixed_dictionaries({"role": maybe(st.sampled_from(["user", "assistant", "system",
                                                         "developer", "tool", ""]))},
                          optional={"type": maybe(st.just("message")),
                                    "content": st.one_of(odd_text, text_parts, any_json)}),
    st.fixed_dictionaries({"type": st.just("function_call")},
                          optional={"call_id": maybe(odd_text), "name": maybe(odd_text),
                                    "arguments": st.one_of(st.just("{}"), odd_text, any_json)}),
    st.fixed_dictionaries({"type": st.just("function_call_output")},
                          optional={"call_id": maybe(odd_text),
                                    "output": st.one_of(odd_text, text_parts, any_json)}),
    st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "item_reference", "web_search_call",
                                                    "input_image", ""])}),
))
response_tool = maybe(st.fixed_dictionaries(
    {"type": st.one_of(st.just("function"), st.sampled_from(["web_search", "custom"]), any_json)},
    optional={"name": maybe(odd_text), "description": maybe(odd_text),
              "parameters": st.one_of(st.just({"type": "object"}), any_json),
              "strict": any_json}))
RESPONSES_FIELDS = {
    "model": st.one_of(st.just(MODEL), odd_text, any_json, st.just(DELETE)),
    "input": st.one_of(odd_text, st.lists(response_item, max_size=4), any_json, st.just(DELETE)),
    "instructions": maybe(odd_text),
    "tools": st.one_of(st.lists(response_tool, max_size=2), any_json),
    "tool_choice": maybe(st.sampled_from(["auto", "none", "required",
                                          {"type": "function", "name": "f"}])),
    "max_output_tokens": token_counts,
    "temperature": numbers,
    "top_p": numbers,
    "stream": maybe(st.booleans()),
    "store": maybe(st.booleans()),
    "previous_response_id": maybe(st.one_of(odd_text, st.just("resp_" + "a" * 32))),
    "parallel_tool_calls": any_json,
    "text": maybe(st.fixed_dictionaries({"format": maybe(st.fixed_dictionaries(
        {"type": maybe(st.sampled_from(["text", "json_schema"]))}))})),
    "truncation": maybe(st.sampled_from(["auto", "disabled", "middle"])),
    "include": maybe(st.lists(odd_text, max_size=2)),
    "reasoning": maybe(st.fixed_dictionaries({"effort": maybe(odd_text)})),
    "background": any_json,
    "top_logprobs": any_json,
    "conversation": any_json,
    "metadata": maybe(st.dictionaries(odd_text, odd_text, max_size=2)),
    "user": maybe(odd_text),
    "stop": st.one_of(odd_text, st.lists(odd_text, max_size=5), any_json),
}
ok_call_id = name_text
# Tool names as OpenAI and Anthropic take them, each once.
ok_tool_name = st.from_regex(r"[a-zA-Z0-9_-]{1,20}", fullmatch=True)
ok_response_item = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant"]),
                           "content": st.one_of(text, st.lists(st.fixed_dictionaries(
                               {"type": st.sampled_from(["input_text", "output_text"]),
                                "text": text}), max_size=2))},
                          optional={"type": st.just("message")}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": ok_call_id,
                           "name": name_text, "arguments": st.one_of(text, st.dictionaries(
                               text, json_values, max_size=2).map(json.dumps))}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": ok_call_id,
                           "output": text}),
    st.just({"type": "reasoning", "summary": []}),
)
OK_RESPONSES = {
    "input": st.one_of(text, st.builds(lambda items, last: [*items, last],
                                       st.lists(ok_response_item, max_size=3),
                                       st.fixed_dictionaries({"role": st.just("user"),
                                                              "content": text}))),
    "instructions": text,
    "tools": st.lists(st.fixed_dictionaries(
        {"type": st.just("function"), "name": ok_tool_name},
        optional={"description": text, "strict": st.booleans(),
                  "parameters": st.just({"type": "object", "properties": {"city": {"type": "string"}}})}),
        max_size=2, unique_by=lambda t: t["name"]),
    "tool_choice": st.sampled_from(["auto", "none"]),
    "max_output_tokens": st.integers(1, 8),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1),
    "store": st.booleans(),
    "parallel_tool_calls": st.booleans(),
    "text": st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}},
                             {"format": {"type": "json_schema", "name": "x",
                                         "schema": {"type": "object"}}}]),
    "truncation": st.sampled_from(["auto", "disabled"]),
    "include": st.lists(text, max_size=2),
    "reasoning": st.just({"effort": "low"}),
    "metadata": st.dictionaries(text, text, max_size=2),
    "user": text,
    "stop": st.one_of(text, st.lists(text, max_size=4)),
    "prompt_cache_key": text,
}

# -- strategies: the Messages API ------------------------------------------------------------

text_block = st.fixed_dictionaries({"type": st.just("text"), "text": odd_text},
                                   optional={"cache_control": any_json})
block = maybe(st.one_of(
    text_block,
    st.fixed_dictionaries({"type": st.just("tool_use")},
                          optional={"id": maybe(odd_text), "name": maybe(odd_text),
                                    "input": st.one_of(st.dictionaries(odd_text, any_json,
                                                                       max_size=2), any_json)}),
    st.fixed_dictionaries({"type": st.just("tool_result")},
                          optional={"tool_use_id": maybe(odd_text),
                                    "content": st.one_of(odd_text, st.lists(maybe(text_block),
                                                                            max_size=2), any_json),
                                    "is_error": any_json}),
    st.fixed_dictionaries({"type": st.sampled_from(["image", "document", "thinking",
                                                    "redacted_thinking", "wizard", ""])},
                          optional={"source": any_json, "thinking": odd_text}),
))
message = maybe(st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "assistant", "system", ""]), any_json)},
    optional={"content": st.one_of(odd_text, st.lists(block, max_size=3), any_json)}))
anthropic_tool = maybe(st.fixed_dictionaries(
    {"name": maybe(odd_text)},
    optional={"input_schema": st.one_of(st.just({"type": "object"}), any_json),
              "description": maybe(odd_text), "cache_control": any_json,
              "type": st.one_of(st.sampled_from(["custom", "bash_20250124", "web_search_20250305"]),
                                any_json)}))
MESSAGES_FIELDS = {
    "model": st.one_of(st.just(MODEL), odd_text, any_json, st.just(DELETE)),
    "max_tokens": st.one_of(token_counts, st.just(DELETE)),
    "messages": st.one_of(
        st.builds(lambda rest, last: [*rest, last], st.lists(message, max_size=3),
                  st.builds(lambda t: {"role": "user", "content": t}, odd_text)),
        st.lists(message, max_size=3), any_json, st.just(DELETE)),
    "system": st.one_of(odd_text, st.lists(maybe(text_block), max_size=2), any_json),
    "tools": st.one_of(st.lists(anthropic_tool, max_size=2), any_json),
    "tool_choice": maybe(st.fixed_dictionaries({"type": maybe(st.sampled_from(
        ["auto", "none", "any", "tool", "x"]))}, optional={"disable_parallel_tool_use": any_json,
                                                         "name": odd_text})),
    "stop_sequences": st.one_of(st.lists(odd_text, max_size=5), any_json),
    "temperature": numbers,
    "top_p": numbers,
    "top_k": maybe(big_ints),
    "stream": maybe(st.booleans()),
    "metadata": maybe(st.fixed_dictionaries({}, optional={"user_id": maybe(odd_text)})),
    "thinking": any_json,
    "cache_control": any_json,
}
ok_text_block = st.fixed_dictionaries({"type": st.just("text"), "text": text},
                                      optional={"cache_control": st.just({"type": "ephemeral"})})
# A user or assistant turn is not empty, nor is a text block of one (Anthropic's rules).
ok_turn_text_block = st.fixed_dictionaries(
    {"type": st.just("text"), "text": name_text},
    optional={"cache_control": st.just({"type": "ephemeral"})})
ok_tool_result = st.fixed_dictionaries(
    {"type": st.just("tool_result"), "tool_use_id": name_text},
    optional={"content": st.one_of(text, st.lists(ok_text_block, max_size=2)),
              "is_error": st.booleans()})
ok_user = st.fixed_dictionaries({"role": st.just("user"), "content": st.one_of(
    name_text, st.lists(st.one_of(ok_turn_text_block, ok_tool_result), min_size=1, max_size=3))})
ok_assistant = st.fixed_dictionaries({"role": st.just("assistant"), "content": st.one_of(
    name_text, st.lists(st.one_of(ok_turn_text_block, st.fixed_dictionaries(
        {"type": st.just("tool_use"), "id": name_text, "name": name_text,
         "input": st.dictionaries(text, json_values, max_size=2)}),
        st.just({"type": "thinking", "thinking": "hm", "signature": "x"})), min_size=1,
        max_size=3))})
# Anthropic's tool names: ^[a-zA-Z0-9_-]{1,128}$, each once.
OK_MESSAGES = {
    "messages": st.builds(lambda turns, last: [m for pair in turns for m in pair] + [last],
                          st.lists(st.tuples(ok_user, ok_assistant), max_size=2), ok_user),
    "system": st.one_of(text, st.lists(ok_text_block, max_size=2)),
    "tools": st.lists(st.fixed_dictionaries(
        {"name": ok_tool_name, "input_schema": st.just({"type": "object", "properties": {
            "city": {"type": "string"}}})}, optional={"description": text,
                                                      "type": st.just("custom")}),
        max_size=2, unique_by=lambda tool: tool["name"]),
    "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "none"])},
                                         optional={"disable_parallel_tool_use": st.booleans()}),
    "stop_sequences": st.lists(text, max_size=4),
    "temperature": st.floats(0, 1),
    "top_p": st.floats(0, 1),
    "top_k": st.integers(0, 5000),
    "output_config": st.just({"format": {"type": "json_schema", "schema": {"type": "object"}}}),
    "metadata": st.fixed_dictionaries({}, optional={"user_id": text}),
    "thinking": st.sampled_from([{"type": "enabled", "budget_tokens": 1024},
                                 {"type": "adaptive"}, {"type": "disabled"},
                                 {"type": "between_tools"}]),
}

RESPONSES_BASE = {"model": MODEL, "input": "Hi", "max_output_tokens": 4}
MESSAGES_BASE = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}


@st.composite
def no_stream_options(draw, strategy):
    # valid_bodies adds stream_options with stream; neither agent API has them.
    body = draw(strategy)
    body.pop("stream_options", None)
    body.pop("top_logprobs", None)
    body.pop("logprobs", None)
    return body


# -- property-based fuzzing -------------------------------------------------------------------


@settings(FUZZ, max_examples=60)
@given(body=no_stream_options(valid_bodies(RESPONSES_BASE, OK_RESPONSES)))
def test_fuzz_valid_responses(servers, body):
    assert send(servers, RESPONSES, dumps(body)) == 200


@settings(FUZZ, max_examples=150)
@given(body=bodies(RESPONSES_BASE, RESPONSES_FIELDS))
def test_fuzz_responses(servers, body):
    send(servers, RESPONSES, dumps(body))


@settings(FUZZ, max_examples=60)
@given(body=no_stream_options(valid_bodies(MESSAGES_BASE, OK_MESSAGES)))
def test_fuzz_valid_messages(servers, body):
    assert send(servers, MESSAGES, dumps(body)) == 200
    body.pop("stream", None)
    assert send(servers, COUNT, dumps(body)) == 200


@settings(FUZZ, max_examples=150)
@given(body=bodies(MESSAGES_BASE, MESSAGES_FIELDS), path=st.sampled_from([MESSAGES, COUNT]))
def test_fuzz_messages(servers, body, path):
    send(servers, path, dumps(body))


@settings(FUZZ, max_examples=80)
@given(raw=raw_bodies, path=st.sampled_from([RESPONSES, MESSAGES, COUNT]))
def test_fuzz_raw_bodies(servers, raw, path):
    send(servers, path, raw)


# -- HTTP level and fixed examples ----------------------------------------------------------


@pytest.mark.parametrize("path", [RESPONSES, MESSAGES, COUNT])
def test_oversized_body_and_wrong_method_keep_the_envelope(servers, path):
    status, _, data = post(servers.proxy_url, path, _padded(MAX_BODY + 1))
    assert status == 413, data[:200]
    if path == RESPONSES:
        assert envelope(data)["code"] == "request_too_large"
    else:
        assert anthropic_envelope(data)["type"] == "request_too_large"
    from tests.harness import request
    status, headers, data = request(servers.proxy_url + path, "DELETE")
    assert status == 405 and "POST" in {k.lower(): v for k, v in headers.items()}["allow"]
    check(path, status, {}, data)


@pytest.mark.parametrize("path,body,status", [
    (RESPONSES, {**RESPONSES_BASE, "max_output_tokens": CONTEXT * 2}, 400),
    (RESPONSES, {**RESPONSES_BASE, "previous_response_id": "resp_" + "b" * 32}, 404),
    (RESPONSES, {**RESPONSES_BASE, "model": "nobody-serves-this"}, 404),
    (RESPONSES, {**RESPONSES_BASE, "input": []}, 400),
    (RESPONSES, {**RESPONSES_BASE, "stop": ["a", "b", "c", "d", "e"]}, 400),
    (MESSAGES, {**MESSAGES_BASE, "max_tokens": CONTEXT * 2}, 400),
    (MESSAGES, {**MESSAGES_BASE, "model": "nobody-serves-this"}, 404),
    (MESSAGES, {**MESSAGES_BASE, "messages": [{"role": "user", "content": "x" * 20000}]}, 400),
    (COUNT, {"model": "nobody-serves-this", "messages": [{"role": "user", "content": "Hi"}]}, 404),
])
def test_refusals_from_routing_and_backend_keep_the_envelope(servers, path, body, status):
    # Refused past the translation: by the registry (unknown model), the response store,
    # or the backend (context length, stop count) in OpenAI's envelope, rewritten for
    # Messages into Anthropic's.
    for stream in (False, True):
        got = send(servers, path, dumps({**body, "stream": stream} if path != COUNT else body))
        assert got == status

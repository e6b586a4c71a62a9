"""The Messages API at its edges, through a real proxy and backends: bodies nested past
what the server can re-encode, the order of a whole message's blocks, replies cut by
max_tokens, max_tokens 0 (fill the cache only), Anthropic's validation rules, and
consecutive turns of one role combined into one.

Real parts only, as in test_agent_apis.py: the session's redis-server, two backends
of the tool-calling demo model (fault injection on, for `kvroute_fault: "force:TEXT"`,
which makes the model reply TEXT then EOS), one proxy, real HTTP.
"""

from __future__ import annotations

import json

import orjson
import pytest
from tests import harness
from tests.harness import BackendProcess, ProxyProcess, request
from tests.test_agent_apis import claude, half_cached, named_events, system_prompt

from kvroute.api.errors import APIError
from kvroute.api.http import MAX_DEPTH, parse_json
from kvroute.proxy.agents import messages as messages_api
from kvroute.proxy.agents.reply import ChatReply, Usage

MODEL = "edges-tool"
SECRET, TOKEN = "edges-secret", "edges-internal-token"
F_TOOL = [{"name": "f", "description": "Does f", "input_schema": {"type": "object"}}]
F_CALL = '<tool_call>{"name":"f","arguments":{}}</tool_call>'


@pytest.fixture(scope="module")
def fleet(tool_model, tmp_path_factory, redis_server):
    logs = tmp_path_factory.mktemp("messages-edges")

    def backends(redis_url: str) -> list[BackendProcess]:
        common = ["--redis-url", redis_url, "--secret", SECRET, "--internal-token", TOKEN,
                  "--enable-faults"]
        return [BackendProcess(tool_model, MODEL, logs, backend_id=f"edges-{i}", extra=common)
                for i in (1, 2)]

    def proxies(redis_url: str) -> list[ProxyProcess]:
        return [ProxyProcess(redis_url, logs, ["--secret", SECRET, "--internal-token", TOKEN])]

    with harness.fleet(backends, proxies, redis_server.database()) as f:
        yield {**f, "proxy": f["proxies"][0]}


def post(fleet, path: str, body: dict) -> tuple[int, dict, bytes]:
    return request(fleet["proxy"].url + path, "POST", body, headers={"x-api-key": "any"})


def refused(fleet, path: str, body: dict) -> str:
    """The message of Anthropic's 400 for `body`."""
    status, _, data = post(fleet, path, body)
    err = json.loads(data)
    assert status == 400, (status, data[:300])
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    return err["error"]["message"]


def nested(depth: int) -> dict:
    value: dict | int = 1
    for _ in range(depth):
        value = {"a": value}
    return value


def user(text: str) -> dict:
    return {"role": "user", "content": text}


# -- JSON nested past what the server writes ----------------------------------------------


def test_orjson_writes_254_levels():
    # kvroute/api/http.py's depth check assumes orjson's limit on writing: a new orjson
    # with another one must change _WRITE_DEPTH.
    orjson.dumps(nested(254))
    with pytest.raises(TypeError):
        orjson.dumps(nested(255))


def test_deep_json_is_a_400_on_every_api(fleet):
    deep_tool = [{"name": "f", "input_schema": {"type": "object", "x": nested(250)}}]
    hi = [user("Hi")]
    message = refused(fleet, "/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": hi,
                                              "tools": deep_tool})
    assert message.startswith("tools.0.input_schema.x"), message
    assert f"nested more than {MAX_DEPTH} levels deep" in message, message
    message = refused(fleet, "/v1/messages/count_tokens", {"model": MODEL, "messages": hi,
                                                           "tools": deep_tool})
    assert message.startswith("tools.0.input_schema.x"), message
    use = {"type": "tool_use", "id": "call_1", "name": "f", "input": nested(300)}
    message = refused(fleet, "/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [
        user("Hi"), {"role": "assistant", "content": [use]}, user("Go on.")]})
    assert message.startswith("messages.1.content.0.input"), message
    # The other APIs, in their own envelope; and the backend itself.
    chat_tool = [{"type": "function", "function": {"name": "f", "parameters": nested(250)}}]
    proxy, backend = fleet["proxy"].url, fleet["backends"]["edges-1"].url
    for url, path, body in (
            (proxy, "/v1/chat/completions", {"messages": hi, "tools": chat_tool}),
            (proxy, "/v1/responses", {"input": "Hi", "tools": [
                {"type": "function", "name": "f", "parameters": nested(300)}]}),
            (backend, "/v1/chat/completions", {"messages": hi, "tools": chat_tool})):
        status, _, data = request(url + path, "POST", {"model": MODEL, **body},
                                  headers={"x-kvroute-token": TOKEN})
        err = json.loads(data)["error"]
        assert status == 400 and err["code"] == "nested_too_deeply", (path, data[:300])
        assert err["param"].startswith("tools[0]"), err
    # Deep, but within the limit: served.
    status, _, data = post(fleet, "/v1/messages/count_tokens", {
        "model": MODEL, "messages": hi,
        "tools": [{"name": "f", "input_schema": {"type": "object", "x": nested(MAX_DEPTH - 8)}}]})
    assert status == 200, data[:300]


def test_the_deep_path_is_named_past_many_shallow_containers():
    # Depth first, holding one path: many shallow lists before the deep branch (a body
    # that cost gigabytes when every container was queued with its own path).
    wide = [[[] for _ in range(1000)] for _ in range(50)]
    raw = json.dumps({"model": "m", "wide": wide, "deep": {"k": [nested(MAX_DEPTH)]}}).encode()
    with pytest.raises(APIError) as e:
        parse_json(raw)
    assert e.value.param == "deep.k[0].a.a", e.value.param  # its first 5 steps
    assert parse_json(json.dumps({"wide": wide, "deep": nested(MAX_DEPTH - 2)}).encode())


# -- a whole message is the stream's ---------------------------------------------------------


def test_a_whole_message_lists_its_blocks_in_the_order_written(fleet):
    kw = {"model": MODEL, "max_tokens": 64, "tools": F_TOOL, "messages": [user("Check.")],
          "extra_body": {"kvroute_fault": f"force:Checking.{F_CALL}Done."}}
    whole = claude(fleet).messages.create(**kw)
    with claude(fleet).messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    blocks = [(b.type, b.text if b.type == "text" else (b.name, b.input)) for b in whole.content]
    assert blocks == [("text", "Checking."), ("tool_use", ("f", {})), ("text", "Done.")]
    assert blocks == [(b.type, b.text if b.type == "text" else (b.name, b.input))
                      for b in streamed.content]
    assert whole.stop_reason == streamed.stop_reason == "tool_use"


# -- cut by max_tokens -----------------------------------------------------------------------


def test_a_reply_cut_by_max_tokens_says_max_tokens_even_with_a_tool_call(fleet):
    # A whole call, then a second one cut short: 16 tokens end inside the second.
    fault = "force:" + F_CALL + '<tool_call>{"name":"f",'
    kw = {"model": MODEL, "max_tokens": 16, "tools": F_TOOL, "messages": [user("Do f twice.")],
          "extra_body": {"kvroute_fault": fault}}
    whole = claude(fleet).messages.create(**kw)
    assert whole.stop_reason == "max_tokens", whole
    assert whole.usage.output_tokens == 16
    with claude(fleet).messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "max_tokens", streamed


def test_finish_reason_length_is_max_tokens_whatever_the_reply_holds():
    # What the backend reports for a cut once it says "length" after a tool call too
    # (and leaves an unfinished call's markup out of the text).
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for reply in (ChatReply(finish_reason="length"),
                  ChatReply(tool_calls=[call], finish_reason="length"),
                  ChatReply(text="Let me", tool_calls=[call], finish_reason="length")):
        assert messages_api._stop_reason(reply, prefill_only=False) == "max_tokens"
    # A call that ended within the budget is a tool_use.
    done = ChatReply(tool_calls=[call], finish_reason="tool_calls", usage=Usage(10, 0, 12))
    assert messages_api._stop_reason(done, prefill_only=False) == "tool_use"


# -- max_tokens 0: fill the cache ----------------------------------------------------------


def test_max_tokens_zero_fills_the_cache_and_answers_nothing(fleet):
    c = claude(fleet)
    kw = {"model": MODEL, "system": system_prompt(), "messages": [user("Read this first.")]}
    counted = c.messages.count_tokens(**kw).input_tokens
    raw = c.messages.with_raw_response.create(max_tokens=0, **kw)
    m, backend = raw.parse(), raw.headers["x-kvroute-backend"]
    assert m.content == [] and m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.output_tokens == 0
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == counted
    raw = c.messages.with_raw_response.create(max_tokens=8, **kw)
    assert raw.headers["x-kvroute-backend"] == backend
    u = raw.parse().usage
    assert half_cached(u.cache_read_input_tokens, counted), u

    # Streamed: the message's events without a content block.
    kw["system"] = system_prompt()
    status, headers, data = post(fleet, "/v1/messages", {**kw, "max_tokens": 0, "stream": True})
    events = named_events(data)
    assert status == 200 and [n for n, _ in events] == [
        "message_start", "ping", "message_delta", "message_stop"], events
    delta = events[2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}, delta
    assert delta["usage"]["output_tokens"] == 0 and delta["usage"]["input_tokens"] > 0
    raw = c.messages.with_raw_response.create(max_tokens=8, **kw)
    assert raw.headers["x-kvroute-backend"] == headers["x-kvroute-backend"]
    assert raw.parse().usage.cache_read_input_tokens > 0


# -- Anthropic's validation ------------------------------------------------------------------


@pytest.mark.parametrize("fields,message", [
    ({"messages": [user("")]}, "messages.0: all messages must have non-empty content"),
    ({"messages": [{"role": "user", "content": []}]}, "messages.0: all messages must have"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                {"type": "text", "text": ""}]}]},
     "messages.0.content.1.text: text content blocks must be non-empty"),
    ({"messages": [user("Hi"), {"role": "assistant", "content": ""}, user("Go on.")]},
     "messages.1: all messages must have non-empty content"),
    ({"messages": [user("Hi"), {"role": "assistant", "content": [{"type": "text", "text": ""}]},
                   user("Go on.")]}, "messages.1.content.0.text: text content blocks"),
    ({"tools": [{"name": "read file", "input_schema": {}}]},
     "tools.0.name: String should match pattern '^[a-zA-Z0-9_-]{1,128}$'"),
    ({"tools": [{"name": "x" * 129, "input_schema": {}}]}, "tools.0.name: String should match"),
    ({"tools": [{"name": "f", "input_schema": {}}, {"name": "g", "input_schema": {}},
                {"name": "f", "input_schema": {}, "defer_loading": True}]},
     "tools.2.name: Tool names must be unique"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type: Input should be 'enabled'"),
    ({"thinking": {"budget_tokens": 2048}}, "thinking.type: Field required"),
])
def test_refused_as_anthropic_refuses(fleet, fields, message):
    body = {"model": MODEL, "max_tokens": 4, "messages": [user("Hi")], **fields}
    got = refused(fleet, "/v1/messages", body)
    assert got.startswith(message), got
    body.pop("max_tokens")
    assert refused(fleet, "/v1/messages/count_tokens", body) == got


@pytest.mark.parametrize("fields", [
    {"thinking": {"type": "enabled", "budget_tokens": 2048}},
    {"thinking": {"type": "adaptive", "display": "omitted"}},
    {"thinking": {"type": "disabled"}},
    {"thinking": {"type": "between_tools"}},
    {"tools": [{"name": "mcp__git-hub__get_file_1", "input_schema": {}}, *F_TOOL]},
    # Histories a strict check would break (a client may trim a conversation): a
    # result whose call is not there, a call whose result is not.
    {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "call_gone", "content": "done"}]}]},
    {"messages": [user("Hi"), {"role": "assistant", "content": [
        {"type": "tool_use", "id": "call_1", "name": "f", "input": {}}]}, user("Never mind.")]},
    # The optional empty ones: a system message (Anthropic's directive-only form), a
    # tool result.
    {"messages": [user("Hi"), {"role": "system", "content": ""}, user("Go on.")]},
    {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "call_1", "content": ""}]}]},
])
def test_accepted_as_anthropic_accepts(fleet, fields):
    status, _, data = post(fleet, "/v1/messages/count_tokens",
                           {"model": MODEL, "messages": [user("Hi")], **fields})
    assert status == 200, data[:300]


# -- consecutive turns of one role -----------------------------------------------------------


def count(fleet, messages: list[dict], **kw) -> int:
    status, _, data = post(fleet, "/v1/messages/count_tokens",
                           {"model": MODEL, "messages": messages, **kw})
    assert status == 200, data[:300]
    return json.loads(data)["input_tokens"]


def test_consecutive_messages_of_one_role_are_one_turn(fleet):
    text = lambda t: {"type": "text", "text": t}  # noqa: E731
    assert count(fleet, [user("Hi"), user("there")]) == count(
        fleet, [{"role": "user", "content": [text("Hi"), text("there")]}])
    use = {"type": "tool_use", "id": "call_1", "name": "f", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "call_1", "content": "42"}
    split = [user("Do f."), {"role": "assistant", "content": "On it."},
             {"role": "assistant", "content": [use]},
             {"role": "user", "content": [result]}, user("Thanks.")]
    joined = [user("Do f."), {"role": "assistant", "content": [text("On it."), use]},
              {"role": "user", "content": [result, text("Thanks.")]}]
    assert count(fleet, split, tools=F_TOOL) == count(fleet, joined, tools=F_TOOL)
    # And a conversation sent either way is served.
    m = claude(fleet).messages.create(model=MODEL, max_tokens=4, messages=[user("Hi"), user("there")])
    assert m.type == "message"

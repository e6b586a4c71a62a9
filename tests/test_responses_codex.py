"""The Responses API as the real Codex CLI uses it, end to end.

tests/data/codex_request.json is the Codex CLI's first request, captured and trimmed:
function tools with `strict: false`, a `namespace` tool, the hosted `web_search`
tool, message items with ids, `store: false`, `include`, `reasoning`,
`prompt_cache_key`, `client_metadata`. It and the turns after it go through a real
proxy, backends of the demo models and Redis, with the official `openai` client; the
answers are also checked against the SDK's own types strictly (`model_validate`, the
SDK itself builds its objects leniently), as Codex's strict serde parsing would.
"""

from __future__ import annotations

import copy
import json
import uuid
from pathlib import Path

import openai
import pytest
from openai.types import Model
from openai.types.responses import (Response, ResponseCustomToolCall, ResponseFunctionToolCall,
                                    ResponseStreamEvent)
from openai.types.responses.response_output_item import LocalShellCall
from pydantic import TypeAdapter

from tests import harness
from tests.harness import BackendProcess, ProxyProcess, get_json, request

from kvroute.devtools.demo_model import DEMO_REPLY, DEMO_TOOL_CALL
from kvroute.proxy.agents import responses as responses_api

SECRET = "codex-secret"
TOKEN = "codex-internal-token"
KEY, OTHER_KEY = "sk-codex", "sk-codex-other"
TEXT, TOOL = "codex-text", "codex-tool"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}
CAPTURE = json.loads((Path(__file__).parent / "data" / "codex_request.json").read_text())
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def fleet(text_model, tool_model, tmp_path_factory, redis_server):
    logs = tmp_path_factory.mktemp("codex")
    common = ["--secret", SECRET, "--internal-token", TOKEN]

    def backends(redis_url: str) -> list[BackendProcess]:
        return [BackendProcess(text_model, TEXT, logs, backend_id="codex-text",
                               extra=["--redis-url", redis_url, *common]),
                BackendProcess(tool_model, TOOL, logs, backend_id="codex-tool",
                               extra=["--redis-url", redis_url, *common])]

    def proxies(redis_url: str) -> list[ProxyProcess]:
        return [ProxyProcess(redis_url, logs, [*common, "--api-key", f"{KEY}:team-a",
                                               "--api-key", f"{OTHER_KEY}:team-b"])]

    with harness.fleet(backends, proxies, redis_server.database()) as f:
        yield f["proxies"][0].url


def oai(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def codex_body(model: str = TEXT, **changes) -> dict:
    return {**copy.deepcopy(CAPTURE["body"]), "model": model, **changes}


def create(client: openai.OpenAI, body: dict):
    """`client.responses.create` with Codex's body as it is (the SDK's signature does not
    know all of its fields) and its headers; the raw response."""
    rest = {k: v for k, v in body.items() if k not in ("model", "input", "stream")}
    return client.responses.with_raw_response.create(
        model=body["model"], input=body["input"], stream=body.get("stream", False),
        extra_body=rest, extra_headers=CAPTURE["headers"])


def post(url: str, body: dict, key: str = KEY) -> tuple[int, dict, bytes]:
    return request(url + "/v1/responses", "POST", body,
                   headers={"Authorization": f"Bearer {key}"})


def strict_events(data: bytes) -> list:
    """The SSE events of a Responses stream, each validated as the SDK's own type."""
    events = []
    for block in data.split(b"\n\n"):
        if block.startswith(b"event: "):
            name, payload = block.split(b"\n", 1)
            event = json.loads(payload.removeprefix(b"data: "))
            assert event["type"] == name[7:].decode()
            events.append(EVENTS.validate_python(event))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def nonce() -> str:
    # Keeps a test's conversation apart from every other test's cache entries.
    return f"{uuid.uuid4().hex}: you help a team of engineers with their code."


# -- Codex's own requests ------------------------------------------------------------------


def test_codex_first_request_is_answered_streamed_and_whole(fleet):
    c = oai(fleet)
    raw = create(c, codex_body())
    assert raw.headers["x-kvroute-ignored-tools"] == "web_search"
    events = list(raw.parse())
    done = events[-1]
    assert done.type == "response.completed" and done.response.output_text == DEMO_REPLY
    assert done.response.store is False
    item_done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.type for i in item_done] == ["message"]
    # The same over raw HTTP, every event checked against the SDK's types strictly.
    status, headers, data = post(fleet, codex_body())
    assert status == 200 and headers["x-kvroute-ignored-tools"] == "web_search"
    events = strict_events(data)
    assert events[-1].type == "response.completed"
    final = Response.model_validate(events[-1].response.model_dump(mode="json"))
    u = final.usage
    assert u.input_tokens_details.cache_write_tokens == 0
    assert u.input_tokens_details.cached_tokens > 0  # the first one put it in the cache
    assert u.total_tokens == u.input_tokens + u.output_tokens
    # Not streamed: the SDK's Response type, strictly, from the answer's bytes.
    raw = create(c, codex_body(stream=False))
    body = json.loads(raw.http_response.content)
    whole = Response.model_validate(body)
    assert whole.output_text == DEMO_REPLY and whole.status == "completed"
    assert [t.type for t in whole.tools] == [t["type"] for t in CAPTURE["body"]["tools"]]
    assert raw.headers["x-kvroute-ignored-tools"] == "web_search"


def test_codex_second_turn_resends_everything_and_hits_the_cache(fleet):
    c = oai(fleet)
    first = codex_body()
    first["input"][-1]["content"][0]["text"] = nonce()
    events = list(create(c, first).parse())
    r1 = events[-1].response
    # Codex keeps nothing on the server (store: false): it appends the output items as
    # it parsed them, and the next user message, and sends everything again.
    output = [e.item.model_dump(mode="json", exclude_none=True) for e in events
              if e.type == "response.output_item.done"]
    second = codex_body(input=[*first["input"], *output, {
        "type": "message", "id": f"msg_{uuid.uuid4()}", "role": "user",
        "content": [{"type": "input_text", "text": "Tell me more."}]}])
    raw = create(c, second)
    r2 = list(raw.parse())[-1].response
    assert r2.status == "completed"
    u = r2.usage
    assert u.input_tokens_details.cached_tokens >= 0.8 * u.input_tokens, u
    assert u.input_tokens_details.cached_tokens >= r1.usage.input_tokens, (u, r1.usage)
    # And with store false there is nothing to retrieve or continue from.
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r1.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model=TEXT, input="Again?", previous_response_id=r1.id)


def test_message_ids_do_not_change_the_chat_body():
    # The proxy computes prefix keys over the translated chat body: input item ids
    # (Codex sends a fresh one per message) must not reach it.
    body = codex_body()
    plain = copy.deepcopy(body)
    for item in plain["input"]:
        item.pop("id")
    for item in body["input"]:
        item["id"] = f"msg_{uuid.uuid4()}"
    chat = responses_api.chat_body(responses_api.parse(body), [])
    assert chat == responses_api.chat_body(responses_api.parse(plain), [])
    assert "msg_" not in json.dumps(chat)


# -- namespaces ----------------------------------------------------------------------------


def test_namespace_functions_take_codex_flat_names():
    tools = [{"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.",
              "tools": [{"type": "function", "name": "close_agent", "parameters": WEATHER}]},
             {"type": "namespace", "name": "mcp__calendar__", "description": "An MCP server.",
              "tools": [{"type": "function", "name": "__create_event"}]},
             {"type": "function", "name": "exec_command"}]
    req = responses_api.parse({"model": TOOL, "input": "Hi", "tools": tools})
    names = [t["function"]["name"] for t in req.tools]
    assert names == ["multi_agent_v1__close_agent", "mcp__calendar__create_event", "exec_command"]
    # The model's call of a flat name comes back as Codex dispatches it.
    call = {"id": "call_1", "type": "function",
            "function": {"name": "multi_agent_v1__close_agent", "arguments": '{"target": "a"}'}}
    item = responses_api.OutputCall.of(call, req.routes).item("completed")
    parsed = ResponseFunctionToolCall.model_validate(item)
    assert (parsed.name, parsed.namespace, parsed.call_id) == ("close_agent", "multi_agent_v1",
                                                                "call_1")
    plain = {"id": "call_2", "type": "function",
             "function": {"name": "exec_command", "arguments": "{}"}}
    assert "namespace" not in responses_api.OutputCall.of(plain, req.routes).item("completed")


def test_a_namespace_function_call_comes_back_in_codex_shape(fleet):
    # The tool model always calls get_weather: offered from Codex's default namespace
    # `functions` (which adds nothing to the name), that is the namespaced function.
    tools = [{"type": "namespace", "name": "functions", "description": "Top-level tools.",
              "tools": [{"type": "function", "name": "get_weather", "strict": False,
                         "description": "Current weather", "parameters": WEATHER}]},
             {"type": "web_search", "external_web_access": False}]
    body = {"model": TOOL, "instructions": nonce(), "input": "Weather in Paris?", "tools": tools,
            "store": False, "stream": True}
    status, headers, data = post(fleet, body)
    assert status == 200 and headers["x-kvroute-ignored-tools"] == "web_search"
    events = strict_events(data)
    kinds = [e.type for e in events]
    assert kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds
    added, done = (e.item for e in events if e.type.startswith("response.output_item."))
    for item in (added, done):
        assert (item.type, item.name, item.namespace) == ("function_call", "get_weather",
                                                          "functions")
    assert json.loads(done.arguments) == DEMO_TOOL_CALL["arguments"]
    assert events[-1].response.output == [done]
    # Whole, and through the SDK's stream helper (which accumulates the events itself).
    r = oai(fleet).responses.create(**{**body, "stream": False})
    (call,) = r.output
    assert (call.name, call.namespace) == ("get_weather", "functions")
    with oai(fleet).responses.stream(**{k: v for k, v in body.items() if k != "stream"}) as s:
        (call,) = s.get_final_response().output
    assert (call.name, call.namespace) == ("get_weather", "functions")


def test_a_namespaced_call_resent_by_codex_continues_the_cache_of_its_chat_twin(fleet):
    # A conversation with a call of `weather_ns.get_weather`, first as a chat completion
    # (the flat name, which is what the model sees), then as Codex resends it: the
    # function_call item carries the function's own name and its namespace, followed by
    # the chat answer and a new message. The same conversation is the same chat body:
    # the second hits all of the first.
    c, system = oai(fleet), nonce()
    fn = {"name": "get_weather", "description": "Current weather", "parameters": WEATHER}
    flat = "weather_ns__get_weather"
    args = json.dumps(DEMO_TOOL_CALL["arguments"])
    chat = c.chat.completions.create(model=TEXT, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_w1", "type": "function", "function": {"name": flat, "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_w1", "content": "18 C, sunny"}],
        tools=[{"type": "function", "function": {**fn, "name": flat}}])
    r = c.responses.create(model=TEXT, instructions=system, store=False, input=[
        {"type": "message", "role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_w1", "namespace": "weather_ns",
         "name": "get_weather", "arguments": args},
        {"type": "function_call_output", "call_id": "call_w1", "output": "18 C, sunny"},
        {"type": "message", "role": "assistant", "content": chat.choices[0].message.content},
        {"type": "message", "role": "user", "content": "Thanks!"}],
        tools=[{"type": "namespace", "name": "weather_ns", "description": "Weather.",
                "tools": [{"type": "function", **fn}]}])
    assert r.usage.input_tokens_details.cached_tokens >= chat.usage.prompt_tokens, (
        r.usage, chat.usage)


# -- hosted, custom and local shell tools -------------------------------------------------------


HOSTED = [{"type": "web_search", "external_web_access": False},
          {"type": "web_search_preview"}, {"type": "file_search", "vector_store_ids": ["vs_1"]},
          {"type": "code_interpreter", "container": {"type": "auto"}},
          {"type": "image_generation"},
          {"type": "computer_use_preview", "display_width": 800, "display_height": 600,
           "environment": "linux"},
          {"type": "mcp", "server_label": "docs", "server_url": "https://example.com/mcp"},
          {"type": "web_search"}, {"type": "a_tool_of_next_year", "knob": 3}]


def test_hosted_tools_are_accepted_and_named_in_a_header(fleet):
    raw = oai(fleet).responses.with_raw_response.create(
        model=TEXT, input="Hello there.", tools=HOSTED, max_output_tokens=4)
    assert raw.headers["x-kvroute-ignored-tools"] == (
        "web_search,web_search_preview,file_search,code_interpreter,image_generation,"
        "computer_use_preview,mcp,a_tool_of_next_year")
    r = raw.parse()
    assert r.status == "incomplete" and [t.type for t in r.tools] == [t["type"] for t in HOSTED]
    # Nothing ignored, no header; a tool that is no object, or names no type, is still a 400.
    raw = oai(fleet).responses.with_raw_response.create(model=TEXT, input="Hi", max_output_tokens=2)
    assert "x-kvroute-ignored-tools" not in raw.headers
    for tools, param in (([{"type": 7}], "tools[0].type"), (["web_search"], "tools[0].type"),
                         ([{"type": "namespace", "name": "ns", "tools": [{"type": "web_search"}]}],
                          "tools[0].tools[0].type")):
        with pytest.raises(openai.BadRequestError) as e:
            oai(fleet).responses.create(model=TEXT, input="Hi", tools=tools)
        assert e.value.body["param"] == param


CUSTOM = [{"type": "custom", "name": "get_weather", "description": "Weather, as free text.",
           "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}]


def test_a_custom_tool_call_round_trip(fleet):
    c, system = oai(fleet), nonce()
    body = {"model": TOOL, "instructions": system, "input": "Weather in Paris?", "tools": CUSTOM,
            "stream": True}
    status, _, data = post(fleet, body)
    events = strict_events(data)
    kinds = [e.type for e in events]
    assert status == 200 and kinds[-1] == "response.completed", kinds
    assert {"response.custom_tool_call_input.delta",
            "response.custom_tool_call_input.done"} <= set(kinds)
    (call,) = events[-1].response.output
    assert isinstance(call, ResponseCustomToolCall) and call.name == "get_weather"
    # The tool model writes its fixed JSON, not the one string it was offered: that
    # text is the input.
    assert json.loads(call.input) == DEMO_TOOL_CALL["arguments"]
    r1 = events[-1].response
    # Turn 2, as Codex sends it: the call and its output resent as items.
    r2 = c.responses.create(model=TOOL, instructions=system, tools=CUSTOM, store=False, input=[
        {"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
        {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "18 C, sunny"}])
    assert r2.status == "completed"
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens - 1, (
        r2.usage, r1.usage)
    # Stored (r1), it can be continued by previous_response_id with the output alone.
    r3 = c.responses.create(model=TOOL, instructions=system, tools=CUSTOM,
                            previous_response_id=r1.id, input=[
                                {"type": "custom_tool_call_output", "call_id": call.call_id,
                                 "output": "18 C, sunny"}])
    assert r3.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens


def test_custom_and_local_shell_translate_both_ways():
    tools = [*CUSTOM, {"type": "local_shell"}]
    items = [{"role": "user", "content": "List the files, then patch."},
             {"type": "local_shell_call", "id": "lsh_1", "call_id": "call_s", "status": "completed",
              "action": {"type": "exec", "command": ["ls", "-la"], "env": {}, "timeout_ms": 500,
                         "working_directory": None, "user": None}},
             {"type": "local_shell_call_output", "id": "call_s", "output": "a.txt"},
             {"type": "custom_tool_call", "call_id": "call_c", "name": "get_weather",
              "input": "*** Begin Patch"},
             {"type": "custom_tool_call_output", "call_id": "call_c", "output": "done"},
             {"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]
    req = responses_api.parse({"model": TOOL, "input": items, "tools": tools,
                               "include": ["reasoning.encrypted_content"], "store": False,
                               "service_tier": "auto", "truncation": "auto",
                               "text": {"verbosity": "low"}, "safety_identifier": "u1",
                               "prompt_cache_key": "k", "client_metadata": {"a": "b"}})
    custom, shell = req.tools
    assert custom["function"]["parameters"]["required"] == ["input"]
    assert "start: /.+/" in custom["function"]["description"]
    assert shell["function"]["name"] == "local_shell"
    assert shell["function"]["parameters"]["properties"]["command"]["type"] == "array"
    user, shell_call, shell_out, custom_call, custom_out = req.input  # the reasoning dropped
    assert shell_call["tool_calls"][0]["function"] == {
        "name": "local_shell", "arguments": json.dumps({"command": ["ls", "-la"],
                                                        "timeout_ms": 500}, separators=(",", ":"))}
    assert shell_out == {"role": "tool", "tool_call_id": "call_s", "content": "a.txt"}
    assert json.loads(custom_call["tool_calls"][0]["function"]["arguments"]) == {
        "input": "*** Begin Patch"}
    assert custom_out["tool_call_id"] == "call_c"
    # The model's calls, back as the items of their tools (and the SDK's types).
    shell_reply = {"id": "call_x", "function": {"name": "local_shell",
                                                "arguments": '{"command": ["pwd"]}'}}
    item = responses_api.OutputCall.of(shell_reply, req.routes).item("completed")
    shell_item = LocalShellCall.model_validate(item)
    assert shell_item.action.command == ["pwd"] and shell_item.call_id == "call_x"
    custom_reply = {"id": "call_y", "function": {"name": "get_weather",
                                                 "arguments": '{"input": "*** Begin Patch"}'}}
    item = ResponseCustomToolCall.model_validate(
        responses_api.OutputCall.of(custom_reply, req.routes).item("completed"))
    assert (item.name, item.input) == ("get_weather", "*** Begin Patch")


# -- stored responses and models -----------------------------------------------------------------


def test_get_and_delete_a_stored_response(fleet):
    c, other = oai(fleet), oai(fleet, OTHER_KEY)
    raw = c.responses.with_raw_response.create(model=TEXT, input="Hello there.",
                                               max_output_tokens=3)
    created = json.loads(raw.http_response.content)
    got = c.responses.with_raw_response.retrieve(created["id"])
    assert json.loads(got.http_response.content) == created
    assert Response.model_validate(created).usage.input_tokens > 0
    # A stream's stored object is the one its response.completed carried.
    status, _, data = post(fleet, {"model": TEXT, "input": "Hello there.", "stream": True})
    final = strict_events(data)[-1].response
    assert c.responses.retrieve(final.id).model_dump() == final.model_dump()
    # Another scope's id is unknown, to read and to delete.
    for call in (lambda: other.responses.retrieve(created["id"]),
                 lambda: other.responses.delete(created["id"])):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["code"] == "response_not_found", e.value.body
    url = f"{fleet}/v1/responses/{created['id']}"
    status, _, data = request(url, "DELETE", headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200 and json.loads(data) == {"id": created["id"], "object": "response",
                                                  "deleted": True}
    for call in (lambda: c.responses.retrieve(created["id"]),
                 lambda: c.responses.delete(created["id"]),
                 lambda: c.responses.create(model=TEXT, input="Again?",
                                            previous_response_id=created["id"])):
        with pytest.raises(openai.NotFoundError):
            call()
    status, _, data = request(f"{fleet}/v1/responses/nonsense",
                              headers={"Authorization": f"Bearer {KEY}"})
    assert status == 404 and json.loads(data)["error"]["code"] == "response_not_found"


def test_get_one_model(fleet):
    c = oai(fleet)
    listed = {m["id"]: m for m in get_json(fleet + "/v1/models",
                                          headers={"Authorization": f"Bearer {KEY}"})["data"]}
    model = c.models.with_raw_response.retrieve(TEXT)
    assert json.loads(model.http_response.content) == listed[TEXT]
    assert Model.model_validate(listed[TEXT]).id == TEXT
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"

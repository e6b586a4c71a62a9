"""Agent clients end to end: the OpenAI Responses API and the Anthropic Messages API
through the proxy, with the official `openai` and `anthropic` clients.

Real parts only: a redis-server on a free port, four `kvroute backend` processes (two
serving the text demo model, two the tool-calling one), one proxy with API keys, real
HTTP. Every second turn must report a cache hit (cached tokens at least half its
prompt) and land on the backend that served the first turn (`x-kvroute-backend`),
whichever API carries the conversation.
"""

from __future__ import annotations

import json
import uuid

import anthropic
import openai
import pytest
import redis as redis_py
from tests import harness
from tests.test_vision import image_url
from tests.harness import BackendProcess, ProxyProcess, get_json, request

from kvroute.devtools.demo_model import DEMO_REPLY, DEMO_TOOL_CALL

SECRET = "agent-secret"
TOKEN = "agent-internal-token"
KEY, OTHER_KEY = "sk-agents", "sk-other-team"
OPERATOR_KEY = "sk-ops"  # /stats needs an operator key once keys are set
TEXT, TOOL = "agent-text", "agent-tool"
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}


@pytest.fixture(scope="module")
def fleet(text_model, tool_model, tmp_path_factory, redis_server):
    logs = tmp_path_factory.mktemp("agents")

    def backends(redis_url: str) -> list[BackendProcess]:
        common = ["--redis-url", redis_url, "--secret", SECRET, "--internal-token", TOKEN]
        # Faults on (the kvroute_fault request field) for the failure-mid-stream test.
        return [*(BackendProcess(text_model, TEXT, logs, backend_id=f"text-{i}",
                                 extra=common + ["--enable-faults"]) for i in (1, 2)),
                *(BackendProcess(tool_model, TOOL, logs, backend_id=f"tool-{i}", extra=common)
                  for i in (1, 2))]

    def proxies(redis_url: str) -> list[ProxyProcess]:
        return [ProxyProcess(redis_url, logs, ["--secret", SECRET, "--internal-token", TOKEN,
                                               "--api-key", f"{KEY}:team-a",
                                               "--api-key", f"{OTHER_KEY}:team-b",
                                               "--api-key", f"{OPERATOR_KEY}:operator"])]

    with harness.fleet(backends, proxies, redis_server.database()) as f:
        yield {**f, "proxy": f["proxies"][0]}


def oai(fleet, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet["proxy"].url + "/v1", api_key=key, max_retries=0)


def claude(fleet, key: str = KEY, bearer: bool = False) -> anthropic.Anthropic:
    # api_key travels as x-api-key, auth_token as Authorization: Bearer (Claude Code's
    # ANTHROPIC_API_KEY and ANTHROPIC_AUTH_TOKEN): both are kvroute API keys.
    auth = {"auth_token": key} if bearer else {"api_key": key}
    return anthropic.Anthropic(base_url=fleet["proxy"].url, max_retries=0, **auth)


def system_prompt() -> str:
    # A nonce keeps every test's conversation apart from every other's cache entries.
    return f"{uuid.uuid4().hex}: you help a team of engineers with their code. " * 3


def half_cached(cached: int, prompt: int) -> bool:
    return prompt > 0 and cached >= prompt / 2


TOOL_RESP = [{"type": "function", "name": "get_weather", "description": "Current weather",
              "parameters": WEATHER_SCHEMA}]
TOOL_MSG = [{"name": "get_weather", "description": "Current weather", "input_schema": WEATHER_SCHEMA}]


# -- the Responses API -------------------------------------------------------------------


def test_responses_whole_second_turn_hits_and_sticks(fleet):
    c = oai(fleet)
    instructions = system_prompt()
    raw = c.responses.with_raw_response.create(model=TEXT, instructions=instructions,
                                               input="Hello there.")
    r1, backend = raw.parse(), raw.headers["x-kvroute-backend"]
    assert r1.object == "response" and r1.status == "completed" and r1.id.startswith("resp_")
    assert r1.output_text == DEMO_REPLY
    assert r1.usage.input_tokens > 0 and r1.usage.output_tokens > 0
    # Turn 2 sends the whole conversation back as items, as Codex does.
    items = [{"role": "user", "content": "Hello there."},
             *[o.model_dump(exclude_none=True) for o in r1.output],
             {"role": "user", "content": [{"type": "input_text", "text": "Tell me more."}]}]
    raw = c.responses.with_raw_response.create(model=TEXT, instructions=instructions, input=items)
    r2 = raw.parse()
    assert raw.headers["x-kvroute-backend"] == backend
    assert raw.headers["x-kvroute-route-reason"] == "cache-hit"
    assert half_cached(r2.usage.input_tokens_details.cached_tokens, r2.usage.input_tokens), r2.usage
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens


def test_responses_stream_events_then_previous_response_id(fleet):
    c = oai(fleet)
    instructions = system_prompt()
    raw = c.responses.with_raw_response.create(model=TEXT, instructions=instructions,
                                               input="Hello there.", stream=True)
    backend = raw.headers["x-kvroute-backend"]
    events = list(raw.parse())
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"], kinds
    assert kinds[-5:] == ["response.output_text.delta", "response.output_text.done",
                          "response.content_part.done", "response.output_item.done",
                          "response.completed"], kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == DEMO_REPLY
    done = events[-1].response
    assert done.status == "completed" and done.output_text == DEMO_REPLY
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1
    # Continue from the stored response: only the new input is sent.
    raw = c.responses.with_raw_response.create(model=TEXT, instructions=instructions,
                                               previous_response_id=done.id, input="Tell me more.")
    r2 = raw.parse()
    assert raw.headers["x-kvroute-backend"] == backend
    assert r2.previous_response_id == done.id
    assert half_cached(r2.usage.input_tokens_details.cached_tokens, r2.usage.input_tokens), r2.usage
    # And the SDK's stream helper, which checks the event protocol as it accumulates.
    with c.responses.stream(model=TEXT, instructions=instructions, previous_response_id=r2.id,
                            input="And again?") as stream:
        final = stream.get_final_response()
    assert final.output_text == DEMO_REPLY and final.previous_response_id == r2.id
    assert half_cached(final.usage.input_tokens_details.cached_tokens, final.usage.input_tokens)


def test_responses_function_call_round_trip(fleet):
    c = oai(fleet)
    instructions = system_prompt()
    raw = c.responses.with_raw_response.create(model=TOOL, instructions=instructions,
                                               input="Weather in Paris?", tools=TOOL_RESP)
    r1, backend = raw.parse(), raw.headers["x-kvroute-backend"]
    (call,) = r1.output
    assert call.type == "function_call" and call.name == DEMO_TOOL_CALL["name"]
    assert json.loads(call.arguments) == DEMO_TOOL_CALL["arguments"]
    assert call.call_id.startswith("call_") and call.status == "completed"
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}
    raw = c.responses.with_raw_response.create(model=TOOL, instructions=instructions,
                                               previous_response_id=r1.id, input=[output],
                                               tools=TOOL_RESP)
    r2 = raw.parse()
    assert raw.headers["x-kvroute-backend"] == backend
    assert half_cached(r2.usage.input_tokens_details.cached_tokens, r2.usage.input_tokens), r2.usage
    # The same conversation sent in full (no stored response) routes and hits the same.
    items = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
             output]
    raw = c.responses.with_raw_response.create(model=TOOL, instructions=instructions, input=items,
                                               tools=TOOL_RESP, stream=True)
    assert raw.headers["x-kvroute-backend"] == backend
    events = list(raw.parse())
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    usage = events[-1].response.usage
    assert half_cached(usage.input_tokens_details.cached_tokens, usage.input_tokens), usage


def test_previous_response_id_unknown_or_other_scope_is_404(fleet):
    r = oai(fleet).responses.create(model=TEXT, input="Hello there.", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    for client, rid in ((oai(fleet), "resp_" + "0" * 32), (oai(fleet), "nonsense"),
                        (oai(fleet, OTHER_KEY), r.id)):
        with pytest.raises(openai.NotFoundError) as e:
            client.responses.create(model=TEXT, input="Again?", previous_response_id=rid)
        assert e.value.body["code"] == "previous_response_not_found"
        assert e.value.body["param"] == "previous_response_id"
    # store=false keeps nothing to continue from.
    r = oai(fleet).responses.create(model=TEXT, input="Hello there.", max_output_tokens=2,
                                    store=False)
    with pytest.raises(openai.NotFoundError):
        oai(fleet).responses.create(model=TEXT, input="Again?", previous_response_id=r.id)


def test_responses_refusals_name_the_responses_parameter(fleet):
    c = oai(fleet)
    with pytest.raises(openai.BadRequestError) as e:  # refused by the backend, past the context
        c.responses.create(model=TEXT, input="Hello there.", max_output_tokens=10**6)
    assert e.value.body["code"] == "context_length_exceeded"
    assert e.value.body["param"] == "max_output_tokens"
    with pytest.raises(openai.BadRequestError) as e:  # refused by the translation
        c.responses.create(model=TEXT, input=[{"type": "message", "role": "user", "content": [
            {"type": "input_file", "file_id": "f"}]}])
    assert e.value.body["param"] == "input[0].content[0].type"
    with pytest.raises(openai.BadRequestError) as e:  # an image that is none: the proxy's 400
        c.responses.create(model=TEXT, input=[{"type": "message", "role": "user", "content": [
            {"type": "input_image", "image_url": "data:,"}]}])
    assert (e.value.body["param"], e.value.body["code"]) == ("input", "invalid_image")
    with pytest.raises(openai.BadRequestError) as e:  # an image, to a text model: the backend's
        c.responses.create(model=TEXT, input=[{"type": "message", "role": "user", "content": [
            {"type": "input_image", "image_url": image_url(1)}]}])
    assert (e.value.body["param"], e.value.body["code"]) == ("input", "images_unsupported")
    with pytest.raises(openai.BadRequestError) as e:  # hosted tools are ignored, but not here
        c.responses.create(model=TEXT, input="Hi", tools=[
            {"type": "namespace", "name": "ns", "tools": [{"type": "web_search"}]}])
    assert e.value.body["param"] == "tools[0].tools[0].type"


def test_stored_responses_hold_no_prompt_text_in_redis(fleet):
    phrase = "violet-octopus-" + uuid.uuid4().hex[:8]
    r = oai(fleet).responses.create(model=TEXT, instructions=f"Remember the {phrase}.",
                                    input=f"What is the {phrase}?", max_output_tokens=2)
    r2 = oai(fleet).responses.create(model=TEXT, previous_response_id=r.id, input="Go on.",
                                     max_output_tokens=2)
    assert r2.status == "incomplete"
    client = redis_py.Redis.from_url(fleet["redis"].url)
    try:
        stored = list(client.scan_iter("kvr:resp:*"))
        assert stored
        for key in client.scan_iter("*"):
            assert phrase.encode() not in key
            if client.type(key) == b"string":
                assert phrase.encode() not in client.get(key)
    finally:
        client.close()


# -- the Messages API --------------------------------------------------------------------


def test_messages_create_second_turn_hits_and_sticks(fleet):
    c = claude(fleet)
    system = system_prompt()
    messages = [{"role": "user", "content": "Hello there."}]
    raw = c.messages.with_raw_response.create(model=TEXT, max_tokens=64, system=system,
                                              messages=messages)
    m1, backend = raw.parse(), raw.headers["x-kvroute-backend"]
    assert m1.type == "message" and m1.role == "assistant" and m1.id.startswith("msg_")
    assert m1.content[0].type == "text" and m1.content[0].text == DEMO_REPLY
    assert m1.stop_reason == "end_turn" and m1.stop_sequence is None
    assert m1.usage.cache_creation_input_tokens == 0
    messages += [{"role": "assistant", "content": m1.content},
                 {"role": "user", "content": [{"type": "text", "text": "Tell me more.",
                                               "cache_control": {"type": "ephemeral"}}]}]
    # Bearer auth this time (ANTHROPIC_AUTH_TOKEN), system as cached text blocks.
    raw = claude(fleet, bearer=True).messages.with_raw_response.create(
        model=TEXT, max_tokens=64, messages=messages,
        system=[{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        extra_headers={"anthropic-version": "2023-06-01"})
    m2 = raw.parse()
    assert raw.headers["x-kvroute-backend"] == backend
    u = m2.usage
    assert half_cached(u.cache_read_input_tokens, u.input_tokens + u.cache_read_input_tokens), u


def test_messages_stream_second_turn_hits_and_sticks(fleet):
    c = claude(fleet)
    system = system_prompt()
    messages = [{"role": "user", "content": "Hello there."}]
    with c.messages.stream(model=TEXT, max_tokens=64, system=system, messages=messages) as stream:
        backend = stream.response.headers["x-kvroute-backend"]
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if not e.type in ("text",)]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[-2] == "message_delta" and "content_block_start" in kinds
    assert final.content[0].text == DEMO_REPLY and final.stop_reason == "end_turn"
    assert final.usage.output_tokens > 0
    messages += [{"role": "assistant", "content": final.content},
                 {"role": "user", "content": "Tell me more."}]
    with c.messages.stream(model=TEXT, max_tokens=64, system=system, messages=messages) as stream:
        assert stream.response.headers["x-kvroute-backend"] == backend
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == DEMO_REPLY
    u = final.usage
    assert half_cached(u.cache_read_input_tokens, u.input_tokens + u.cache_read_input_tokens), u


def test_messages_tool_use_round_trip(fleet):
    c = claude(fleet)
    system = system_prompt()
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    raw = c.messages.with_raw_response.create(model=TOOL, max_tokens=64, system=system,
                                              tools=TOOL_MSG, messages=messages)
    m1, backend = raw.parse(), raw.headers["x-kvroute-backend"]
    assert m1.stop_reason == "tool_use"
    (use,) = m1.content
    assert use.type == "tool_use" and use.name == "get_weather"
    assert use.input == DEMO_TOOL_CALL["arguments"]
    messages += [{"role": "assistant", "content": m1.content},
                 {"role": "user", "content": [
                     {"type": "tool_result", "tool_use_id": use.id,
                      "content": [{"type": "text", "text": "18 C, sunny"}]}]}]
    # Streamed this time: the call arrives as an input_json_delta.
    with c.messages.stream(model=TOOL, max_tokens=64, system=system, tools=TOOL_MSG,
                           messages=messages) as stream:
        assert stream.response.headers["x-kvroute-backend"] == backend
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert deltas == ["input_json_delta"]
    assert final.stop_reason == "tool_use"
    assert final.content[0].type == "tool_use" and final.content[0].input == DEMO_TOOL_CALL["arguments"]
    u = final.usage
    assert half_cached(u.cache_read_input_tokens, u.input_tokens + u.cache_read_input_tokens), u


def test_messages_stop_reasons(fleet):
    c = claude(fleet)
    messages = [{"role": "user", "content": "Hello there."}]
    m = c.messages.create(model=TEXT, max_tokens=64, messages=messages, stop_sequences=["demo"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "demo"
    assert m.content[0].text == DEMO_REPLY[:DEMO_REPLY.index("demo")]
    m = c.messages.create(model=TEXT, max_tokens=3, messages=messages,
                          extra_body={"temperature": 0.5, "top_p": 0.9},
                          metadata={"user_id": "u-1"})
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3
    with c.messages.stream(model=TEXT, max_tokens=64, messages=messages,
                           stop_sequences=["kvroute"]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "kvroute"


def test_count_tokens_matches_what_create_reports(fleet):
    c = claude(fleet)
    kw = {"model": TOOL, "system": system_prompt(), "tools": TOOL_MSG,
          "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    counted = c.messages.count_tokens(**kw).input_tokens
    m = c.messages.create(max_tokens=16, **kw)
    assert counted == m.usage.input_tokens + m.usage.cache_read_input_tokens > 0


def test_chat_then_messages_share_one_cache(fleet):
    system = system_prompt()
    raw = oai(fleet).chat.completions.with_raw_response.create(
        model=TEXT, messages=[{"role": "system", "content": system},
                              {"role": "user", "content": "Hello there."}])
    chat, backend = raw.parse(), raw.headers["x-kvroute-backend"]
    reply = chat.choices[0].message.content
    raw = claude(fleet).messages.with_raw_response.create(
        model=TEXT, max_tokens=64, system=system,
        messages=[{"role": "user", "content": "Hello there."},
                  {"role": "assistant", "content": reply},
                  {"role": "user", "content": "Tell me more."}])
    m = raw.parse()
    assert raw.headers["x-kvroute-backend"] == backend
    u = m.usage
    assert u.cache_read_input_tokens >= chat.usage.prompt_tokens, (u, chat.usage)
    assert half_cached(u.cache_read_input_tokens, u.input_tokens + u.cache_read_input_tokens)


def test_messages_errors_take_anthropics_envelope(fleet):
    with pytest.raises(anthropic.AuthenticationError) as e:
        claude(fleet, key="wrong").messages.create(model=TEXT, max_tokens=4,
                                                   messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        claude(fleet).messages.create(model="no-such-model", max_tokens=4,
                                      messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    url = fleet["proxy"].url
    for body in ({"model": TEXT, "messages": [{"role": "user", "content": "Hi"}]},  # no max_tokens
                 {"model": TEXT, "max_tokens": 4, "messages": [{"role": "tool", "content": "x"}]},
                 {"model": TEXT, "max_tokens": 4, "messages": [
                     {"role": "user", "content": [{"type": "image", "source": {}}]}]}):
        status, _, data = request(url + "/v1/messages", "POST", body, headers={"x-api-key": KEY})
        assert status == 400, data
        err = json.loads(data)
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
        assert set(err["error"]) == {"type", "message"} and err["error"]["message"]
    status, _, data = request(url + "/v1/messages/nothing-here", "POST", {},
                              headers={"x-api-key": KEY})
    assert status == 404 and json.loads(data)["error"]["type"] == "not_found_error"


def named_events(data: bytes) -> list[tuple[str, dict]]:
    return [(block.split(b"\n")[0][7:].decode(), json.loads(block.split(b"\ndata: ", 1)[1]))
            for block in data.split(b"\n\n") if block.startswith(b"event: ")]


def test_a_generation_failure_ends_each_stream_with_its_error_event(fleet):
    # The backend fails inside its third decode step (testing-only kvroute_fault, which
    # the translations pass on as the chat endpoint does): after the 200 and some text.
    url, fault = fleet["proxy"].url, "decode_error:3"
    status, _, data = request(url + "/v1/responses", "POST", {
        "model": TEXT, "input": "Hello there.", "stream": True, "kvroute_fault": fault},
        headers={"Authorization": f"Bearer {KEY}"})
    events = named_events(data)
    assert status == 200 and [n for n, _ in events][-2:] == ["error", "response.failed"], events
    assert "response.output_text.delta" in [n for n, _ in events]
    assert events[-1][1]["response"]["status"] == "failed"
    assert events[-1][1]["response"]["error"]["message"]
    status, _, data = request(url + "/v1/messages", "POST", {
        "model": TEXT, "max_tokens": 64, "stream": True, "kvroute_fault": fault,
        "messages": [{"role": "user", "content": "Hello there."}]}, headers={"x-api-key": KEY})
    events = named_events(data)
    assert status == 200 and events[-1][0] == "error", events
    assert events[-1][1] == {"type": "error", "error": {"type": "api_error",
                                                        "message": events[-1][1]["error"]["message"]}}
    # Not streamed: the failure is the answer's status, in each API's envelope.
    with pytest.raises(openai.InternalServerError):
        oai(fleet).responses.create(model=TEXT, input="Hello there.",
                                    extra_body={"kvroute_fault": fault})
    with pytest.raises(anthropic.InternalServerError) as e:
        claude(fleet).messages.create(model=TEXT, max_tokens=64, extra_body={"kvroute_fault": fault},
                                      messages=[{"role": "user", "content": "Hello there."}])
    assert e.value.body["error"]["type"] == "api_error"
    # Nothing was harmed: the same requests without the fault succeed.
    assert oai(fleet).responses.create(model=TEXT, input="Hello there.").output_text == DEMO_REPLY


# -- the proxy around them ------------------------------------------------------------------


def test_requests_are_counted_per_api(fleet):
    url = fleet["proxy"].url
    apis = get_json(url + "/stats", headers={"Authorization": f"Bearer {OPERATOR_KEY}"})["apis"]
    assert {"chat", "responses", "messages"} <= set(apis), apis
    assert all(apis[a]["requests"] >= 1 for a in ("chat", "responses", "messages"))
    assert apis["messages"]["errors"] >= 1  # the refused ones count too
    _, _, metrics = request(url + "/metrics")
    for api in ("chat", "responses", "messages"):
        assert f'kvroute_proxy_api_requests_total{{api="{api}",status="200"}}' in metrics.decode()


def test_openapi_lists_the_agent_endpoints(fleet):
    paths = get_json(fleet["proxy"].url + "/openapi.json")["paths"]
    assert {"/v1/responses", "/v1/messages", "/v1/messages/count_tokens"} <= set(paths)

"""Edges of the Responses API where kvroute must answer as OpenAI does: a truncated
answer's message item, the input items of a stored response
(`GET /v1/responses/{id}/input_items`), the output text's logprobs
(`include: ["message.output_text.logprobs"]`, `top_logprobs`), and an assistant's
refusal replayed in the input.

One fleet (Redis, a backend of each demo model, a proxy with two API keys) and the
official `openai` client; answers are also checked against the SDK's own types.
"""

from __future__ import annotations

import json
import uuid

import jsonschema_rs
import openai
import pytest
from openai.types.responses import Response, ResponseItem, ResponseStreamEvent
from openai.types.responses.response_item_list import ResponseItemList
from pydantic import TypeAdapter

from tests.harness import request
# The Codex tests' fleet (Redis, a backend of each demo model, a proxy with two API
# keys, one per team), started again for this module.
from tests.test_responses_codex import KEY, OTHER_KEY, TEXT, TOOL, fleet, oai  # noqa: F401

from kvroute.api.responses import ResponsesBody
from kvroute.devtools.demo_model import DEMO_REPLY
from kvroute.proxy.agents import responses as responses_api

LOGPROBS = "message.output_text.logprobs"
WEATHER = [{"type": "function", "name": "get_weather", "description": "Current weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
EVENTS = TypeAdapter(ResponseStreamEvent)
ITEMS = TypeAdapter(ResponseItem)


def nonce() -> str:
    # Keeps a test's conversation apart from every other test's cache entries.
    return f"{uuid.uuid4().hex}: you help a team of engineers with their code."


def get(url: str, path: str, key: str = KEY) -> tuple[int, dict]:
    status, _, data = request(url + path, headers={"Authorization": f"Bearer {key}"})
    return status, json.loads(data)


def post_stream(url: str, body: dict) -> list:
    """The events of a streamed create over raw HTTP, each validated as the SDK's type."""
    status, _, data = request(url + "/v1/responses", "POST", {**body, "stream": True},
                              headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200, data[:500]
    events = []
    for block in data.split(b"\n\n"):
        if block.startswith(b"event: "):
            events.append(EVENTS.validate_python(json.loads(block.split(b"\n", 1)[1][6:])))
    return events


# -- 1. a truncated answer's message item is incomplete ----------------------------------------


def test_truncated_message_item_is_incomplete_whole_streamed_and_stored(fleet):
    c = oai(fleet)
    r = c.responses.create(model=TEXT, instructions=nonce(), input="Hello there.",
                           max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [(o.type, o.status) for o in r.output] == [("message", "incomplete")]
    assert r.output_text and DEMO_REPLY.startswith(r.output_text)
    stored = c.responses.retrieve(r.id)
    assert stored.status == "incomplete" and stored.output[0].status == "incomplete"

    events = list(c.responses.create(model=TEXT, instructions=nonce(), input="Hello there.",
                                     max_output_tokens=3, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.type, i.status) for i in done] == [("message", "incomplete")]
    assert done[0].content[0].text == events[-1].response.output_text
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output[0].status == "incomplete"
    assert c.responses.retrieve(events[-1].response.id).output[0].status == "incomplete"

    # An answer that ended by itself stays completed.
    whole = c.responses.create(model=TEXT, instructions=nonce(), input="Hello there.")
    assert whole.status == "completed" and whole.output[0].status == "completed"


# -- 2. GET /v1/responses/{id}/input_items ------------------------------------------------------


def _conversation(c: openai.OpenAI) -> tuple[Response, Response, list[dict]]:
    """Two stored turns, the second continuing the first; the first's input items."""
    first = [{"type": "message", "id": "msg_client_1", "role": "developer",
              "content": "Answer briefly."},
             {"role": "user", "content": [{"type": "input_text", "text": nonce()}]}]
    r1 = c.responses.create(model=TEXT, instructions=nonce(), input=first,
                            include=[LOGPROBS])
    r2 = c.responses.create(model=TEXT, previous_response_id=r1.id, input="Tell me more.")
    return r1, r2, first


def test_input_items_list_a_stored_responses_inputs_as_openai_does(fleet):
    c = oai(fleet)
    r1, r2, first = _conversation(c)
    # The SDK's own call pages through them (newest first, as OpenAI's default).
    listed = list(c.responses.input_items.list(r2.id))
    assert [i.type for i in listed] == ["message"] * 4
    assert [i.role for i in listed] == ["user", "assistant", "user", "developer"]
    assert listed[0].content[0].type == "input_text"
    assert listed[0].content[0].text == "Tell me more."
    assert listed[1].id == r1.output[0].id and listed[1].content[0].text == r1.output_text
    assert listed[2].content[0].text == first[1]["content"][0]["text"]
    assert listed[3].id == "msg_client_1"  # the client's own id is kept
    assert listed[3].content[0].text == "Answer briefly."  # a string became a text part
    assert all(i.id and i.status == "completed" for i in listed)
    assert len({i.id for i in listed}) == 4

    # The list object, strictly as the SDK types it, and its items one by one.
    status, body = get(fleet, f"/v1/responses/{r2.id}/input_items")
    assert status == 200
    page = ResponseItemList.model_validate(body)
    assert page.object == "list" and not page.has_more
    assert (page.first_id, page.last_id) == (listed[0].id, listed[-1].id)
    for item in body["data"]:
        ITEMS.validate_python(item)
    # The earlier output's logprobs only when asked for.
    assert body["data"][1]["content"][0]["logprobs"] == []
    status, body = get(fleet, f"/v1/responses/{r2.id}/input_items?include[]={LOGPROBS}")
    assert status == 200 and body["data"][1]["content"][0]["logprobs"]
    assert body["data"][1]["content"][0]["logprobs"] == \
        r1.output[0].content[0].model_dump()["logprobs"]

    # Oldest first, a page at a time, each starting after the last one's last id.
    ids, after = [], None
    while True:
        page = c.responses.input_items.list(r2.id, order="asc", limit=3,
                                            **({"after": after} if after else {}))
        ids += [i.id for i in page.data]
        if not page.has_more:
            break
        after = page.last_id
    assert ids == [i.id for i in reversed(listed)]
    first_page = c.responses.input_items.list(r2.id, order="asc", limit=3)
    assert first_page.has_more and first_page.first_id == ids[0]
    assert first_page.last_id == ids[2]
    # The first response's own: its input alone.
    assert [i.id for i in c.responses.input_items.list(r1.id, order="asc")] == ids[:2]

    # A third turn: r1's output is two responses back, its logprobs no longer kept (each
    # record would copy every earlier output's); r2's, the continued one's, are.
    r3 = c.responses.create(model=TEXT, previous_response_id=r2.id, input="And then?",
                            include=[LOGPROBS])
    r4 = c.responses.create(model=TEXT, previous_response_id=r3.id, input="Go on.")
    status, body = get(fleet, f"/v1/responses/{r4.id}/input_items?order=asc&include[]={LOGPROBS}")
    outputs = [i for i in body["data"] if i["role"] == "assistant"]
    assert [o["id"] for o in outputs] == [r1.output[0].id, r2.output[0].id, r3.output[0].id]
    assert [bool(o["content"][0]["logprobs"]) for o in outputs] == [False, False, True]


def test_input_items_of_unknown_unstored_or_foreign_responses_are_404(fleet):
    c = oai(fleet)
    unstored = c.responses.create(model=TEXT, input="Hello there.", max_output_tokens=2,
                                  store=False)
    stored = c.responses.create(model=TEXT, input="Hello there.", max_output_tokens=2)
    for client, rid in ((c, "resp_" + "0" * 32), (c, "nonsense"), (c, unstored.id),
                        (oai(fleet, OTHER_KEY), stored.id)):
        with pytest.raises(openai.NotFoundError) as e:
            client.responses.input_items.list(rid)
        assert e.value.body["code"] == "response_not_found"
        assert e.value.body["param"] == "response_id"
    # A deleted one too.
    c.responses.delete(stored.id)
    status, body = get(fleet, f"/v1/responses/{stored.id}/input_items")
    assert status == 404 and set(body["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("query,param", [
    ("limit=0", "limit"), ("limit=101", "limit"), ("limit=x", "limit"), ("limit=%C2%B2", "limit"),
    ("limit=" + "9" * 5000, "limit"), ("order=up", "order"), ("after=msg_nowhere", "after"),
])
def test_input_items_refuse_bad_query_parameters(fleet, query, param):
    r = oai(fleet).responses.create(model=TEXT, input="Hello there.", max_output_tokens=2)
    status, body = get(fleet, f"/v1/responses/{r.id}/input_items?{query}")
    assert status == 400, body
    assert body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error"


def test_input_items_are_described(fleet):
    status, spec = get(fleet, "/openapi.json")
    op = spec["paths"]["/v1/responses/{response_id}/input_items"]["get"]
    assert {p["name"] for p in op["parameters"]} == {"response_id", "limit", "order", "after",
                                                      "include"}
    assert {"200", "400", "404"} <= set(op["responses"])


# -- 3. the output text's logprobs --------------------------------------------------------------


def _same(got: list, expected: list) -> bool:
    """The same tokens with the same logprobs (to float precision)."""
    return [lp.token for lp in got] == [lp.token for lp in expected] and \
        [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in expected])


def _own_bytes(token: str, data: list[int]) -> bool:
    # A token that is part of a character decodes alone to U+FFFD: its bytes are its own.
    return "\ufffd" in token or data == list(token.encode())


def _check_logprobs(logprobs: list, top: int) -> None:
    assert logprobs
    for lp in logprobs:
        assert lp.logprob <= 0 and _own_bytes(lp.token, lp.bytes)
        assert len(lp.top_logprobs) == top
        assert all(t.logprob <= 0 and _own_bytes(t.token, t.bytes) for t in lp.top_logprobs)


def test_include_logprobs_fills_the_output_text_as_chat_does(fleet):
    c = oai(fleet)
    system = nonce()
    r = c.responses.create(model=TEXT, instructions=system, input="Hello there.",
                           include=[LOGPROBS], top_logprobs=2)
    assert r.output_text == DEMO_REPLY
    part = r.output[0].content[0]
    _check_logprobs(part.logprobs, 2)
    # The same conversation as a chat completion: the same tokens, the same figures.
    chat = c.chat.completions.create(model=TEXT, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": "Hello there."}],
        logprobs=True, top_logprobs=2)
    assert _same(part.logprobs, chat.choices[0].logprobs.content)
    # As stored.
    assert c.responses.retrieve(r.id).output[0].content[0].logprobs == part.logprobs
    # Without top_logprobs, none of the alternatives; without the include, no logprobs
    # (top_logprobs alone asks for none, as on OpenAI's API).
    _check_logprobs(c.responses.create(model=TEXT, input="Hello there.", include=[LOGPROBS])
                    .output[0].content[0].logprobs, 0)
    for extra in ({}, {"top_logprobs": 5}):
        plain = c.responses.create(model=TEXT, input="Hello there.", **extra)
        assert plain.output[0].content[0].logprobs == []


def test_include_logprobs_streams_them_with_each_delta(fleet):
    body = {"model": TEXT, "instructions": nonce(), "input": "Hello there.",
            "include": [LOGPROBS], "top_logprobs": 3}
    events = post_stream(fleet, body)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(d.delta for d in deltas) == DEMO_REPLY
    streamed = [lp for d in deltas for lp in d.logprobs]
    assert streamed and all(len(lp.top_logprobs) == 3 for lp in streamed)
    assert all(d.logprobs for d in deltas)  # each text delta carries its tokens'
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [lp.model_dump() for lp in done.logprobs] == [lp.model_dump() for lp in streamed]
    final = events[-1].response
    assert final.status == "completed"
    part = final.output[0].content[0]
    _check_logprobs(part.logprobs, 3)
    assert _same(part.logprobs, streamed)
    # The same request whole gives the same.
    whole = oai(fleet).responses.create(**body)
    assert _same(whole.output[0].content[0].logprobs, streamed)


def test_include_logprobs_with_a_tool_call_and_top_logprobs_bounds(fleet):
    c = oai(fleet)
    for stream in (False, True):
        r = c.responses.create(model=TOOL, input="Weather in Paris?", tools=WEATHER,
                               include=[LOGPROBS], top_logprobs=1, stream=stream)
        final = list(r)[-1].response if stream else r
        # The call's tokens are no text: no message item holds them.
        assert [o.type for o in final.output] == ["function_call"]
    for bad in (-1, 21, True, "3"):
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(model=TEXT, input="Hi", include=[LOGPROBS],
                               extra_body={"top_logprobs": bad})
        assert e.value.body["param"] == "top_logprobs"
    r = c.responses.create(model=TEXT, input="Hi", include=[LOGPROBS], top_logprobs=20,
                           max_output_tokens=2)
    _check_logprobs(r.output[0].content[0].logprobs, 20)


def _chunk(text: str = "", calls: list | None = None, tokens: tuple[str, ...] = ()) -> dict:
    delta: dict = {"content": text} if text else {}
    if calls:
        delta["tool_calls"] = calls
    entries = [{"token": t, "logprob": -0.5, "bytes": list(t.encode()), "top_logprobs": []}
               for t in tokens]
    return {"choices": [{"index": 0, "delta": delta,
                         "logprobs": {"content": entries} if entries else None}]}


CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{}"}}


# -- 4. an assistant's refusal in the input ----------------------------------------------------


def test_assistant_refusal_is_accepted_as_its_text(fleet):
    c = oai(fleet)
    system = nonce()
    items = [{"role": "user", "content": "Pick a lock for me."},
             {"type": "message", "role": "assistant", "id": "msg_refused", "status": "completed",
              "content": [{"type": "refusal", "refusal": "I can't help with that."}]},
             {"role": "user", "content": "Then say hello."}]
    r = c.responses.create(model=TEXT, instructions=system, input=items)
    assert r.status == "completed" and r.output_text == DEMO_REPLY
    # The model saw the refusal as the assistant's text: the chat body is the one a chat
    # conversation with that text has, so both route and hit alike.
    req = responses_api.parse({"model": TEXT, "instructions": system, "input": items})
    assert responses_api.chat_body(req, [])["messages"][2] == \
        {"role": "assistant", "content": "I can't help with that."}
    # Listed back as OpenAI lists an assistant's message.
    listed = c.responses.input_items.list(r.id, order="asc").data
    assert listed[1].id == "msg_refused" and listed[1].content[0].type == "refusal"
    assert listed[1].content[0].refusal == "I can't help with that."


@pytest.mark.parametrize("role", ["user", "system", "developer"])
def test_a_refusal_belongs_to_the_assistant_alone(fleet, role):
    items = [{"role": role, "content": [{"type": "input_text", "text": "x"},
                                        {"type": "refusal", "refusal": "No."}]}]
    with pytest.raises(openai.BadRequestError) as e:
        oai(fleet).responses.create(model=TEXT, input=items)
    assert e.value.body["param"] == "input[0].content[1].type"
    # The description refuses the same.
    body = {"model": TEXT, "input": items}
    assert not jsonschema_rs.validator_for(ResponsesBody.model_json_schema()).is_valid(body)
    body["input"][0]["role"] = "assistant"
    assert jsonschema_rs.validator_for(ResponsesBody.model_json_schema()).is_valid(body)
    responses_api.parse(body)  # and validation accepts it


@pytest.mark.parametrize("tools,param", [
    ([{"type": "function", "name": "get weather"}], "tools[0].name"),
    ([WEATHER[0], {"type": "custom", "name": "x" * 129}], "tools[1].name"),
    ([{"type": "namespace", "name": "mcp__files", "description": "files",
       "tools": [{"type": "function", "name": "read"}, {"type": "function", "name": "lis.t"}]}],
     "tools[0].tools[1].name"),
    # Each part fits; namespace and name together are past the 128 characters.
    ([{"type": "namespace", "name": "n" * 100, "description": "long",
       "tools": [{"type": "function", "name": "m" * 40}]}], "tools[0].tools[0].name"),
])
def test_a_bad_tool_name_names_the_responses_field(fleet, tools, param):
    with pytest.raises(openai.BadRequestError) as e:
        oai(fleet).responses.create(model=TEXT, input="hi", tools=tools)
    assert e.value.body["param"] == param and e.value.body["code"] == "invalid_value"
    assert "1-128 letters" in e.value.body["message"]

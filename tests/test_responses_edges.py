"""Edges of the Responses API where kvroute must answer as OpenAI does: a truncated
answer's message item, and the output text's logprobs
(`include: ["message.output_text.logprobs"]`, `top_logprobs`).

One fleet (Redis, a backend of each demo model, a proxy with two API keys) and the
official `openai` client; answers are also checked against the SDK's own types.
"""

from __future__ import annotations

import json
import uuid

import openai
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from tests import harness
from tests.harness import BackendProcess, ProxyProcess, request

from kvroute.devtools.demo_model import DEMO_REPLY
from kvroute.proxy.agents.reply import ChatReply

SECRET = "edges-secret"
TOKEN = "edges-internal-token"
KEY, OTHER_KEY = "sk-edges", "sk-edges-other"
TEXT, TOOL = "edges-text", "edges-tool"
LOGPROBS = "message.output_text.logprobs"
WEATHER = [{"type": "function", "name": "get_weather", "description": "Current weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def fleet(text_model, tool_model, tmp_path_factory, redis_server):
    logs = tmp_path_factory.mktemp("edges")
    common = ["--secret", SECRET, "--internal-token", TOKEN]

    def backends(redis_url: str) -> list[BackendProcess]:
        return [BackendProcess(text_model, TEXT, logs, backend_id="edges-text",
                               extra=["--redis-url", redis_url, *common]),
                BackendProcess(tool_model, TOOL, logs, backend_id="edges-tool",
                               extra=["--redis-url", redis_url, *common])]

    def proxies(redis_url: str) -> list[ProxyProcess]:
        return [ProxyProcess(redis_url, logs, [*common, "--api-key", f"{KEY}:team-a",
                                               "--api-key", f"{OTHER_KEY}:team-b"])]

    with harness.fleet(backends, proxies, redis_server.database()) as f:
        yield f["proxies"][0].url


def oai(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def nonce() -> str:
    # Keeps a test's conversation apart from every other test's cache entries.
    return f"{uuid.uuid4().hex}: you help a team of engineers with their code."


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


# -- 3. the output text's logprobs --------------------------------------------------------------


def _same(got: list, expected: list) -> bool:
    """The same tokens with the same logprobs (to float precision)."""
    return [lp.token for lp in got] == [lp.token for lp in expected] and \
        [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in expected])


def _check_logprobs(logprobs: list, top: int) -> None:
    assert logprobs
    for lp in logprobs:
        assert lp.logprob <= 0 and lp.bytes == list(lp.token.encode())
        assert len(lp.top_logprobs) == top
        assert all(t.logprob <= 0 and t.bytes == list(t.token.encode()) for t in lp.top_logprobs)


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


def test_text_logprobs_leave_out_a_calls_and_a_stop_strings_tokens():
    # Streamed: held-back tokens (no text yet) go to the text that follows them, or,
    # when a call follows, to the call.
    reply = ChatReply()
    for chunk in (_chunk("Sure", tokens=("Sure",)), _chunk(tokens=(",",)),
                  _chunk(", I", tokens=(" I",)), _chunk(tokens=("<tool",)),
                  _chunk(calls=[CALL], tokens=("_call>", "{}", "</tool_call>"))):
        reply.add(chunk)
    assert [e["token"] for e in reply.logprobs] == ["Sure", ",", " I"]
    assert reply.text == "Sure, I" and len(reply.tool_calls) == 1
    # A chunk with text and a call: the text's tokens are the first ones.
    reply = ChatReply()
    reply.add(_chunk("Ok", calls=[CALL], tokens=("O", "k", "<tool_call>", "{}")))
    assert [e["token"] for e in reply.logprobs] == ["O", "k"]

    # Whole: one list; a call's or a stop string's tokens come after the text's.
    def whole(message: dict, tokens: tuple[str, ...], **choice) -> ChatReply:
        entries = [{"token": t, "logprob": -1.0, "bytes": list(t.encode()), "top_logprobs": []}
                   for t in tokens]
        return ChatReply.from_completion(json.dumps({"choices": [{
            "message": message, "finish_reason": "stop", "logprobs": {"content": entries},
            **choice}]}).encode())

    r = whole({"content": "Hé", "tool_calls": [CALL]}, ("H", "é", "<tool_call>", "{}"))
    assert [e["token"] for e in r.logprobs] == ["H", "é"]
    r = whole({"content": "Hi"}, ("H", "i", "STOP"), stop_reason="STOP")
    assert [e["token"] for e in r.logprobs] == ["H", "i"]
    r = whole({"content": "Hi"}, ("H", "i"))
    assert [e["token"] for e in r.logprobs] == ["H", "i"]
    assert whole({"content": "Hi"}, ()).logprobs == []

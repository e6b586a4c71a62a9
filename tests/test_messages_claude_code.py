"""What the real Claude Code sends, end to end through the proxy's Messages API.

tests/data/claude_code_request.json is Claude Code 2.1.332's first request (`claude -p`
with a non-Claude model name), trimmed: `?beta=true` and its `anthropic-beta` list,
system text blocks with `cache_control` (the first one its billing line), an
environment section as a `system` message after the first user turn, client tools
(one deferred), `thinking` adaptive, `context_management`, `output_config`. It must be
answered, streamed and not, and its second turn must read nearly all of its prompt
from the cache. Every refusal Anthropic's API also makes is checked for its status,
type and wording, since clients act on those words (Claude Code compacts on `prompt is
too long`, resends without mid-conversation system messages on `role 'system' is not
supported`).

Real parts only: a redis-server, `kvroute backend` processes (the text demo model, the
tool-calling one, and the text model under a stricter chat template that renders
system messages only first, as some real templates do), one proxy with an API key,
the official `anthropic` client.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import uuid
from pathlib import Path

import anthropic
import pytest
from tests import harness
from tests.harness import BackendProcess, ProxyProcess, request

from kvroute.devtools.demo_model import DEMO_REPLY, DEMO_TOOL_CALL, MAX_POSITIONS

KEY = "sk-claude-code"
TEXT, TOOL, STRICT = "cc-text", "cc-tool", "cc-strict"
CAPTURE = json.loads((Path(__file__).parent / "data" / "claude_code_request.json").read_text())
# Like Qwen-style templates that refuse a system message anywhere but first.
STRICT_CHECK = ("{%- for message in messages -%}{%- if message.role == 'system' and not "
                "loop.first -%}{{- raise_exception('System message must be at the beginning.') "
                "-}}{%- endif -%}{%- endfor -%}")


def strict_copy(model: Path, into: Path) -> Path:
    """The demo text model with STRICT_CHECK ahead of its chat template."""
    out = into / "strict-model"
    shutil.copytree(model, out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = STRICT_CHECK + config["chat_template"]
    config_path.write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def fleet(text_model, tool_model, tmp_path_factory, redis_server):
    logs = tmp_path_factory.mktemp("claude-code")
    strict = strict_copy(text_model, tmp_path_factory.mktemp("strict"))

    def backends(redis_url: str) -> list[BackendProcess]:
        common = ["--redis-url", redis_url]
        return [BackendProcess(text_model, TEXT, logs, backend_id="cc-text", extra=common),
                BackendProcess(tool_model, TOOL, logs, backend_id="cc-tool", extra=common),
                BackendProcess(strict, STRICT, logs, backend_id="cc-strict", extra=common)]

    def proxies(redis_url: str) -> list[ProxyProcess]:
        return [ProxyProcess(redis_url, logs, ["--api-key", f"{KEY}:claude-code"])]

    with harness.fleet(backends, proxies, redis_server.database()) as f:
        yield {**f, "proxy": f["proxies"][0]}


def claude_code_body(model: str = TEXT) -> dict:
    """The captured body, for `model`, its first user text made unique: each test's
    conversation is its own (the system prompt and tools, as for Claude Code, shared)."""
    body = copy.deepcopy(CAPTURE["body"])
    body["model"] = model
    body["messages"][0]["content"][-1]["text"] = f"say hi ({uuid.uuid4().hex})"
    return body


def claude_code_client(fleet) -> anthropic.Anthropic:
    # Claude Code's own headers, and its key as ANTHROPIC_AUTH_TOKEN (Bearer).
    headers = {k: v for k, v in CAPTURE["headers"].items() if k != "anthropic-beta"}
    return anthropic.Anthropic(base_url=fleet["proxy"].url, auth_token=KEY, max_retries=0,
                               default_headers=headers)


def betas() -> list[str]:
    return CAPTURE["headers"]["anthropic-beta"].split(",")


def create(fleet, body: dict, **kw):
    """messages.create through the SDK's beta resource: `?beta=true` and the
    anthropic-beta header, as Claude Code calls it."""
    return claude_code_client(fleet).beta.messages.create(**{**body, **kw}, betas=betas())


def post(fleet, body: dict, path: str = CAPTURE["path"],
         headers: dict | None = None) -> tuple[int, dict, bytes]:
    """The body over plain HTTP with Claude Code's path and headers."""
    return request(fleet["proxy"].url + path, "POST", body,
                   headers={**CAPTURE["headers"], "Authorization": f"Bearer {KEY}",
                            **(headers or {})})


def events_of(data: bytes) -> list[tuple[str, dict]]:
    return [(block.split(b"\n")[0][7:].decode(), json.loads(block.split(b"\ndata: ", 1)[1]))
            for block in data.split(b"\n\n") if block.startswith(b"event: ")]


def cached_share(usage) -> float:
    prompt = usage.input_tokens + usage.cache_read_input_tokens
    return usage.cache_read_input_tokens / prompt if prompt else 0.0


def next_turn(body: dict, reply_content: list, text: str) -> dict:
    """The body of the next turn, as Claude Code builds it: the reply appended as it
    came, a new user message; the billing line's hash changed (some Claude Code
    versions change it on every request)."""
    body = copy.deepcopy(body)
    body["system"][0]["text"] = ("x-anthropic-billing-header: cc_version=2.1.332.0b8; "
                                 f"cc_entrypoint=sdk-cli; cch={uuid.uuid4().hex[:5]};")
    body["messages"] += [{"role": "assistant", "content": reply_content},
                         {"role": "user", "content": [{"type": "text", "text": text}]}]
    return body


def blocks(message) -> list[dict]:
    return [b.model_dump(exclude_none=True) for b in message.content]


# -- the captured request ---------------------------------------------------------------------


def test_the_captured_request_is_answered_as_a_stream(fleet):
    # Byte for byte as Claude Code sends it: path with ?beta=true, its headers, stream on.
    status, headers, data = post(fleet, claude_code_body())
    assert status == 200, data[:500]
    assert headers["Content-Type"].startswith("text/event-stream")
    events = events_of(data)
    kinds = [kind for kind, _ in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    text = "".join(e["delta"]["text"] for kind, e in events if kind == "content_block_delta")
    assert text == DEMO_REPLY
    assert events[-2][1]["delta"]["stop_reason"] == "end_turn"
    # And through the SDK's stream, as Claude Code reads it.
    stream = create(fleet, claude_code_body())
    final = [e for e in stream if e.type == "message_delta"][-1]
    assert final.delta.stop_reason == "end_turn" and final.usage.output_tokens > 0


def test_the_captured_request_whole_then_its_second_turn_reads_the_cache(fleet):
    body = claude_code_body()
    raw = claude_code_client(fleet).beta.messages.with_raw_response.create(
        **{**body, "stream": False}, betas=betas())
    first, backend = raw.parse(), raw.headers["x-kvroute-backend"]
    assert first.content[0].type == "text" and first.content[0].text == DEMO_REPLY
    assert first.stop_reason == "end_turn" and first.usage.cache_creation_input_tokens == 0
    # count_tokens counts what create reported as its input (uncached + cached).
    counted = claude_code_client(fleet).beta.messages.count_tokens(
        model=body["model"], system=body["system"], messages=body["messages"],
        tools=body["tools"], thinking=body["thinking"], betas=betas())
    assert counted.input_tokens == first.usage.input_tokens + first.usage.cache_read_input_tokens
    # The second turn, streamed as Claude Code streams it.
    second = next_turn(body, blocks(first), "thanks, now say bye")
    with claude_code_client(fleet).beta.messages.stream(
            **{k: v for k, v in second.items() if k != "stream"}, betas=betas()) as stream:
        assert stream.response.headers["x-kvroute-backend"] == backend
        final = stream.get_final_message()
    assert final.content[0].text == DEMO_REPLY
    assert cached_share(final.usage) >= 0.8, final.usage


def test_a_mid_conversation_system_message_stays_where_it_stands(fleet):
    # The chat completion of the same conversation, its system message at the same
    # place, fills the cache that the Messages request then reads: both are one body.
    body = claude_code_body()
    system = "\n\n".join(b["text"] for b in body["system"][1:])
    user = "\n\n".join(b["text"] for b in body["messages"][0]["content"])
    environment = body["messages"][1]["content"][0]["text"]
    chat = {"model": TEXT, "max_tokens": 64, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": user},
        {"role": "system", "content": environment}]}
    status, headers, data = request(fleet["proxy"].url + "/v1/chat/completions", "POST", chat,
                                    headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200, data[:500]
    completion = json.loads(data)
    body = {**{k: v for k, v in body.items() if k != "tools"}, "stream": False}
    second = next_turn(body, [{"type": "text",
                               "text": completion["choices"][0]["message"]["content"]}],
                       "Tell me more.")
    raw = claude_code_client(fleet).beta.messages.with_raw_response.create(**second,
                                                                           betas=betas())
    assert raw.headers["x-kvroute-backend"] == headers["x-kvroute-backend"]
    usage = raw.parse().usage
    assert usage.cache_read_input_tokens >= completion["usage"]["prompt_tokens"], usage


def test_fields_claude_code_may_send_are_accepted(fleet):
    body = claude_code_body()
    extra = {"cache_control": {"type": "ephemeral"}, "strict": True, "eager_input_streaming": True,
             "input_examples": [{"command": "ls"}]}
    body["tools"] = [{**tool, **extra} for tool in body["tools"]]
    body["messages"][0]["content"][0]["citations"] = None
    body["messages"][0]["content"][-1]["cache_control"] = {"type": "ephemeral", "ttl": "1h"}
    for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"},
                     {"type": "adaptive", "display": "summarized"}):
        message = claude_code_client(fleet).beta.messages.create(
            **{**body, "stream": False, "thinking": thinking}, service_tier="auto",
            tool_choice={"type": "auto", "disable_parallel_tool_use": True},
            betas=[*betas(), "no-such-beta-2099-01-01"],
            extra_headers={"anthropic-version": "2099-12-31"},
            extra_body={"cache_control": {"type": "ephemeral"}})
        assert message.content[0].text == DEMO_REPLY, thinking
    status, _, data = post(fleet, {**body, "tool_choice": {"type": "none"}},
                           headers={"anthropic-beta": "whatever"})
    assert status == 200, data[:500]


def test_deferred_tools_and_past_thinking_are_not_in_the_prompt(fleet):
    body = claude_code_body()
    counted = claude_code_client(fleet).beta.messages.count_tokens

    def count(**changes) -> int:
        b = {**body, **changes}
        fields = {k: b[k] for k in ("model", "system", "messages", "tools") if b[k] is not None}
        return counted(**fields, betas=betas()).input_tokens

    # DeferredToolPlaceholder is deferred (`defer_loading`): the model never sees it.
    shown = [t for t in body["tools"] if not t.get("defer_loading")]
    assert len(shown) < len(body["tools"])
    assert count() == count(tools=shown)
    assert count(tools=[{**t, "defer_loading": True} for t in body["tools"]]) == count(tools=None)
    # An earlier turn's thinking blocks are dropped, as Anthropic drops them.
    history = [{"type": "text", "text": "Hello."}]
    thought = [{"type": "thinking", "thinking": "The user greets me.", "signature": "c2ln"},
               {"type": "redacted_thinking", "data": "ZW5jcnlwdGVk"}, *history]
    def turns(reply: list) -> list:
        return [*body["messages"], {"role": "assistant", "content": reply},
                {"role": "user", "content": "More."}]

    assert count(messages=turns(thought)) == count(messages=turns(history))


def test_tool_use_and_tool_result_round_trip(fleet):
    body = claude_code_body(TOOL)
    body["tools"] = [*body["tools"], {"name": DEMO_TOOL_CALL["name"], "description": "Weather",
                                      "input_schema": {"type": "object", "properties": {
                                          "city": {"type": "string"}}}}]
    raw = claude_code_client(fleet).beta.messages.with_raw_response.create(
        **{**body, "stream": False}, betas=betas())
    first, backend = raw.parse(), raw.headers["x-kvroute-backend"]
    assert first.stop_reason == "tool_use"
    (use,) = first.content
    assert use.type == "tool_use" and use.name == DEMO_TOOL_CALL["name"]
    assert use.input == DEMO_TOOL_CALL["arguments"] and use.id
    # Claude Code's answer: the result (an error here, as text blocks), then a reminder.
    second = next_turn(body, blocks(first), "<system-reminder>Keep going.</system-reminder>")
    second["messages"][-1]["content"].insert(0, {
        "type": "tool_result", "tool_use_id": use.id, "is_error": True,
        "content": [{"type": "text", "text": "the weather service is down"}]})
    with claude_code_client(fleet).beta.messages.stream(
            **{k: v for k, v in second.items() if k != "stream"}, betas=betas()) as stream:
        assert stream.response.headers["x-kvroute-backend"] == backend
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert deltas == ["input_json_delta"] and final.stop_reason == "tool_use"
    assert final.content[0].input == DEMO_TOOL_CALL["arguments"]
    assert cached_share(final.usage) >= 0.8, final.usage


# -- refusals, in Anthropic's words -------------------------------------------------------------


def refused(fleet, body: dict, status: int = 400) -> str:
    got, _, data = post(fleet, body)
    error = json.loads(data)
    assert got == status, error
    kind = {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert error == {"type": "error", "error": {"type": kind, "message": error["error"]["message"]}}
    return error["error"]["message"]


def with_message(body: dict, index: int, message: dict) -> dict:
    body = copy.deepcopy(body)
    body["messages"][index:index + 1] = [message]
    return body


# A real 1x1 PNG: the refusal is the text model's, not the image's.
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC")}}
DOCUMENT = {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                           "data": "notes"}}


@pytest.mark.parametrize("change,message", [
    (lambda b: with_message(b, 1, {"role": "tool", "content": "x"}),
     "messages.1.role: Input should be 'user', 'assistant' or 'system'"),
    (lambda b: {k: v for k, v in b.items() if k != "max_tokens"}, "max_tokens: Field required"),
    # (0 is taken: fill the prompt cache only, as Anthropic's API does; test_messages_edges.py)
    (lambda b: {**b, "max_tokens": -1},
     "max_tokens: Input should be greater than or equal to 0"),
    (lambda b: {**b, "max_tokens": "many"}, "max_tokens: Input should be a valid integer"),
    (lambda b: {k: v for k, v in b.items() if k != "model"}, "model: Field required"),
    (lambda b: with_message(b, 0, {"role": "user", "content": [{"type": "text", "text": "see"},
                                                                IMAGE]}),
     "The model 'cc-text' does not take images"),
    (lambda b: with_message(b, 0, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [DOCUMENT]}]}),
     "messages.0.content.0.content.0: document content is not supported on this model"),
    (lambda b: {**b, "messages": [b["messages"][0], {"role": "assistant", "content": [
        {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}}]},
        {"role": "user", "content": "go on"}]},
     "messages.1.content.0: 'server_tool_use' blocks are not supported"),
    (lambda b: {**b, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools.0.type: Tool type 'web_search_20250305' is not supported"),
    (lambda b: {**{k: v for k, v in b.items() if k != "tools"}, "tool_choice": {"type": "any"}},
     "tool_choice: A forced tool_choice ('any' or 'tool') needs 'tools'."),
    (lambda b: {**b, "tool_choice": {"type": "tool"}},
     "tool_choice.name: Field required"),
    (lambda b: {**b, "messages": [*b["messages"], {"role": "assistant", "content": "Sure"}]},
     "Prefilling assistant messages is not supported for this model."),
    (lambda b: {**b, "output_config": {"effort": "high", "format": {
        "type": "json_schema", "schema": {"type": "object", "properties": {
            "a": {"type": "string", "format": "no-such-format"}}}}}},
     "Constrained decoding cannot use the JSON schema: Unknown format: no-such-format"),
    # Found by the fuzzer: a block type that is no string crashed the refusal's wording.
    (lambda b: {**b, "system": [{"type": {}, "text": ""}]}, "system.0: "),
], ids=["role", "no-max_tokens", "max_tokens-negative", "max_tokens-type", "no-model", "image",
        "document-in-tool-result", "server-tool-block", "server-tool", "tool_choice-any",
        "tool_choice-tool", "prefill", "structured-output", "block-type-not-a-string"])
def test_body_refusals(fleet, change, message):
    assert refused(fleet, change(claude_code_body())).startswith(message)


def test_an_unknown_model_is_named(fleet):
    assert refused(fleet, claude_code_body("claude-opus-4-8"), 404) == "model: claude-opus-4-8"
    with pytest.raises(anthropic.NotFoundError) as e:
        claude_code_client(fleet).beta.messages.count_tokens(
            model="no-such-model", messages=[{"role": "user", "content": "Hi"}], betas=betas())
    assert e.value.body["error"] == {"type": "not_found_error", "message": "model: no-such-model"}


def test_past_the_context_the_numbers_are_anthropics(fleet):
    body = claude_code_body()
    long = with_message(body, 0, {"role": "user", "content": "word " * (2 * MAX_POSITIONS)})
    for stream in (True, False):  # refused before the first byte: a status, streamed or not
        message = refused(fleet, {**long, "stream": stream})
        m = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", message)
        assert m and int(m[1]) > int(m[2]) == MAX_POSITIONS, message
    message = refused(fleet, {**body, "max_tokens": MAX_POSITIONS})
    m = re.fullmatch(r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > "
                     r"(\d+), decrease input length or `max_tokens` and try again", message)
    assert m, message
    prompt, asked, context = map(int, m.groups())
    assert asked == MAX_POSITIONS and context == MAX_POSITIONS and 0 < prompt
    # What Claude Code then does: ask for what fits.
    fits = create(fleet, {**body, "stream": False, "max_tokens": context - prompt})
    assert fits.content[0].text == DEMO_REPLY


def test_a_template_that_refuses_system_messages_there_gets_claude_codes_fallback(fleet):
    body = claude_code_body(STRICT)
    message = refused(fleet, body)
    # The words Claude Code's fallback looks for ("role ... system", "not supported").
    assert message.startswith("messages.1: role 'system' is not supported on this model"), message
    assert "System message must be at the beginning" in message
    # Its fallback: the same turn with the system message's text as the user's.
    user, system = body["messages"]
    fallback = {**body, "messages": [{"role": "user", "content": [
        *user["content"], {"type": "text", "text": system["content"][0]["text"]}]}]}
    assert create(fleet, {**fallback, "stream": False}).content[0].text == DEMO_REPLY

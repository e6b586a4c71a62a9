"""Structured outputs and forced tool choice end to end, through the proxy, with the
libraries applications use: the OpenAI SDK's `parse()` (chat and Responses), LangChain's
`with_structured_output` in its three methods, the Anthropic SDK's forced tool use; and
the rest of the request surface an OpenAI app sends: the sampling extensions, `n` choices
sharing one prefill, `best_of` and `/v1/embeddings` refused saying why, the README's
example.

Real parts only: a redis-server on a free port, one `kvroute backend` with the tiny demo
model (random-weight-like bigram output: only the grammar makes it valid JSON, which is
the point), one proxy, real HTTP. Schemas bound their strings, numbers and arrays, so
that a model that never chooses to stop still completes them within max_tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Annotated, Literal

import anthropic
from tests import harness
import jsonschema_rs
import openai
import pydantic
import pytest
from tests.harness import BackendProcess, ProxyProcess, metric_sum, post_json, request

from kvroute.devtools.demo_model import DEMO_REPLY

README = Path(__file__).resolve().parent.parent / "README.md"

SECRET, TOKEN, KEY = "structured-secret", "structured-token", "unused"
MODEL = "kvroute-demo"  # the README example's model id
MAX = 800  # tokens: bounded schemas finish well within (whitespace runs are bounded too)


@pytest.fixture(scope="module")
def fleet(text_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("structured")

    def backends(redis_url: str) -> list[BackendProcess]:
        return [BackendProcess(text_model, MODEL, logs, backend_id="structured-1",
                               extra=["--redis-url", redis_url, "--secret", SECRET,
                                      "--internal-token", TOKEN])]

    def proxies(redis_url: str) -> list[ProxyProcess]:
        return [ProxyProcess(redis_url, logs, ["--secret", SECRET, "--internal-token", TOKEN])]

    with harness.fleet(backends, proxies) as f:
        yield f


@pytest.fixture
def proxy(fleet) -> ProxyProcess:
    return fleet["proxies"][0]


@pytest.fixture
def client(proxy) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key=KEY, max_retries=0)


def ask(text: str = "Tell me about someone.") -> list[dict]:
    # A nonce keeps each test's prompt its own in the cache.
    return [{"role": "system", "content": f"{uuid.uuid4().hex}: answer in JSON."},
            {"role": "user", "content": text}]


Short = Annotated[str, pydantic.Field(max_length=12)]


class Person(pydantic.BaseModel):
    name: Short
    age: int = pydantic.Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    tags: list[Annotated[str, pydantic.Field(max_length=8)]] = pydantic.Field(max_length=3)


class Pet(pydantic.BaseModel):
    kind: Literal["cat", "dog"]
    owner: Person | None


def valid(schema: dict, text: str) -> dict:
    value = json.loads(text)
    jsonschema_rs.validator_for(schema).validate(value)
    return value


# -- chat: response_format ----------------------------------------------------------------


def test_sdk_parse_returns_the_model(client):
    r = client.chat.completions.parse(model=MODEL, messages=ask(), response_format=Pet,
                                      max_tokens=MAX)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Pet)
    assert Pet.model_validate_json(choice.message.content) == choice.message.parsed


def test_sdk_parse_streaming(client):
    with client.chat.completions.stream(model=MODEL, messages=ask(), response_format=Person,
                                        max_tokens=MAX) as stream:
        deltas = [e for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert len(deltas) > 1  # streamed token by token, not held back
    assert final.choices[0].finish_reason == "stop"
    assert isinstance(final.choices[0].message.parsed, Person)


def test_free_rows_share_the_batch_unchanged(client):
    """Constrained and free requests decode together; a free row's answer is the one it
    gets alone (masks are per row)."""
    results: dict = {}

    def constrained(i: int) -> None:
        results[i] = client.chat.completions.parse(model=MODEL, messages=ask(),
                                                   response_format=Person, max_tokens=MAX)

    def free(i: int) -> None:
        results[i] = client.chat.completions.create(model=MODEL, messages=ask("Hi"),
                                                    max_tokens=60)

    threads = [threading.Thread(target=f, args=(i,))
               for i, f in enumerate([constrained, free, constrained, free])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 4
    assert all(isinstance(results[i].choices[0].message.parsed, Person) for i in (0, 2))
    assert all(results[i].choices[0].message.content == DEMO_REPLY for i in (1, 3))


@pytest.fixture(scope="module")
def close_bias(text_model) -> dict[str, int]:
    """logit_bias toward closing an object at once: any JSON object is valid, and the demo
    model, which never chooses to stop, would otherwise open a key (its `{"` token) and
    write it forever."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(text_model / "tokenizer.json"))
    texts = {i: tok.decode([i]) for i in range(tok.get_vocab_size())}
    return {**{str(i): -100 for i, t in texts.items() if t.startswith("{") and t != "{"},
            **{str(i): 100 for i, t in texts.items() if t == "}"}}


def test_json_object(client, close_bias):
    r = client.chat.completions.create(model=MODEL, messages=ask(), max_tokens=MAX,
                                       response_format={"type": "json_object"},
                                       logit_bias=close_bias)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


SUITE = {
    "nested_objects": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10},
                       "address": {"type": "object", "properties": {
                           "city": {"type": "string", "maxLength": 10},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                           "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "arrays": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                "minItems": 1, "maxItems": 3},
                       "scores": {"type": "array", "maxItems": 4,
                                  "items": {"type": "integer", "minimum": 0, "maximum": 100}}},
        "required": ["tags", "scores"], "additionalProperties": False},
    "enums_and_const": {
        "type": "object",
        "properties": {"status": {"enum": ["active", "inactive", "pending"]},
                       "level": {"type": "integer", "enum": [1, 2, 3]},
                       "kind": {"const": "person"}},
        "required": ["status", "level", "kind"], "additionalProperties": False},
    "anyOf": {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "string", "maxLength": 8},
                                           {"type": "integer", "minimum": -5, "maximum": 5},
                                           {"type": "null"}]}},
        "required": ["value"], "additionalProperties": False},
    "optional_properties": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                       "note": {"type": "string", "maxLength": 10},
                       "flag": {"type": "boolean"}},
        "required": ["id"], "additionalProperties": False},
    "refs": {
        "$defs": {"Item": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 6},
            "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}},
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"},
                                 "maxItems": 2}},
        "required": ["items"], "additionalProperties": False},
    # Formats of bounded length: a time's or date-time's fraction of a second has no
    # bound, and the demo model, once at a digit, counts on forever.
    "string_formats": {
        "type": "object",
        "properties": {"day": {"type": "string", "format": "date"},
                       "id": {"type": "string", "format": "uuid"}},
        "required": ["day", "id"], "additionalProperties": False},
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("name", list(SUITE))
def test_schema_suite(client, name, stream):
    schema = SUITE[name]
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    if stream:
        chunks = list(client.chat.completions.create(model=MODEL, messages=ask(), max_tokens=MAX,
                                                     response_format=fmt, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        r = client.chat.completions.create(model=MODEL, messages=ask(), max_tokens=MAX,
                                           response_format=fmt)
        text, reason = r.choices[0].message.content, r.choices[0].finish_reason
    assert reason == "stop", text
    valid(schema, text)


def test_a_schema_is_compiled_once(client, fleet):
    backend = fleet["backends"]["structured-1"]
    schema = {**SUITE["anyOf"], "description": uuid.uuid4().hex}  # a schema never seen
    fmt = {"type": "json_schema", "json_schema": {"name": "once", "schema": schema}}
    before = backend.health()["grammars"]
    for _ in range(3):
        r = client.chat.completions.create(model=MODEL, messages=ask(), max_tokens=MAX,
                                           response_format=fmt)
        valid(schema, r.choices[0].message.content)
    after = backend.health()["grammars"]
    assert after["misses"] == before["misses"] + 1 and after["hits"] == before["hits"] + 2
    assert after["cached"] <= after["capacity"]
    metrics = request(backend.url + "/metrics")[2].decode()
    assert metric_sum(metrics, "kvroute_backend_grammar_compiles_total", result="cached") >= 2
    assert metric_sum(metrics, "kvroute_backend_constrained_total", kind="json_schema") >= 3


def test_max_tokens_cuts_with_length(client):
    r = client.chat.completions.create(
        model=MODEL, messages=ask(), max_tokens=5,
        response_format={"type": "json_schema", "json_schema": {"name": "p",
                                                                "schema": SUITE["nested_objects"]}})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5


def test_a_schema_the_library_cannot_enforce_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=ask(), max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": {
                "type": "object", "properties": {"a": {"type": "string", "format": "ipv5"}}}}})
    error = e.value.body
    assert error["param"] == "response_format" and "ipv5" in error["message"], error


def test_turn_two_after_a_constrained_turn_is_cached(client):
    messages = ask()
    raw = client.chat.completions.with_raw_response.parse(
        model=MODEL, messages=messages, response_format=Person, max_tokens=MAX)
    r1 = raw.parse()
    assert isinstance(r1.choices[0].message.parsed, Person)
    turn2 = [*messages, {"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "And another one?"}]
    raw = client.chat.completions.with_raw_response.parse(
        model=MODEL, messages=turn2, response_format=Person, max_tokens=MAX)
    r2 = raw.parse()
    cached = r2.usage.prompt_tokens_details.cached_tokens
    # The first turn's prompt came from the cache, and its reply as far as the reply's
    # tokens are the ones its text tokenizes to again (the grammar may have led the demo
    # model to spell a piece in other tokens than the tokenizer would).
    assert cached > r1.usage.prompt_tokens, (r1.usage, r2.usage)
    assert raw.headers["x-kvroute-route-reason"] == "cache-hit"
    assert isinstance(r2.choices[0].message.parsed, Person)


# -- chat: forced tool choice -----------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                      "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "description": "Adds", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _check_calls(calls, names: set[str]) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.function.name in names
        valid(SCHEMAS[call.function.name], call.function.arguments)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("choice", ["required", "get_weather", "add"])
def test_forced_tool_choice_is_a_valid_call(client, choice, stream):
    tool_choice = choice if choice == "required" else {"type": "function",
                                                       "function": {"name": choice}}
    names = set(SCHEMAS) if choice == "required" else {choice}
    for _ in range(3):  # a new conversation each time: always valid, not once
        kw = dict(model=MODEL, messages=ask("What now?"), max_tokens=MAX, tools=TOOLS,
                  tool_choice=tool_choice, parallel_tool_calls=False)
        if stream:
            with client.chat.completions.stream(**kw) as s:
                final = s.get_final_completion()
        else:
            final = client.chat.completions.create(**kw)
        assert final.choices[0].finish_reason == "tool_calls"
        _check_calls(final.choices[0].message.tool_calls, names)
        assert len(final.choices[0].message.tool_calls) == 1


def test_a_forced_call_is_one_line_and_a_cut_one_says_length_without_markup(client):
    # Whitespace in a forced call is at most a space between tokens: the demo model,
    # which takes whitespace wherever the grammar allows it, spent hundreds of tokens
    # on indentation when a line break and 32 characters of it were allowed.
    kw = dict(model=MODEL, tools=TOOLS, parallel_tool_calls=False, temperature=0,
              tool_choice={"type": "function", "function": {"name": "add"}})
    whole = client.chat.completions.create(messages=ask("Add."), max_tokens=MAX, **kw)
    (call,) = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "tool_calls"
    assert "\n" not in call.function.arguments and "\t" not in call.function.arguments
    assert whole.usage.completion_tokens <= 60, whole.usage
    # Cut inside the call: "length", no call and none of the model's call markup as text.
    cut = client.chat.completions.create(messages=ask("Add."), max_tokens=6, **kw)
    assert cut.choices[0].finish_reason == "length"
    assert not cut.choices[0].message.tool_calls
    assert "<tool_call>" not in (cut.choices[0].message.content or "")
    chunks = list(client.chat.completions.create(messages=ask("Add."), max_tokens=6,
                                                 stream=True, **kw))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(d.tool_calls for d in deltas)
    assert "<tool_call>" not in "".join(d.content or "" for d in deltas)


def test_a_named_tool_that_is_not_given_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ask(), tools=TOOLS, max_tokens=5,
                                       tool_choice={"type": "function",
                                                    "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice"


# -- LangChain ----------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(proxy, method):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=proxy.url + "/v1", api_key=KEY, max_tokens=MAX,
                     max_retries=0)
    # strict: the tool's schema then refuses other properties, as Person does (without it,
    # an extra property is valid, and the demo model writes its name forever).
    out = llm.with_structured_output(Person, method=method, strict=True).invoke(ask())
    assert isinstance(out, Person)


def test_langchain_json_mode(proxy, close_bias):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=proxy.url + "/v1", api_key=KEY, max_tokens=MAX,
                     max_retries=0, logit_bias={int(t): b for t, b in close_bias.items()})
    out = llm.with_structured_output(None, method="json_mode").invoke(ask())
    assert isinstance(out, dict)


# -- the agent APIs -----------------------------------------------------------------------------


def test_responses_parse_and_forced_tool(client):
    r = client.responses.parse(model=MODEL, input="Someone?", text_format=Person,
                               max_output_tokens=MAX)
    assert r.status == "completed" and isinstance(r.output_parsed, Person)
    assert r.text.format.type == "json_schema"
    tools = [{"type": "function", "name": t["function"]["name"],
              "parameters": t["function"]["parameters"]} for t in TOOLS]
    for choice in ("required", {"type": "function", "name": "add"}):
        r = client.responses.create(model=MODEL, input="What now?", tools=tools,
                                    tool_choice=choice, max_output_tokens=MAX,
                                    parallel_tool_calls=False)
        calls = [o for o in r.output if o.type == "function_call"]
        assert len(calls) == 1, r.output
        assert choice == "required" or calls[0].name == "add"
        valid(SCHEMAS[calls[0].name], calls[0].arguments)


def test_responses_streaming_and_cut_short(client):
    with client.responses.stream(model=MODEL, input="Someone?", text_format=Person,
                                 max_output_tokens=MAX) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and isinstance(final.output_parsed, Person)
    tools = [{"type": "function", "name": "add", "parameters": SCHEMAS["add"]}]
    with client.responses.stream(model=MODEL, input="Sum?", tools=tools, tool_choice="required",
                                 max_output_tokens=MAX, parallel_tool_calls=False) as stream:
        final = stream.get_final_response()
    (call,) = [o for o in final.output if o.type == "function_call"]
    valid(SCHEMAS["add"], call.arguments)
    # Cut by max_output_tokens: incomplete, as any other answer.
    r = client.responses.create(model=MODEL, input="Someone?", max_output_tokens=4, text={
        "format": {"type": "json_schema", "name": "p", "schema": SUITE["nested_objects"]}})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def test_messages_forced_tool_use(proxy):
    claude = anthropic.Anthropic(base_url=proxy.url, api_key=KEY, max_retries=0)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    for choice in ({"type": "any", "disable_parallel_tool_use": True},
                   {"type": "tool", "name": "get_weather"}):
        for stream in (False, True):
            kw = dict(model=MODEL, max_tokens=MAX, tools=tools, tool_choice=choice,
                      messages=[{"role": "user", "content": f"{uuid.uuid4().hex} now?"}])
            if stream:
                with claude.messages.stream(**kw) as s:
                    msg = s.get_final_message()
            else:
                msg = claude.messages.create(**kw)
            assert msg.stop_reason == "tool_use", msg
            uses = [b for b in msg.content if b.type == "tool_use"]
            assert len(uses) == 1
            assert choice["type"] == "any" or uses[0].name == "get_weather"
            jsonschema_rs.validator_for(SCHEMAS[uses[0].name]).validate(uses[0].input)


def test_messages_structured_output(proxy):
    claude = anthropic.Anthropic(base_url=proxy.url, api_key=KEY, max_retries=0)
    schema = SUITE["nested_objects"]
    msg = claude.messages.create(model=MODEL, max_tokens=MAX,
                                 messages=[{"role": "user", "content": f"{uuid.uuid4().hex}"}],
                                 extra_body={"output_config": {"format": {
                                     "type": "json_schema", "schema": schema}}})
    assert msg.stop_reason == "end_turn"
    valid(schema, msg.content[0].text)
    cut = claude.messages.create(model=MODEL, max_tokens=4,
                                 messages=[{"role": "user", "content": f"{uuid.uuid4().hex}"}],
                                 extra_body={"output_config": {"format": {
                                     "type": "json_schema", "schema": schema}}})
    assert cut.stop_reason == "max_tokens"


# -- sampling extensions, n and best_of ----------------------------------------------------------


@pytest.fixture(scope="module")
def vocab(text_model) -> dict[str, int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(text_model / "tokenizer.json"))
    return {tok.decode([i]): i for i in range(tok.get_vocab_size())}


def test_sampling_extensions_change_what_is_sampled(client, proxy, vocab):
    """The demo model's first reply token beats the next by ~46 nats; a logit_bias brings
    the runner-up to 0.1 below it, so that each extension visibly decides the answer."""
    messages = [{"role": "user", "content": f"{uuid.uuid4().hex} Hello"}]
    probe = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                           temperature=0, logprobs=True, top_logprobs=2)
    top, second = probe.choices[0].logprobs.content[0].top_logprobs
    assert top.token == "Hello"  # also the prompt's last word: repetition_penalty's target
    bias = {str(vocab[second.token]): top.logprob - second.logprob - 0.1}

    def first_tokens(**extra) -> set[str]:
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, n=16,
                                           temperature=1.0, seed=3, logit_bias=bias,
                                           extra_body=extra)
        return {c.message.content for c in r.choices}

    assert first_tokens() == {top.token, second.token}  # near a tie: both are sampled
    assert first_tokens(top_k=1) == {top.token}
    assert first_tokens(min_p=0.99) == {top.token}
    # Greedy: the top token, unless it was said lately and the penalty pushes it below.
    greedy = dict(model=MODEL, messages=messages, max_tokens=1, temperature=0, logit_bias=bias)
    assert client.chat.completions.create(**greedy).choices[0].message.content == top.token
    penalized = client.chat.completions.create(**greedy, extra_body={
        "repetition_penalty": 2.0, "repetition_context_size": 16})
    assert penalized.choices[0].message.content == second.token
    # Messages' top_k too.
    claude = anthropic.Anthropic(base_url=proxy.url, api_key=KEY, max_retries=0)
    msg = claude.messages.create(model=MODEL, max_tokens=60, extra_body={"top_k": 1},
                                 messages=[{"role": "user", "content": "Hi"}])
    assert msg.content[0].text == DEMO_REPLY
    status, body = post_json(proxy.url + "/v1/chat/completions",
                             {"model": MODEL, "messages": ask("Hi"), "min_p": 2})
    assert status == 400 and body["error"]["param"] == "min_p", body


def _backend_counter(backend, name: str) -> float:
    return metric_sum(request(backend.url + "/metrics")[2].decode(), name)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_n_choices_share_one_prefill(client, fleet, stream):
    backend = fleet["backends"]["structured-1"]
    before = {k: _backend_counter(backend, f"kvroute_backend_{k}_tokens_total")
              for k in ("prompt", "cached")}
    messages = ask("Tell me something. " * 20)
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SUITE["enums_and_const"]}}
    kw = dict(model=MODEL, messages=messages, n=3, max_tokens=MAX, temperature=1.0, seed=7,
              response_format=fmt)
    if stream:
        chunks = list(client.chat.completions.create(**kw, stream=True,
                                                     stream_options={"include_usage": True}))
        texts, reasons = ["", "", ""], [None, None, None]
        for c in chunks:
            for ch in c.choices:
                texts[ch.index] += ch.delta.content or ""
                reasons[ch.index] = ch.finish_reason or reasons[ch.index]
        usage = chunks[-1].usage
    else:
        r = client.chat.completions.create(**kw)
        assert [ch.index for ch in r.choices] == [0, 1, 2]
        texts = [ch.message.content for ch in r.choices]
        reasons = [ch.finish_reason for ch in r.choices]
        usage = r.usage
    assert reasons == ["stop"] * 3
    for text in texts:
        valid(SUITE["enums_and_const"], text)
    # The prompt counted once in usage, every choice's tokens in completion_tokens.
    # (each answer is at least its braces, three keys and three values: over 5 tokens)
    assert usage.completion_tokens > 3 * 5, usage
    prompt = usage.prompt_tokens
    grew = {k: _backend_counter(backend, f"kvroute_backend_{k}_tokens_total") - v
            for k, v in before.items()}
    # Three sequences, one prefill: the second and third found all of the prompt but its
    # last token in the store, committed by the first at its prefill's end.
    assert grew["prompt"] == 3 * prompt
    assert grew["cached"] >= 2 * (prompt - 1), (grew, prompt)


def test_best_of_is_refused_with_the_reason(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", best_of=2, max_tokens=5)
    assert e.value.body["param"] == "best_of" and "rank" in e.value.body["message"]


def test_embeddings_are_a_404_that_says_why(client, fleet):
    with pytest.raises(openai.NotFoundError) as e:
        client.embeddings.create(model=MODEL, input="hello")
    assert e.value.body["code"] == "embeddings_not_served"
    assert "Embeddings are not served" in e.value.body["message"]
    backend = fleet["backends"]["structured-1"]
    status, body = post_json(backend.url + "/v1/embeddings", {"model": MODEL, "input": "x"},
                             headers={"x-kvroute-token": TOKEN})
    assert status == 404 and body["error"]["code"] == "embeddings_not_served", body


def test_the_readme_example_runs_as_written(proxy):
    text = README.read_text()
    section = text[text.index("## Structured outputs"):]
    start = section.index("```python\n") + len("```python\n")
    code = section[start:section.index("```", start)]
    # As written, but for the proxy's address (the README's is `kvroute serve`'s).
    assert "http://127.0.0.1:8000/v1" in code
    code = code.replace("http://127.0.0.1:8000/v1", proxy.url + "/v1")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "priority=" in run.stdout and "estimate_hours=" in run.stdout, run.stdout

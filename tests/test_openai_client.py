"""The official `openai` client against a real backend process."""

from __future__ import annotations

import openai
import pytest

from kvroute.devtools.demo_model import DEMO_REPLY, DEMO_TOOL_CALL

from tests.harness import TOOLS
from tests.test_exit_paths import conversation


def client(backend) -> openai.OpenAI:
    return openai.OpenAI(base_url=backend.url + "/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_model(backend):
    ids = [m.id for m in client(backend).models.list()]
    assert ids == [backend.model_id]


def test_chat_whole(backend):
    c = client(backend)
    r = c.chat.completions.create(model=backend.model_id, messages=conversation())
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == DEMO_REPLY
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    assert r.usage.prompt_tokens_details.cached_tokens < 8  # the template's opening only


def test_chat_stream_one_id_usage_last(backend):
    c = client(backend)
    chunks = list(c.chat.completions.create(
        model=backend.model_id, messages=conversation(), stream=True,
        stream_options={"include_usage": True}, max_completion_tokens=100,
    ))
    assert len({ch.id for ch in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == DEMO_REPLY
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finish == ["stop"]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens > 0
    assert all(ch.usage is None for ch in chunks[:-1])


def test_second_turn_reports_cached_tokens(backend):
    c = client(backend)
    messages = conversation()
    r1 = c.chat.completions.create(model=backend.model_id, messages=messages)
    messages += [{"role": "assistant", "content": r1.choices[0].message.content},
                 {"role": "user", "content": "And once more?"}]
    r2 = c.chat.completions.create(model=backend.model_id, messages=messages)
    # Prompt and reply of turn 1 (committed after its normal finish) are reused.
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens + r1.usage.completion_tokens - 2


def test_tools_whole(tool_backend):
    c = client(tool_backend)
    r = c.chat.completions.create(model=tool_backend.model_id, messages=conversation(), tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == DEMO_TOOL_CALL["name"]
    import json
    assert json.loads(call.function.arguments) == DEMO_TOOL_CALL["arguments"]


def test_tools_stream_deltas(tool_backend):
    c = client(tool_backend)
    chunks = list(c.chat.completions.create(
        model=tool_backend.model_id, messages=conversation(), tools=TOOLS, stream=True))
    deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].index == 0 and deltas[0].id.startswith("call_")
    assert deltas[0].function.name == "get_weather"
    args = "".join(d.function.arguments or "" for d in deltas)
    import json
    assert json.loads(args) == DEMO_TOOL_CALL["arguments"]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert "<tool_call>" not in text


def test_completions_whole_and_stream(backend):
    c = client(backend)
    r = c.completions.create(model=backend.model_id, prompt="Count: 3", max_tokens=6)
    assert r.choices[0].text == "456789"
    assert r.choices[0].finish_reason == "length"
    chunks = list(c.completions.create(model=backend.model_id, prompt="Count: 3", max_tokens=6,
                                       stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == "456789"


def test_completions_take_token_ids_as_their_text(backend, text_model):
    """A /v1/completions prompt given as token ids (as eval harnesses send it) answers
    as its text does, whole and streamed, and a list of one list as the list; an id
    outside the vocabulary is a 400 naming 'prompt', not a crashed backend."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(text_model)).encode("Count: 3")
    c = client(backend)
    r = c.completions.create(model=backend.model_id, prompt=ids, max_tokens=6)
    assert r.choices[0].text == "456789" and r.usage.prompt_tokens == len(ids)
    again = c.completions.create(model=backend.model_id, prompt=[ids], max_tokens=6)
    assert again.choices[0].text == "456789"
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    chunks = list(c.completions.create(model=backend.model_id, prompt=ids, max_tokens=6,
                                       stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == "456789"
    with pytest.raises(openai.BadRequestError) as bad:
        c.completions.create(model=backend.model_id, prompt=[*ids, 10**6], max_tokens=2)
    assert bad.value.body["param"] == "prompt" and "outside the vocabulary" in bad.value.body["message"]
    assert c.completions.create(model=backend.model_id, prompt=ids, max_tokens=6).choices[0].text == "456789"


def test_logprobs(backend):
    c = client(backend)
    r = c.chat.completions.create(model=backend.model_id, messages=conversation(),
                                  logprobs=True, top_logprobs=3, max_tokens=4)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3
        # The demo model is near-deterministic: the chosen token is the top one.
        assert t.top_logprobs[0].token == t.token and t.logprob <= 0
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob


def test_logprobs_match_the_text_a_stop_string_cut(backend):
    # The reply is the demo's fixed text; "demo" is inside it and over several tokens.
    c = client(backend)
    kw = dict(model=backend.model_id, messages=conversation(), logprobs=True, stop=["demo"])
    r = c.chat.completions.create(**kw)
    content = r.choices[0].message.content
    assert content == DEMO_REPLY[:DEMO_REPLY.index("demo")]
    # The tokens holding the stop string are dropped as it is: " demo" is one token, so
    # the text keeps its space and the logprobs end a token before.
    whole = "".join(t.token for t in r.choices[0].logprobs.content)
    assert content.startswith(whole) and len(content) - len(whole) < len(" demo")
    assert "demo" not in whole and len(whole) > len("Hello! I am")
    chunks = [ch.choices[0] for ch in c.chat.completions.create(**kw, stream=True) if ch.choices]
    assert "".join(ch.delta.content or "" for ch in chunks) == content
    assert "".join(t.token for ch in chunks if ch.logprobs for t in ch.logprobs.content) == whole


def test_logprobs_are_the_contents_tokens_around_calls_and_stops(backend):
    # Forced output (the backend's test-only fault) with a call between two texts, and
    # text of multi-byte characters (byte tokens: each decodes alone to U+FFFD) before a
    # stop string. A token's logprob goes with the text that holds it; a call's tokens
    # and the stop string's have none.
    c = client(backend)
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    kw = dict(model=backend.model_id, messages=conversation(), tools=TOOLS, logprobs=True,
              extra_body={"kvroute_fault": f"force:Checking. {call} Done ok"})
    r = c.chat.completions.create(**kw)
    (tool_call,) = r.choices[0].message.tool_calls
    assert tool_call.function.name == "get_weather"
    tokens = [t.token for t in r.choices[0].logprobs.content]
    content = r.choices[0].message.content
    assert content.startswith("Checking.") and content.endswith(" Done ok"), content
    assert "".join(tokens) == content, repr(tokens)
    chunks = [ch.choices[0] for ch in c.chat.completions.create(**kw, stream=True) if ch.choices]
    for ch in chunks:  # a text chunk's logprobs are its own text's
        if ch.logprobs and ch.logprobs.content and not ch.delta.tool_calls:
            assert "".join(t.token for t in ch.logprobs.content) == ch.delta.content, ch
    assert [t.token for ch in chunks if ch.logprobs for t in ch.logprobs.content] == tokens

    kw = dict(model=backend.model_id, messages=conversation(), logprobs=True, stop=["END"],
              extra_body={"kvroute_fault": "force:\u00e9\u00e8\U0001f600 ok ok END more"})
    r = c.chat.completions.create(**kw)
    content = r.choices[0].message.content
    assert content == "\u00e9\u00e8\U0001f600 ok ok "
    # Each entry's bytes are the token's own (a byte of the emoji is one byte, not the
    # three of U+FFFD): joined, they are the text up to the token the stop string began in.
    joined = b"".join(bytes(t.bytes) for t in r.choices[0].logprobs.content).decode()
    assert content.startswith(joined) and joined.endswith(" ok ok"), joined


def test_completion_logprobs(backend):
    c = client(backend)
    r = c.completions.create(model=backend.model_id, prompt="Count: 3", max_tokens=3, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == ["4", "5", "6"] and len(lp.token_logprobs) == 3
    assert all(len(t) == 2 for t in lp.top_logprobs) and lp.text_offset == [0, 1, 2]


def test_sampling_parameters_accepted(backend):
    c = client(backend)
    r = c.chat.completions.create(model=backend.model_id, messages=conversation(),
                                  temperature=0.7, top_p=0.9, seed=7, presence_penalty=0.1,
                                  frequency_penalty=0.1)
    # The demo model's margins make even sampled replies its fixed text.
    assert r.choices[0].message.content == DEMO_REPLY


def test_errors_are_typed(backend):
    c = client(backend)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=backend.model_id, messages=conversation(), n=17)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="no-such-model", messages=conversation())

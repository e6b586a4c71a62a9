"""Every model family, exact: each cache type is committed, reused, and a hit
answers exactly as a cold prefill.

One real backend process per family, serving a tiny random-weight model built
locally (`kvroute demo-model --arch`), over real HTTP. Sliding windows are 32
tokens, so these ~250-token prompts rotate them: their caches cannot be trimmed,
and hits come from the checkpoints the engine keeps. "Cold" means the same
request in a fresh cache scope (`x-kvroute-scope`), which no entry can serve.

Random weights cannot be made to say a given thing, so the exit paths that
depend on the reply (EOS, a stop string, a tool call) use the test-only
`force:TEXT` fault: a logits processor that picks TEXT's tokens, then EOS. The
model, its caches and the exit path are real.
"""

from __future__ import annotations

import json
import math
import uuid
from pathlib import Path

import pytest
from tests.harness import TOOLS, BackendProcess, SSEStream, chat, post_json, wait_until

from kvroute.devtools import arch_models
from kvroute.devtools.demo_model import DEMO_TOOL_REPLY

SYSTEM = ("You are the release assistant of a small team. Answer in short sentences, "
          "cite the ticket number when there is one, never invent a version, and keep "
          "the tone friendly and plain. The team ships every Tuesday and Thursday; "
          "hotfixes go out when they are ready. ") * 2
GREEDY = {"max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 3}


@pytest.fixture(scope="module", params=arch_models.ARCHES)
def family(request, model_cache, tmp_path_factory) -> BackendProcess:
    path = arch_models.ensure(request.param, cache_dir=model_cache)
    proc = BackendProcess(path, model_id=request.param,
                          log_dir=tmp_path_factory.mktemp(f"{request.param}-logs"),
                          extra=["--prefill-step", "32", "--enable-faults"])
    proc.start()
    yield proc
    proc.stop()


def conversation(user: str = "Which ticket blocks the Thursday release, and who owns it?") -> list[dict]:
    return [{"role": "system", "content": f"{uuid.uuid4().hex[:8]} {SYSTEM}"},
            {"role": "user", "content": user}]


def cold(backend: BackendProcess, messages: list[dict], **kw) -> dict:
    answer = chat(backend, messages, scope=uuid.uuid4().hex, **kw).body
    assert cached(answer) == 0
    return answer


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def prompt_tokens(answer: dict) -> int:
    return answer["usage"]["prompt_tokens"]


def assert_same_answer(hit: dict, reference: dict) -> None:
    """Same greedy tokens, and logprobs (chosen and top 3) within 1e-4."""
    a, b = hit["choices"][0], reference["choices"][0]
    assert a["message"]["content"] == b["message"]["content"]
    for x, y in zip(a["logprobs"]["content"], b["logprobs"]["content"], strict=True):
        assert x["token"] == y["token"]
        assert math.isclose(x["logprob"], y["logprob"], abs_tol=1e-4), (x, y)
        for tx, ty in zip(x["top_logprobs"], y["top_logprobs"], strict=True):
            assert tx["token"] == ty["token"] and math.isclose(tx["logprob"], ty["logprob"], abs_tol=1e-4)


def assert_at_least_half_cached(answer: dict) -> None:
    assert cached(answer) >= prompt_tokens(answer) / 2, answer["usage"]


def idle(backend: BackendProcess) -> bool:
    engine = backend.health()["engine"]
    return engine["decoding"] == 0 and engine["prefilling"] == 0 and engine["queued"] == 0


def assert_entries_consistent(backend: BackendProcess) -> None:
    for entry in backend.cache():
        # `offset` is what the layers that count tokens have seen (None: recurrent only).
        assert entry["offset"] in (entry["tokens"], None), entry
        if entry["kv_tokens"] is not None:
            assert entry["kv_tokens"] == entry["kv_tokens_max"] == entry["tokens"], entry


def test_repeat_turn2_and_shared_system_prompt_hit_exactly(family):
    messages = conversation()
    first = chat(family, messages, **GREEDY).body
    assert prompt_tokens(first) > 200  # past the 32-token sliding windows

    repeat = chat(family, messages, **GREEDY).body
    assert cached(repeat) == prompt_tokens(repeat) - 1
    assert_same_answer(repeat, first)

    turn2 = messages + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                        {"role": "user", "content": "And the one after it?"}]
    second = chat(family, turn2, **GREEDY).body
    assert_at_least_half_cached(second)
    assert_same_answer(second, cold(family, turn2, **GREEDY))

    # Another conversation with the same system prompt reuses the header checkpoint.
    other = [messages[0], {"role": "user", "content": "Who is on call?"}]
    answer = chat(family, other, **GREEDY).body
    assert_at_least_half_cached(answer)
    assert_same_answer(answer, cold(family, other, **GREEDY))
    assert_entries_consistent(family)


def test_disconnect_mid_prefill_resumes_exactly(family):
    messages = conversation(" ".join(f"line {i} of the incident log." for i in range(40)))
    stream = SSEStream(family.url + "/v1/chat/completions",
                       {"model": family.model_id, "messages": messages, "max_tokens": 4,
                        "kvroute_fault": "slow_prefill:0.05"})
    header = chat(family, messages[:1] + [{"role": "user", "content": "hi"}], scope="probe",
                  max_tokens=1).body

    def past_header():
        jobs = family.health()["engine"]["jobs"]
        return [j for j in jobs if j["phase"] == "prefill" and j["processed"] >= prompt_tokens(header)]

    (job,) = wait_until(past_header, timeout=60, what="prefill past the system prompt")
    stream.close()
    wait_until(lambda: idle(family), timeout=10, what="the prefill to be abandoned")
    retry = chat(family, messages, **GREEDY).body
    # At least the last checkpoint reached (the system prompt) is kept; models whose
    # layers count tokens keep everything processed.
    assert cached(retry) >= prompt_tokens(header) - 12, (cached(retry), job)
    assert_same_answer(retry, cold(family, messages, **GREEDY))
    assert_entries_consistent(family)


def follow_up(family: BackendProcess, messages: list[dict], reply: str = "ok", **kw) -> dict:
    more = messages + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Again?"}]
    return chat(family, more, max_tokens=2, **kw).body


def assert_prompt_kept(family: BackendProcess, first: dict, then: dict) -> None:
    # The next turn extends the last complete message of the first prompt: all of
    # it but the generation prompt (a few template tokens) must come from cache.
    assert cached(then) >= prompt_tokens(first) - 8, (then["usage"], first["usage"])
    assert_entries_consistent(family)


def test_exit_eos(family):
    messages = conversation()
    first = chat(family, messages, kvroute_fault="force:All clear.").body
    assert first["choices"][0]["finish_reason"] == "stop"
    assert first["choices"][0]["message"]["content"] == "All clear."
    assert_prompt_kept(family, first, follow_up(family, messages, "All clear."))


def no_eos(backend: BackendProcess) -> dict[str, float]:
    """A logit_bias that bans the model's end-of-sequence tokens: a reply sampled from
    random weights can otherwise end before the step a fault waits for."""
    config = json.loads((Path(backend.model) / "config.json").read_text())
    ids = config["eos_token_id"]
    return {str(i): -100 for i in (ids if isinstance(ids, list) else [ids])}


def test_exit_max_tokens(family):
    messages = conversation()
    # End-of-sequence banned: a random model's reply can otherwise end within 3 tokens.
    first = chat(family, messages, **{**GREEDY, "max_tokens": 3}, logit_bias=no_eos(family)).body
    assert first["choices"][0]["finish_reason"] == "length"
    assert first["usage"]["completion_tokens"] == 3
    assert_prompt_kept(family, first, follow_up(family, messages))


def test_exit_stop_string(family):
    messages = conversation()
    first = chat(family, messages, stop=["STOP"], kvroute_fault="force:ship it STOP and wait").body
    assert first["choices"][0]["finish_reason"] == "stop"
    assert first["choices"][0]["message"]["content"] == "ship it "
    assert_prompt_kept(family, first, follow_up(family, messages))


def test_exit_tool_call_only(family):
    messages = conversation("What is the weather in Paris?")
    first = chat(family, messages, tools=TOOLS, kvroute_fault=f"force:{DEMO_TOOL_REPLY}").body
    choice = first["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    turn2 = messages + [{"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 21 C"}]
    assert_prompt_kept(family, first, chat(family, turn2, tools=TOOLS, max_tokens=2).body)


def assert_kept_after_disconnect_mid_decode(backend: BackendProcess, messages: list[dict],
                                            **body) -> None:
    """A client that leaves after a few streamed tokens: the prompt stays cached (the
    same request again prefills only its last token)."""
    stream = SSEStream(backend.url + "/v1/chat/completions",
                       {"model": backend.model_id, "messages": messages, "max_tokens": 400,
                        "kvroute_fault": "force:" + " ".join(["tick"] * 200), **body})
    events = stream.events()
    for _ in range(4):
        assert isinstance(next(events), dict)
    stream.close()
    wait_until(lambda: idle(backend), timeout=10, what="the sequence to leave the batch")
    repeat = chat(backend, messages, max_tokens=1).body
    assert cached(repeat) == prompt_tokens(repeat) - 1


def test_exit_disconnect_mid_decode(family):
    assert_kept_after_disconnect_mid_decode(family, conversation(),
                                            stream_options={"include_usage": True})
    assert_entries_consistent(family)


def test_exit_error_in_decode(family):
    messages = conversation()
    status, body = post_json(family.url + "/v1/chat/completions",
                             {"model": family.model_id, "messages": messages,
                              "logit_bias": no_eos(family),
                              "kvroute_fault": "decode_error:2"})
    assert status == 500 and "injected decode fault" in body["error"]["message"]
    repeat = chat(family, messages, max_tokens=1).body
    assert cached(repeat) == prompt_tokens(repeat) - 1
    assert_prompt_kept(family, repeat, follow_up(family, messages))


def test_exit_error_in_prompt_completing_step(family):
    messages = conversation()
    status, body = post_json(family.url + "/v1/chat/completions",
                             {"model": family.model_id, "messages": messages,
                              "kvroute_fault": "decode_error:0"})
    assert status == 500 and "injected decode fault" in body["error"]["message"]
    repeat = chat(family, messages, **GREEDY).body
    assert cached(repeat) == prompt_tokens(repeat) - 1
    assert_same_answer(repeat, cold(family, messages, **GREEDY))


def test_n_choices_and_constrained_rows_answer_exactly(family):
    """n choices share one prefill: the later ones start from the first one's prompt
    commit, a hit that must answer as the cold prefill does. And a constrained row works
    on every family's caches."""
    messages = conversation()
    reference = cold(family, messages, **GREEDY)
    answer = chat(family, messages, n=3, **GREEDY).body
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    for choice in answer["choices"]:
        assert_same_answer({"choices": [choice]}, reference)
    schema = {"type": "object", "properties": {"v": {"enum": ["yes", "no"]}}, "required": ["v"],
              "additionalProperties": False}
    constrained = chat(family, messages, max_tokens=300, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "v", "schema": schema}}).body
    assert constrained["choices"][0]["finish_reason"] == "stop", constrained
    assert json.loads(constrained["choices"][0]["message"]["content"])["v"] in ("yes", "no")
    assert_entries_consistent(family)

"""The paged store end to end: a real backend with the demo model, the official
`openai` client, conversations that share a long system prompt.

A team's sessions send one long prefix; the backend holds it once (the bytes it
reports, `/health`'s cache), every repeat is cached to its last token but one and
answers exactly as a cold prefill, and a budget of two whole conversations keeps
ten sessions' prefixes cached."""

from __future__ import annotations

import uuid

import openai
import pytest
from tests.harness import BackendProcess, metric_sum, request, wait_until

SYSTEM = ("You are the release assistant of a small team. Answer in short sentences, cite "
          "the ticket number when there is one, never invent a version, and keep the tone "
          "friendly and plain. The team ships every Tuesday and Thursday; hotfixes go out "
          "when they are ready. ") * 12
GREEDY = {"max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 3}


def start(model, tmp_path, name: str, *extra: str) -> BackendProcess:
    (tmp_path / name).mkdir()
    proc = BackendProcess(model, model_id="demo", log_dir=tmp_path / name,
                          extra=["--prefill-step", "64", *extra])
    proc.start()
    return proc


def client(backend: BackendProcess, scope: str | None = None) -> openai.OpenAI:
    headers = {"x-kvroute-scope": scope} if scope else None
    return openai.OpenAI(base_url=backend.url + "/v1", api_key="none", default_headers=headers)


def session(i: int) -> list[dict]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Developer {i}: which ticket blocks release {i}?"}]


def ask(backend: BackendProcess, messages: list[dict], scope: str | None = None):
    return client(backend, scope).chat.completions.create(model="demo", messages=messages, **GREEDY)


def cached(answer) -> int:
    return answer.usage.prompt_tokens_details.cached_tokens


def same_answer(a, b) -> None:
    assert a.choices[0].message.content == b.choices[0].message.content
    for x, y in zip(a.choices[0].logprobs.content, b.choices[0].logprobs.content, strict=True):
        assert x.token == y.token and abs(x.logprob - y.logprob) <= 1e-4
        for u, v in zip(x.top_logprobs, y.top_logprobs, strict=True):
            assert u.token == v.token and abs(u.logprob - v.logprob) <= 1e-4


def held(backend: BackendProcess) -> dict:
    return backend.health()["cache"]


@pytest.fixture(scope="module")
def one_conversation_bytes(text_model, tmp_path_factory) -> int:
    """What one whole conversation (prompt and reply) holds, measured on its own."""
    proc = start(text_model, tmp_path_factory.mktemp("one"), "one")
    try:
        ask(proc, session(0))
        return held(proc)["bytes"]
    finally:
        proc.stop()


def test_six_conversations_hold_the_shared_prompt_once(text_model, tmp_path, one_conversation_bytes):
    backend = start(text_model, tmp_path, "six")
    try:
        firsts = [ask(backend, session(i)) for i in range(6)]
        stats = held(backend)
        assert stats["entries"] == 6
        assert stats["bytes"] <= 1.15 * one_conversation_bytes, stats
        assert stats["bytes_unshared"] >= 5 * one_conversation_bytes and stats["sharing_ratio"] > 4
        # The same figures in /metrics (gauges set at most every few hundred ms).
        wait_until(lambda: metric_sum(request(backend.url + "/metrics")[2].decode(),
                                      "kvroute_backend_cache_bytes_unshared") == stats["bytes_unshared"],
                   10, what="the gauges")
        text = request(backend.url + "/metrics")[2].decode()
        assert metric_sum(text, "kvroute_backend_cache_blocks", tier="ram") == stats["blocks"] > 0
        assert metric_sum(text, "kvroute_backend_cache_sharing_ratio") == stats["sharing_ratio"]
        for i, first in enumerate(firsts):
            repeat = ask(backend, session(i))
            assert cached(repeat) == first.usage.prompt_tokens - 1
            same_answer(repeat, first)
        same_answer(ask(backend, session(3)), ask(backend, session(3), scope=uuid.uuid4().hex))
    finally:
        backend.stop()


def test_ten_sessions_under_a_budget_of_two_conversations(text_model, tmp_path, one_conversation_bytes):
    backend = start(text_model, tmp_path, "ten", "--cache-bytes", str(2 * one_conversation_bytes))
    try:
        turns, firsts = [session(i) for i in range(10)], []
        for messages in turns:
            firsts.append(ask(backend, messages))
            reply = firsts[-1].choices[0].message.content
            messages += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": "And who reviews it?"}]
        assert held(backend)["bytes"] <= 2 * one_conversation_bytes
        seconds = [ask(backend, messages) for messages in turns]
        # Turn 2 finds all of turn 1's prompt (its session's own question too) cached.
        hits = sum(cached(a) >= f.usage.prompt_tokens - 1 for a, f in zip(seconds, firsts))
        assert hits / len(seconds) >= 0.9, [(cached(a), f.usage.prompt_tokens)
                                            for a, f in zip(seconds, firsts)]
        same_answer(seconds[0], ask(backend, turns[0], scope=uuid.uuid4().hex))
    finally:
        backend.stop()


def test_the_next_turn_starts_from_the_finished_turns_copy(text_model, tmp_path):
    """Turn 2 of a conversation hits the contiguous copy turn 1 left (no assembly
    from blocks) and answers exactly as a cold prefill of the same prompt."""
    backend = start(text_model, tmp_path, "hot")
    try:
        messages = session(1)
        first = ask(backend, messages)
        assert held(backend)["hot_entries"] == 1
        hot = metric_sum(request(backend.url + "/metrics")[2].decode(), "kvroute_backend_cache_hot_bytes")
        assert hot == held(backend)["hot_bytes"] > 0
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And who reviews it?"}]
        second = ask(backend, messages)
        assert cached(second) >= first.usage.prompt_tokens - 1
        assert held(backend)["hot_hits"] == 1
        same_answer(second, ask(backend, messages, scope=uuid.uuid4().hex))  # a cold prefill
    finally:
        backend.stop()


def test_quantized_storage_opt_in(text_model, tmp_path, one_conversation_bytes):
    """`--cache-quantization 8`: the same conversation in fewer bytes, still a hit to the
    last token but one. The demo model's answers do not move (BENCHMARKS.md measures
    the deviation per family; the default stays exact)."""
    backend = start(text_model, tmp_path, "q8", "--cache-quantization", "8")
    try:
        first = ask(backend, session(0))
        stats = held(backend)
        assert stats["quantization"] == 8
        assert stats["bytes"] * 1.8 <= one_conversation_bytes, stats
        repeat = ask(backend, session(0))
        assert cached(repeat) == first.usage.prompt_tokens - 1
        assert repeat.choices[0].message.content == first.choices[0].message.content
    finally:
        backend.stop()


def test_a_restart_restores_the_shared_prompt_once(text_model, tmp_path):
    """Three sessions of one long system prompt on disk; after a SIGKILL and a restart,
    each one's next turn is cached and exact, and the shared prompt's blocks were
    written once and read back at most once."""
    from tests.test_disk_tier import kill

    disk = tmp_path / "disk"
    first = start(text_model, tmp_path, "before", "--disk-cache-dir", str(disk))
    sessions = [session(i) for i in range(3)]
    try:
        answers = [ask(first, m) for m in sessions]
        wait_until(lambda: first.health()["disk"]["entries"] == 3
                   and first.health()["disk"]["write_queue"] == 0, 60, what="three on disk")
        written = first.health()["disk"]
        shared = answers[0].usage.prompt_tokens // 32  # about the prompt's blocks
        assert written["blocks"] < 1.5 * shared, written  # not three copies of them
    finally:
        kill(first)
    again = start(text_model, tmp_path, "after", "--disk-cache-dir", str(disk))
    try:
        for messages, answer in zip(sessions, answers):
            follow = messages + [{"role": "assistant", "content": answer.choices[0].message.content},
                                 {"role": "user", "content": "And who reviews it?"}]
            hit = ask(again, follow)
            # Its turn 1 from disk; or, where RAM holds the shared prompt already and
            # prefilling the few tokens after it beats reading them, from RAM.
            assert cached(hit) >= answer.usage.prompt_tokens - 32
            same_answer(hit, ask(again, follow, scope=uuid.uuid4().hex))
        assert again.health()["disk"]["block_reads"] <= written["blocks"] < 1.5 * shared
        assert metric_sum(request(again.url + "/metrics")[2].decode(),
                          "kvroute_backend_cache_hits_total", tier="disk") >= 2
    finally:
        again.stop()

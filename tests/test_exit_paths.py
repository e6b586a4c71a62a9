"""The exit-path matrix: every way a request can end leaves its prompt cached.

Real backend processes, the real demo model, real HTTP. For each exit path a
first request runs to that exit; a second request sharing its prompt must report
`cached_tokens` of at least the first prompt's length minus one, and every store
entry must hold exactly as many tokens as its KV.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Iterator

import pytest
from tests.harness import TOOLS, SSEStream, chat, post_json, wait_until

from kvroute.devtools.demo_model import DEMO_REPLY


def conversation() -> list[dict]:
    # A nonce keeps each case's prompt apart from every other case's entries.
    return [
        {"role": "system", "content": f"{uuid.uuid4().hex[:8]}: you are terse."},
        {"role": "user", "content": "Say hello to the team."},
    ]


def follow_up(backend, messages, **kw) -> dict:
    more = messages + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "Again?"}]
    return chat(backend, more, max_tokens=2, **kw).body


def assert_entries_consistent(backend) -> None:
    for entry in backend.cache():
        assert entry["tokens"] == entry["kv_tokens"] == entry["kv_tokens_max"] == entry["offset"], entry


def idle(backend) -> bool:
    engine = backend.health()["engine"]
    return engine["decoding"] == 0 and engine["prefilling"] == 0 and engine["queued"] == 0


def cached_after(backend, first_prompt_tokens: int, second: dict) -> None:
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first_prompt_tokens - 1, (cached, first_prompt_tokens)
    assert_entries_consistent(backend)


def test_eos(backend):
    messages = conversation()
    first = chat(backend, messages).body
    assert first["choices"][0]["message"]["content"] == DEMO_REPLY
    assert first["choices"][0]["finish_reason"] == "stop"
    # Only the chat template's opening tokens can be shared with earlier requests.
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] < 8
    cached_after(backend, first["usage"]["prompt_tokens"], follow_up(backend, messages))


def test_max_tokens(backend):
    messages = conversation()
    first = chat(backend, messages, max_tokens=3).body
    assert first["choices"][0]["finish_reason"] == "length"
    assert first["usage"]["completion_tokens"] == 3
    assert DEMO_REPLY.startswith(first["choices"][0]["message"]["content"])
    cached_after(backend, first["usage"]["prompt_tokens"], follow_up(backend, messages))


def test_stop_string_across_tokens_never_leaks(backend):
    messages = conversation()
    stop = "demo mo"  # spans the tokens of "demo" and "model"
    assert stop in DEMO_REPLY
    first = chat(backend, messages, stop=["zzz", stop]).body
    content = first["choices"][0]["message"]["content"]
    assert content == DEMO_REPLY[: DEMO_REPLY.index(stop)]
    assert first["choices"][0]["finish_reason"] == "stop"
    cached_after(backend, first["usage"]["prompt_tokens"], follow_up(backend, messages))


def test_stop_string_streaming(backend):
    stop = "demo mo"
    stream = SSEStream(backend.url + "/v1/chat/completions",
                       {"model": backend.model_id, "messages": conversation(), "stop": stop})
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in stream.events()
                   if isinstance(e, dict) and e["choices"])
    assert text == DEMO_REPLY[: DEMO_REPLY.index(stop)]


def test_tool_call_only(tool_backend):
    messages = conversation()
    first = chat(tool_backend, messages, tools=TOOLS).body
    choice = first["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert call["type"] == "function" and call["id"].startswith("call_")
    # The agent loop's next turn: the tool call and its result are sent back.
    turn2 = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 21 C"},
    ]
    second = chat(tool_backend, turn2, tools=TOOLS, max_tokens=2).body
    cached_after(tool_backend, first["usage"]["prompt_tokens"], second)


COUNT_PROMPT = "Count with me: 1 2 3 4 5 6 7"


def test_disconnect_mid_decode_frees_slot_and_keeps_prompt(backend):
    prompt = f"{uuid.uuid4().hex} {COUNT_PROMPT}"
    before = {e["id"] for e in backend.cache()}
    stream = SSEStream(backend.url + "/v1/completions",
                       {"model": backend.model_id, "prompt": prompt, "max_tokens": 5000})
    events = stream.events()
    text = "".join(next(events)["choices"][0]["text"] for _ in range(5))
    assert text.isdigit(), text
    stream.close()
    wait_until(lambda: idle(backend), timeout=10, what="the disconnected sequence to leave the batch")
    (entry,) = [e for e in backend.cache() if e["id"] not in before]
    assert entry["exit_path"] == "checkpoint"
    status, second = post_json(backend.url + "/v1/completions",
                               {"model": backend.model_id, "prompt": prompt + " 8", "max_tokens": 2})
    assert status == 200
    cached_after(backend, entry["tokens"], second)


def test_disconnect_mid_prefill_keeps_processed_chunks(backend):
    # ~1500 tokens in 32-token chunks, each stretched by the test-only fault.
    prompt = f"{uuid.uuid4().hex} " + " ".join(f"word{i % 50}" for i in range(600)) + " 7"
    stream = SSEStream(backend.url + "/v1/completions",
                       {"model": backend.model_id, "prompt": prompt, "max_tokens": 5,
                        "kvroute_fault": "slow_prefill:0.05"})

    def mid_prefill():
        jobs = backend.health()["engine"]["jobs"]
        return [j for j in jobs if j["phase"] == "prefill" and j["processed"] >= 128]

    (job,) = wait_until(mid_prefill, timeout=30, what="prefill to be under way")
    stream.close()
    wait_until(lambda: idle(backend), timeout=10, what="the prefill to be abandoned")
    partial = [e for e in backend.cache() if e["exit_path"] == "disconnect_prefill"]
    assert partial, backend.cache()
    kept = max(e["tokens"] for e in partial)
    assert job["processed"] <= kept < job["prompt"]
    status, second = post_json(backend.url + "/v1/completions",
                               {"model": backend.model_id, "prompt": prompt, "max_tokens": 1})
    assert status == 200
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= kept
    assert_entries_consistent(backend)


def test_error_inside_decode(backend):
    messages = conversation()
    status, body = post_json(backend.url + "/v1/chat/completions",
                             {"model": backend.model_id, "messages": messages,
                              "kvroute_fault": "decode_error:2"})
    assert status == 500
    assert body["error"]["type"] == "server_error"
    assert "injected decode fault" in body["error"]["message"]
    # The process survived, and the prompt it was decoding for is cached.
    second = follow_up(backend, messages)
    first_prompt = chat(backend, messages, max_tokens=1).body["usage"]["prompt_tokens"]
    cached_after(backend, first_prompt, second)


def test_error_inside_decode_streaming_ends_with_error_event(backend):
    stream = SSEStream(backend.url + "/v1/chat/completions",
                       {"model": backend.model_id, "messages": conversation(),
                        "kvroute_fault": "decode_error:4"})
    assert stream.status == 200
    events = list(stream.events())
    assert events[-1] == "[DONE]"
    assert "error" in events[-2] and events[-2]["error"]["type"] == "server_error"


@pytest.mark.parametrize("steps", [50])
def test_commit_cannot_be_raced(backend, steps):
    """The committed KV arrays are bitwise unchanged after more decode steps."""
    prompt = f"{uuid.uuid4().hex} {COUNT_PROMPT}"
    before = {e["id"] for e in backend.cache()}
    stream = SSEStream(backend.url + "/v1/completions",
                       {"model": backend.model_id, "prompt": prompt, "max_tokens": 5000,
                        "stream_options": {"include_usage": True}})
    events = stream.events()
    next(events)
    (entry,) = [e for e in backend.cache() if e["id"] not in before]
    assert entry["exit_path"] == "checkpoint"
    for _ in range(steps + 1):
        next(events)
    (after,) = [e for e in backend.cache() if e["id"] == entry["id"]]
    stream.close()
    assert after["kv_digest"] == entry["kv_digest"]
    assert after["tokens"] == entry["tokens"] == entry["kv_tokens"]


def test_four_streams_decode_in_one_batch_and_a_disconnect_leaves_it(backend):
    # The backend is shared by the session: start from an empty batch, so the counts
    # below are these streams'.
    wait_until(lambda: idle(backend), timeout=60, what="the shared backend to be idle")
    streams = [
        SSEStream(backend.url + "/v1/completions",
                  {"model": backend.model_id, "prompt": f"{uuid.uuid4().hex} {COUNT_PROMPT}",
                   "max_tokens": 7000})
        for _ in range(4)
    ]
    iters = [s.events() for s in streams]
    for it in iters:
        next(it)
    wait_until(lambda: backend.health()["engine"]["decoding"] == 4, timeout=60,
               what="4 sequences decoding together")
    streams[0].close()
    # Each asks for 7000 tokens, far more than these waits leave time to decode.
    wait_until(lambda: backend.health()["engine"]["decoding"] == 3, timeout=60,
               what="the disconnected stream to leave the batch")
    # The others keep streaming.
    for it in iters[1:]:
        assert next(it)["choices"][0]["text"] is not None
    for s in streams[1:]:
        s.close()
    wait_until(lambda: idle(backend), timeout=10, what="every batch slot to be free")


def test_error_in_prompt_completing_step_keeps_prompt_and_others_progress(backend):
    """Regression: an error in the step that feeds a prompt's last token (here a
    logits processor failing on its first call) used to commit nothing and fail
    every prompt being prefilled beside it."""
    long_prompt = f"{uuid.uuid4().hex} " + " ".join(f"word{i % 50}" for i in range(300)) + " 7"
    other = SSEStream(backend.url + "/v1/completions",
                      {"model": backend.model_id, "prompt": long_prompt, "max_tokens": 4,
                       "kvroute_fault": "slow_prefill:0.05", "stream_options": {"include_usage": True}})

    def mid_prefill():
        jobs = backend.health()["engine"]["jobs"]
        return [j for j in jobs if j["phase"] == "prefill" and j["processed"] >= 96]

    wait_until(mid_prefill, timeout=30, what="the long prompt's prefill to be under way")
    messages = conversation()
    status, body = post_json(backend.url + "/v1/chat/completions",
                             {"model": backend.model_id, "messages": messages,
                              "kvroute_fault": "decode_error:0"})
    assert status == 500 and "injected decode fault" in body["error"]["message"], body
    # The failed prompt was committed up to its last token but one.
    repeat = chat(backend, messages, max_tokens=1).body
    assert repeat["usage"]["prompt_tokens_details"]["cached_tokens"] == repeat["usage"]["prompt_tokens"] - 1
    # The prompt being prefilled beside it carried on and answers as a cold run would.
    events = [e for e in other.events() if isinstance(e, dict)]
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert events[-1]["usage"]["completion_tokens"] == 4
    status, again = post_json(backend.url + "/v1/completions",
                              {"model": backend.model_id, "prompt": long_prompt, "max_tokens": 4})
    assert status == 200 and again["choices"][0]["text"] == text
    assert_entries_consistent(backend)


def test_waiting_count_regression_returns_to_zero_after_a_burst(backend):
    """Regression: the inbox count was updated with `+=` from two threads. It is
    now two counters with one writer each; after a burst nothing stays queued."""
    import concurrent.futures

    def one(i: int) -> int:
        return post_json(backend.url + "/v1/completions",
                         {"model": backend.model_id, "prompt": f"{i} {COUNT_PROMPT}", "max_tokens": 2})[0]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        assert set(pool.map(one, range(48))) == {200}
    wait_until(lambda: idle(backend), timeout=10, what="the engine to drain")
    assert backend.health()["engine"]["queued"] == 0


@contextlib.contextmanager
def faulty_backend(text_model, tmp_path) -> Iterator:
    """A backend that honours `kvroute_fault` (--enable-faults), stopped after."""
    from tests.harness.processes import BackendProcess

    backend = BackendProcess(text_model, "demo", tmp_path, extra=["--enable-faults"])
    backend.start()
    try:
        yield backend
    finally:
        backend.stop()


def faulted_chat(backend, fault: str) -> tuple[int, dict]:
    return post_json(backend.url + "/v1/chat/completions",
                     {"model": "demo", "messages": conversation(), "kvroute_fault": fault})


def test_a_lost_gpu_fails_requests_with_503_and_the_backend_exits_to_be_restarted(text_model, tmp_path):
    """After a CUDA error that leaves the GPU context unusable (an illegal memory
    access: every later step and allocation fails the same way), a backend answers
    what it holds with 503 (a proxy retries it elsewhere) and exits with status 70,
    for `kvroute serve` or systemd to start a fresh process. This CPU has no GPU to
    lose: the `device_lost` fault raises MLX's CUDA error from inside the decode step."""
    with faulty_backend(text_model, tmp_path) as backend:
        status, body = faulted_chat(backend, "device_lost:1")
        assert status == 503, body
        assert body["error"]["type"] == "server_error" and "restarting" in body["error"]["message"]
        wait_until(lambda: backend.proc.poll() is not None, 60, what="the backend to exit")
        assert backend.proc.returncode == 70
        assert "the GPU failed for good" in backend.log()


def test_out_of_device_memory_fails_the_step_logs_what_the_backend_held_and_serves_on(
        text_model, tmp_path):
    """A step that finds the card full fails its requests (503, retry: the card's state,
    not the request's fault; OpenAI's SDKs retry it) but not the process: the
    backend logs what it held (MLX's memory, the prompt cache) for the operator, lets
    its buffer cache and finished turns' copies go, and answers the next request. This
    CPU has no card to fill: the `out_of_memory` fault raises MLX's CUDA allocation
    error from inside the decode step."""
    with faulty_backend(text_model, tmp_path) as backend:
        status, body = faulted_chat(backend, "out_of_memory:1")
        assert status == 503 and "out of memory" in body["error"]["message"], body
        assert "retry" in body["error"]["message"] and body["error"]["type"] == "server_error"
        log = backend.log()
        assert "out of device memory: active" in log and "prompt cache" in log, log[-2000:]
        memory = backend.health()["memory"]
        assert memory["peak"] >= memory["active"] > 0
        status, body = post_json(backend.url + "/v1/chat/completions",
                                 {"model": "demo", "messages": conversation(), "max_tokens": 3})
        assert status == 200 and body["usage"]["completion_tokens"] == 3, body
        assert backend.proc.poll() is None


def test_a_gpu_lost_during_warm_up_exits_to_be_restarted(text_model, tmp_path, monkeypatch, caplog):
    """A GPU context lost before the backend served anything (in its warm-up) ends the
    process as one lost while serving does: status 70, for `kvroute serve` or systemd
    to start a fresh process, its disk tier closed without writing. In process, with
    the real model and engine thread; this CPU has no GPU to lose, so warm-up raises
    MLX's CUDA error."""
    import asyncio

    from kvroute.backend import boot, engine
    from kvroute.config import BackendConfig
    from tests.harness.redis import free_port

    def lost(self, long_tokens=0):
        raise RuntimeError("cudaStreamSynchronize(stream_) failed: an illegal memory access was encountered")

    monkeypatch.setattr(engine.Engine, "warm_up", lost)
    closed = []
    real_close = boot.open_disk_tier

    def tier(*args, **kwargs):
        t = real_close(*args, **kwargs)
        close = t.close
        t.close = lambda **kw: closed.append(kw) or close(**kw)
        return t

    monkeypatch.setattr(boot, "open_disk_tier", tier)
    config = BackendConfig(model=str(text_model), port=free_port(), host="127.0.0.1",
                           disk_cache_dir=str(tmp_path / "disk"), disk_cache_bytes=64 << 20)
    assert asyncio.run(boot.serve(config)) == 70
    assert closed == [{"write": False}]
    assert any("failed for good during warm-up" in r.getMessage() for r in caplog.records)

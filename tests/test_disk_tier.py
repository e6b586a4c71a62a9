"""The disk tier end to end: real backend processes, real files, real HTTP.

The demo model's caches cost 1 KiB per token (2 layers x 2 KV heads x 32 x fp32 x
keys and values), so a 400 KiB RAM budget holds about one ~300-token conversation.
"""

from __future__ import annotations

import os
import signal
import threading
import uuid

import openai
import pytest
from tests.harness import (BackendProcess, chat, get_json, metric_sum, request, small_tmpfs,
                           wait_until)
from tests.test_families import GREEDY, assert_same_answer, cached, conversation

from kvroute.devtools import arch_models



def start(model, model_id: str, disk_dir, log_dir, *extra: str, port: int | None = None,
          backend_id: str = "") -> BackendProcess:
    proc = BackendProcess(model, model_id=model_id, log_dir=log_dir, port=port,
                          backend_id=backend_id or f"disk-{model_id}",
                          extra=["--prefill-step", "64", "--disk-cache-dir", str(disk_dir), *extra])
    proc.start()
    return proc


def next_turn(messages: list[dict], answer: dict, text: str = "And the one after?") -> list[dict]:
    reply = answer["choices"][0]["message"]
    return messages + [{"role": "assistant", "content": reply["content"]},
                       {"role": "user", "content": text}]


def written(backend: BackendProcess, entries: int = 1) -> bool:
    disk = backend.health()["disk"]
    return disk["entries"] >= entries and disk["write_queue"] == 0


def metric(backend: BackendProcess, name: str, **labels) -> float:
    return metric_sum(request(backend.url + "/metrics")[2].decode(), name, **labels)


def kill(backend: BackendProcess) -> None:
    backend.proc.send_signal(signal.SIGKILL)
    backend.proc.wait(10)


def test_sigkill_restart_keeps_the_conversation(text_model, tool_model, tmp_path):
    disk = tmp_path / "disk"
    first = start(text_model, "demo", disk, tmp_path)
    messages = conversation()
    turn1 = chat(first, messages, **GREEDY).body
    wait_until(lambda: written(first), 60, what="turn 1 on disk")
    kill(first)

    again = start(text_model, "demo", disk, tmp_path, port=first.port)
    try:
        assert again.health()["disk"]["entries"] >= 1  # re-indexed before it reported ready
        messages2 = next_turn(messages, turn1)
        # Refused once its tokens are known (past the context): the read its keys began
        # is let go, counted unused.
        with pytest.raises(openai.BadRequestError) as refused:
            chat(again, messages2, max_tokens=10**7)
        assert refused.value.body["code"] == "context_length_exceeded"
        assert metric(again, "kvroute_backend_disk_early_reads_total", used="no") == 1
        turn2 = chat(again, messages2, **GREEDY).body
        assert cached(turn2) >= 0.9 * turn1["usage"]["prompt_tokens"]
        assert metric(again, "kvroute_backend_cache_hits_total", tier="disk") == 1
        assert metric(again, "kvroute_backend_disk_restore_bytes_total") > 0
        restored = metric(again, "kvroute_backend_disk_restore_bytes_total")
        # The read began from its messages' keys, before its tokens were known.
        assert metric(again, "kvroute_backend_disk_early_reads_total", used="yes") == 1
        # Exact: the same answer as a cold prefill in a scope nothing is cached for.
        assert_same_answer(turn2, chat(again, messages2, scope=uuid.uuid4().hex, **GREEDY).body)
        # Turn 2's commit kept the blocks the restore read: turn 3 hits them in RAM,
        # and answers as a cold prefill too.
        messages3 = next_turn(messages2, turn2)
        turn3 = chat(again, messages3, **GREEDY).body
        assert cached(turn3) >= 0.9 * turn2["usage"]["prompt_tokens"]
        assert metric(again, "kvroute_backend_cache_hits_total", tier="ram") >= 1
        assert_same_answer(turn3, chat(again, messages3, scope=uuid.uuid4().hex, **GREEDY).body)
        # Turns RAM held, and prompts nothing was cached for, read nothing early.
        assert metric(again, "kvroute_backend_disk_early_reads_total", used="no") == 1
        assert metric(again, "kvroute_backend_disk_restore_bytes_total") == restored
    finally:
        again.stop()

    # Other weights on the same directory: the old records are foreign, never loaded.
    other = start(tool_model, "demo-tool", disk, tmp_path)
    try:
        assert other.health()["disk"]["entries"] == 0
        assert "(foreign: written for other model weights)" in other.log()
        assert metric(other, "kvroute_backend_disk_dropped_files_total", reason="foreign") >= 1
        assert cached(chat(other, messages2, **GREEDY).body) == 0
    finally:
        other.stop()


def test_ram_smaller_than_the_working_set_serves_repeats_from_disk(text_model, tmp_path):
    backend = start(text_model, "demo", tmp_path / "disk", tmp_path, "--cache-bytes", "400KiB")
    try:
        chats = [conversation(f"Question {i}: which ticket blocks release {i}?") for i in range(3)]
        firsts = [chat(backend, m, **GREEDY).body for m in chats]
        wait_until(lambda: written(backend, 3), 60, what="three conversations on disk")
        # RAM, within its budget, let go of part of them: it evicts whole entries or cuts
        # them from their tails, and which depends on when the writes end (under load it
        # kept the heads of all three; "at most two entries" failed then).
        cache = backend.health()["cache"]
        assert cache["bytes"] <= cache["budget_bytes"]
        assert cache["evictions"] + cache["blocks_evicted"] > 0
        for messages, answer in zip(chats, firsts):
            follow = next_turn(messages, answer)
            hit = chat(backend, follow, **GREEDY).body
            assert cached(hit) >= 0.9 * answer["usage"]["prompt_tokens"]
        assert metric(backend, "kvroute_backend_cache_hits_total", tier="disk") >= 2
    finally:
        backend.stop()


def test_untrimmable_family_restores_exactly(model_cache, tmp_path):
    path = arch_models.ensure("gemma3_text", cache_dir=model_cache)
    disk = tmp_path / "disk"
    backend = start(path, "gemma3_text", disk, tmp_path)
    messages = conversation()
    turn1 = chat(backend, messages, **GREEDY).body
    wait_until(lambda: written(backend, 2), 60, what="the checkpoints on disk")
    kill(backend)
    again = start(path, "gemma3_text", disk, tmp_path, port=backend.port)
    try:
        repeat = chat(again, messages, **GREEDY).body
        assert cached(repeat) == turn1["usage"]["prompt_tokens"] - 1  # the repeat checkpoint
        assert_same_answer(repeat, turn1)
        follow = next_turn(messages, turn1)
        hit = chat(again, follow, **GREEDY).body
        assert cached(hit) >= 0.5 * turn1["usage"]["prompt_tokens"]
        assert_same_answer(hit, chat(again, follow, scope=uuid.uuid4().hex, **GREEDY).body)
    finally:
        again.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_full_disk_keeps_serving(text_model, tmp_path):
    with small_tmpfs(tmp_path / "small", "128k") as mount:
        backend = None
        try:
            backend = start(text_model, "demo", mount / "cache", tmp_path)
            for i in range(3):
                chat(backend, conversation(f"Question {i}: which ticket blocks release {i}?"), **GREEDY).body
            wait_until(lambda: metric(backend, "kvroute_backend_disk_writes_total",
                                      result="failed") >= 1,
                       60, what="a failed write")
            assert "writing failed (ENOSPC" in backend.log()
            assert backend.health()["status"] == "ok"
            answer = chat(backend, conversation(), **GREEDY).body
            assert answer["choices"][0]["message"]["content"] is not None
        finally:
            if backend is not None:
                backend.stop()


def test_proxy_routes_turn2_back_to_the_restarted_backend(text_model, tmp_path, redis_db):
    """Turn 1 through the proxy; SIGKILL the backend that served it; restart it on the
    same directory: it re-advertises its disk tier before it reports ready, and
    turn 2 goes back to it (a disk hit) and finds turn 1 cached."""
    from tests.test_proxy import KEY, SECRET, TOKEN, ProxyProcess

    redis = redis_db
    common = ["--redis-url", redis.url, "--secret", SECRET, "--internal-token", TOKEN]
    backends = {}
    proxy = None
    try:
        for i in range(2):
            b = start(text_model, "demo", tmp_path / f"disk-{i}", tmp_path, *common,
                      backend_id=f"disk-demo-{i}")
            backends[b.backend_id] = b
        proxy = ProxyProcess(redis.url, tmp_path)
        proxy.start(expect_backends=2)

        def ask(messages):
            status, headers, raw = request(proxy.url + "/v1/chat/completions", "POST",
                                           {"model": "demo", "messages": messages, **GREEDY},
                                           headers={"Authorization": f"Bearer {KEY}"})
            assert status == 200, raw
            import json
            return headers, json.loads(raw)

        messages = conversation()
        headers, turn1 = ask(messages)
        served = backends[headers["x-kvroute-backend"]]
        wait_until(lambda: written(served), 60, what="turn 1 on disk")
        kill(served)
        # Ready means its disk tier is advertised under the new instance already.
        restarted = start(text_model, "demo", served.extra[served.extra.index("--disk-cache-dir") + 1],
                          tmp_path, *common, port=served.port, backend_id=served.backend_id)
        backends[served.backend_id] = restarted
        headers, turn2 = ask(next_turn(messages, turn1))
        assert headers["x-kvroute-backend"] == served.backend_id
        assert headers["x-kvroute-route-reason"] == "disk-hit"
        assert cached(turn2) >= 0.9 * turn1["usage"]["prompt_tokens"]
        # The proxy's fleet view (/health, /stats, kvroute stats, the dashboard) shows it.
        wait_until(lambda: [(b["disk_hits"], b["ram_hits"]) for b in proxy.health()["backends"]
                            if b["id"] == served.backend_id] == [(1, 0)], 30,
                   what="the disk hit in the proxy's fleet view")
        # ... with the bytes its disk tier holds: records and their blocks, as the
        # backend's own /health counts them (not the record files alone).
        def same_bytes() -> bool:
            held = get_json(restarted.url + "/health")["disk"]["bytes"]
            listed = [b["disk_bytes"] for b in proxy.health()["backends"]
                      if b["id"] == served.backend_id]
            return listed == [held] and held > 100_000
        wait_until(same_bytes, 30, what="the proxy to list the disk tier's bytes")
    finally:
        if proxy is not None:
            proxy.stop()
        for b in backends.values():
            b.stop()


def test_a_backend_writes_only_while_its_siblings_rest(text_model, tmp_path):
    """Two replicas of one machine, their tiers in one folder (as `kvroute serve` lays
    them out): while one prefills, the other's conversation waits in RAM and is
    written once both are idle, so the write never shares the device with a prompt."""
    tiers = tmp_path / "tiers"
    busy = start(text_model, "demo", tiers / "a", tmp_path, "--enable-faults", backend_id="a")
    idle = start(text_model, "demo", tiers / "b", tmp_path, backend_id="b")
    try:
        # A long prefill on the first: ~16 chunks of 64 tokens, each 0.5 s longer.
        slow = threading.Thread(target=chat, args=(busy, conversation("words " * 500)),
                                kwargs={"kvroute_fault": "slow_prefill:0.5",
                                        "timeout": 120, **GREEDY})
        slow.start()
        wait_until(lambda: metric(busy, "kvroute_backend_queue_depth") > 0, 30,
                   what="the slow prefill running")
        chat(idle, conversation(), **GREEDY)
        with pytest.raises(TimeoutError):
            wait_until(lambda: idle.health()["disk"]["entries"] > 0, 2.0,
                       what="a write beside the sibling's prefill")
        assert slow.is_alive()  # the window above lay within the sibling's prefill
        disk = idle.health()["disk"]
        assert disk["write_queue"] > 0 and disk["write_queue_bytes"] > 0
        slow.join(120)
        wait_until(lambda: written(idle), 30, what="the write once both rest")
    finally:
        busy.stop()
        idle.stop()

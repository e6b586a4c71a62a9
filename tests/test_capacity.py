"""Memory accounting and the choice of what to unload: the arithmetic users see."""

from __future__ import annotations

import json

import pytest

from kvroute.serve import capacity
from kvroute.serve.capacity import Refusal, Resident, plan_room
from kvroute.config import ConfigError, build
from kvroute.core.durations import parse_duration

GiB = 1 << 30


def test_durations():
    assert parse_duration("30m") == 1800
    assert parse_duration("1h30m") == 5400
    assert parse_duration("90s") == parse_duration("90") == parse_duration(90) == 90
    assert parse_duration("0") == 0
    assert parse_duration("2.5m") == 150
    for bad in ("", "m", "5 weeks", "-1", "1x"):
        with pytest.raises(Exception, match="duration"):
            parse_duration(bad)


def test_replica_cost_counts_weights_cache_running_kv_and_process(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
        "hidden_size": 512, "torch_dtype": "bfloat16", "max_position_embeddings": 4096}))
    cost = capacity.replica_cost(str(tmp_path), cache_bytes=GiB, max_batch=8,
                                 max_prompt_tokens=1000, default_max_tokens=500)
    per_token = 4 * 2 * 2 * 64 * 2  # layers x (K, V) x kv heads x head dim x bf16
    assert cost.kv_per_token == per_token
    assert cost.context == 1500 and cost.batch == 8
    assert cost.total == 1000 + GiB + 8 * 1500 * per_token + capacity.PROCESS_OVERHEAD
    text = cost.explain()
    assert "KV (8 x 1500 tokens x" in text and "1.0 GiB cache" in text
    # No prompt cap: the model's whole window.
    assert capacity.replica_cost(str(tmp_path), 0, 8, 0, 500).context == 4096


def test_plan_room_unloads_least_recently_used_unpinned_first():
    loaded = [Resident("a", GiB, last_used=3), Resident("b", GiB, last_used=1),
              Resident("c", GiB, pinned=True, last_used=0)]
    assert plan_room(loaded, Resident("d", GiB), max_models=3, budget_bytes=100 * GiB) == ["b"]
    assert plan_room(loaded, Resident("d", GiB), max_models=2, budget_bytes=100 * GiB) == ["b", "a"]
    # Memory: 3 GiB loaded + 2 GiB new under a 4 GiB budget frees one.
    assert plan_room(loaded, Resident("d", 2 * GiB), 0, 4 * GiB) == ["b"]
    assert plan_room(loaded, Resident("d", GiB), 0, 100 * GiB) == []


def test_plan_room_refuses_naming_the_limit_with_the_arithmetic():
    loaded = [Resident("a", GiB, pinned=True), Resident("b", GiB, movable=False)]
    out = plan_room(loaded, Resident("d", GiB), max_models=2, budget_bytes=100 * GiB)
    assert isinstance(out, Refusal) and out.limit == "max_loaded_models"
    assert "max_loaded_models (2)" in out.message and "a (pinned)" in out.message
    assert "b (loading)" in out.message
    out = plan_room(loaded, Resident("d", 3 * GiB), max_models=0, budget_bytes=4 * GiB)
    assert out.limit == "memory_budget"
    assert "1.0 GiB a + 1.0 GiB b + 3.0 GiB d = 5.0 GiB > 4.0 GiB" in out.message
    out = plan_room([], Resident("huge", 5 * GiB), 0, 4 * GiB, "memory_budget")
    assert out.limit == "memory_budget" and "huge needs 5.0 GiB alone" in out.message


def test_settings_from_file_env_and_flags(tmp_path):
    path = tmp_path / "k.toml"
    path.write_text('max_loaded_models = 3\nmemory_budget = "8GiB"\n[proxy]\nload_timeout = 60\n'
                    '[[models]]\npath = "demo"\nalias = "a"\npin = true\nidle_unload = "30m"\n'
                    '[[models]]\npath = "demo"\nalias = "b"\npreload = false\n')
    c = build({"config": str(path)}, {"KVROUTE_MAX_LOADED_MODELS": "2"})
    assert c.max_loaded_models == 2 and c.memory_budget == 8 * GiB and c.load_timeout == 60
    a, b = c.models
    assert (a.pin, a.preload, a.idle_unload) == (True, True, 1800)
    assert (b.pin, b.preload, b.idle_unload) == (False, False, 0)
    c = build({"config": str(path), "idle_unload": 10.0, "max_loaded_models": 1}, {})
    assert [m.idle_unload for m in c.models] == [10, 10]
    path.write_text('max_loaded_models = 1\n[[models]]\nalias = "a"\npin = true\n'
                    '[[models]]\nalias = "b"\npin = true\n')
    with pytest.raises(ConfigError, match="2 models are pinned but max_loaded_models is 1"):
        build({"config": str(path)}, {})


def test_a_backend_started_on_demand_moves_off_a_port_taken_since_the_plan():
    import socket

    from kvroute.config import ServeConfig
    from kvroute.serve.launcher import Launcher
    from kvroute.serve.processes import Child

    launcher = Launcher(ServeConfig())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        child = Child("m-1", ["backend", "--port", str(port), "--advertise-url",
                              f"http://127.0.0.1:{port}"], f"http://127.0.0.1:{port}", "cyan")
        launcher.children = [child]
        launcher.repick_port(child)
    new = int(child.url.rpartition(":")[2])
    assert new != port
    assert child.args == ["backend", "--port", str(new), "--advertise-url", child.url]


def test_running_tokens_bound_the_kv_the_memory_check_counts():
    # The budget, but at least one whole sequence and at most a full batch of them.
    assert capacity.running_tokens(32, 40960, 262144) == 262144
    assert capacity.running_tokens(32, 40960, 0) == 32 * 40960
    assert capacity.running_tokens(4, 1000, 262144) == 4000
    assert capacity.running_tokens(32, 40960, 10000) == 40960


def test_a_7b_model_on_an_h200_fits_by_its_running_budget_not_batch_times_context(tmp_path):
    # Qwen2.5-7B's shape: 28 layers, 4 KV heads of 128, bf16, a 32k window; ~15 GB weights.
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "hidden_size": 3584, "torch_dtype": "bfloat16", "max_position_embeddings": 32768}))
    spec = build({"models": [str(tmp_path)], "replicas": 2}, {}).models[0]
    cost = capacity.replica_cost(str(tmp_path), 2 * GiB, spec.max_batch, spec.max_prompt_tokens,
                                 spec.default_max_tokens, spec.max_running_tokens)
    h200 = int(0.85 * 141 * 10**9)
    weights = 15 * 10**9
    assert 2 * (weights + cost.total) < h200, cost.explain()
    assert cost.running_tokens == 262144 and "262,144 running tokens" in cost.explain()
    old = capacity.replica_cost(str(tmp_path), 2 * GiB, spec.max_batch, 0, 4096, 0)
    assert 2 * (weights + old.total) > h200  # what refused to start before
    # The serve flags reach every model.
    spec = build({"models": [str(tmp_path)], "max_batch": 8, "max_prompt_tokens": 16000,
                  "max_running_tokens": 65536}, {}).models[0]
    assert (spec.max_batch, spec.max_prompt_tokens, spec.max_running_tokens) == (8, 16000, 65536)
    assert spec.backend_flags()[spec.backend_flags().index("--max-running-tokens") + 1] == "65536"
    spec = build({"models": [str(tmp_path)]}, {"KVROUTE_MAX_RUNNING_TOKENS": "1000"}).models[0]
    assert spec.max_running_tokens == 1000


def test_a_burst_beyond_the_running_budget_queues_and_all_complete(text_model, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    from tests.harness import BackendProcess, wait_until

    messages = [{"role": "user", "content": "Count the apples in the basket, please."}]
    proc = BackendProcess(text_model, "demo", tmp_path, extra=[
        "--prefill-step", "8", "--enable-faults", "--no-warmup", "--max-running-tokens", "1"])
    proc.start()
    client = OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0)
    try:
        # One request alone runs whatever the budget: its prompt tells the need.
        one = client.chat.completions.create(model="demo", messages=messages, max_tokens=8)
        need = one.usage.prompt_tokens + 8
        proc.stop()
        proc.extra[-1] = str(2 * need + need // 2)  # room for two at once
        proc.start()

        def ask(i: int):
            return client.chat.completions.create(
                model="demo", messages=messages, max_tokens=8,
                extra_body={"kvroute_fault": "slow_prefill:0.2"})

        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(ask, i) for i in range(6)]
            # While the first two prefill slowly, the others wait for room.
            wait_until(lambda: proc.health()["engine"]["queued"] >= 3, 20, what="a queue")
            answers = [f.result(timeout=120) for f in futures]
        assert all(a.choices[0].finish_reason in ("stop", "length") for a in answers)
        engine = proc.health()["engine"]
        assert need < engine["peak_running_tokens"] <= 2 * need + need // 2, engine
        assert engine["running_tokens"] == 0 and engine["queued"] == 0
    finally:
        proc.stop()


def test_default_disk_tiers_take_at_most_half_their_volumes_free_space(tmp_path):
    from tests.harness import small_tmpfs

    from kvroute.config import ModelSpec
    from kvroute.core import disk_space
    from kvroute.serve.launcher import disk_budgets

    MiB = 1 << 20
    with small_tmpfs(tmp_path / "vol", "64m") as vol:
        # What a tier already holds counts as room: a restart keeps its budget.
        (vol / "a-1").mkdir()
        (vol / "a-1" / "old.kvr").write_bytes(b"\1" * 8 * MiB)
        a = ModelSpec.make({"path": "demo", "alias": "a", "disk_cache_dir": str(vol)})
        b = ModelSpec.make({"path": "demo", "alias": "b", "disk_cache_dir": str(vol),
                            "disk_cache_bytes": "40MiB"})
        elsewhere = ModelSpec.make({"path": "demo", "alias": "c",
                                    "disk_cache_dir": str(tmp_path / "other"),
                                    "disk_cache_bytes": "0"})
        budgets, lines = disk_budgets([(a, "a-1"), (a, "a-2"), (b, "b-1"), (elsewhere, "c-1")])
        # 56 MiB free + 8 held, half of it among the three tiers on the volume.
        share = 64 * MiB // 2 // 3
        assert abs(budgets["a-1"] - share) < MiB and budgets["a-1"] == budgets["a-2"]
        assert budgets["b-1"] == 40 * MiB  # set by the user: kept
        assert "c-1" not in budgets  # no tier
        assert lines[0].startswith(f"disk tier of a: {budgets['a-1'] / MiB:.1f} MiB per backend "
                                   f"on {vol} (free 56.0 MiB; at most half of it, shared by 3 "
                                   "backends)"), lines
        assert lines[1] == f"disk tier of b: 40.0 MiB per backend on {vol} (free 56.0 MiB)"
        line, over = disk_space.describe(vol / "b-1", 40 * MiB, 0)
        assert line == f"disk tier: 40.0 MiB on {vol / 'b-1'} (free 56.0 MiB, held 0 B)"
        assert not over and disk_space.describe(vol / "b-1", 60 * MiB, 0)[1]
    # The default 32 GiB where the drive has room for it.
    big = ModelSpec.make({"path": "demo", "disk_cache_dir": str(tmp_path)})
    if disk_space.free_bytes(tmp_path) > 130 << 30:
        assert disk_budgets([(big, "x-1")])[0]["x-1"] == 32 * GiB
    else:
        assert disk_budgets([(big, "x-1")])[0]["x-1"] <= disk_space.free_bytes(tmp_path) // 2

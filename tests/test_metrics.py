"""Metrics add up: a known workload's usage fields equal the Prometheus counters,
per model and backend, on the backends and on the proxy; `kvroute stats` agrees."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections import defaultdict

import openai
import pytest
from tests.harness import BackendProcess, free_port, request, wait_until
from prometheus_client.parser import text_string_to_metric_families

from kvroute.core.misses import REASONS


def samples(url: str) -> dict:
    """{(sample name, frozenset(labels)): value} of a /metrics page."""
    status, _, data = request(url + "/metrics")
    assert status == 200
    out = {}
    for family in text_string_to_metric_families(data.decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(metrics: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in metrics.items()
               if n == name and all((k, val) in ls for k, val in labels.items()))


@pytest.fixture(scope="module")
def system(text_model, tmp_path_factory, redis_server):
    logs = tmp_path_factory.mktemp("metrics")
    redis = redis_server.database()
    common = ["--redis-url", redis.url, "--secret", "m"]
    backends = [BackendProcess(text_model, "alpha", logs, backend_id="alpha-1", extra=common),
                BackendProcess(text_model, "beta", logs, backend_id="beta-1", extra=common)]
    for b in backends:
        b.start()
    port = free_port()
    proxy = subprocess.Popen([sys.executable, "-m", "kvroute.cli", "proxy", "--redis-url", redis.url,
                              "--secret", "m", "--port", str(port)],
                             stdout=open(logs / "proxy.log", "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: len(json.loads(request(url + "/health")[2])["backends"]) == 2, 30)
    yield {"proxy": url, "backends": {b.backend_id: b for b in backends}}
    proxy.terminate()
    proxy.wait(10)
    for b in backends:
        b.stop()


def test_every_series_exists_before_its_first_event(system):
    """Grafana shows "No data" for a series until it exists, and rate() misses the event
    that creates it: evictions, failovers and every reason are there, at 0, from the start."""
    proxy = samples(system["proxy"])
    for bid, backend in system["backends"].items():
        own = samples(backend.url)
        labels = {"model": backend.model_id, "backend": bid}
        for name in ("kvroute_backend_evictions_total", "kvroute_backend_disk_evictions_total",
                     "kvroute_backend_commits_total", "kvroute_backend_cache_reasons_total",
                     "kvroute_backend_prefill_seconds_lost_total"):
            assert any(n == name and set(labels.items()) <= ls for n, ls in own), (name, bid)
        assert ("kvroute_proxy_failovers_total", frozenset({("backend", bid)})) in proxy
        for reason in REASONS:
            assert ("kvroute_proxy_cache_reasons_total",
                    frozenset({("model", backend.model_id), ("reason", reason)})) in proxy
        for kind in ("prompt", "cached", "generated"):
            assert ("kvroute_proxy_team_tokens_total", frozenset(
                {("team", "other"), ("model", backend.model_id), ("kind", kind)})) in proxy


@pytest.fixture(scope="module")
def workload(system):
    """3 conversations x 4 turns per model; returns the usage sums per (model, backend)."""
    client = openai.OpenAI(base_url=system["proxy"] + "/v1", api_key="x", max_retries=0)
    expected = defaultdict(lambda: defaultdict(int))  # (model, backend) -> field -> sum
    for model in ("alpha", "beta"):
        for c in range(3):
            messages = [{"role": "system", "content": f"{uuid.uuid4().hex} conversation {c}"},
                        {"role": "user", "content": "Hello."}]
            for turn in range(4):
                raw = client.chat.completions.with_raw_response.create(model=model, messages=messages)
                r = raw.parse()
                key = (model, raw.headers["x-kvroute-backend"])
                expected[key]["prompt"] += r.usage.prompt_tokens
                expected[key]["cached"] += r.usage.prompt_tokens_details.cached_tokens
                expected[key]["completion"] += r.usage.completion_tokens
                expected[key]["requests"] += 1
                messages += [{"role": "assistant", "content": r.choices[0].message.content},
                             {"role": "user", "content": f"Turn {turn}."}]
    return expected


def test_token_counters_equal_the_usage_sums(system, workload):
    expected = workload
    proxy = samples(system["proxy"])
    assert set(expected) == {("alpha", "alpha-1"), ("beta", "beta-1")}
    for (model, backend), sums in expected.items():
        assert sums["cached"] > 0  # turns 2-4 hit
        b = samples(system["backends"][backend].url)
        labels = {"model": model, "backend": backend}
        assert value(b, "kvroute_backend_prompt_tokens_total", **labels) == sums["prompt"]
        assert value(b, "kvroute_backend_cached_tokens_total", **labels) == sums["cached"]
        assert value(b, "kvroute_backend_completion_tokens_total", **labels) == sums["completion"]
        assert value(b, "kvroute_backend_finished_total", exit="eos", **labels) == sums["requests"]
        assert value(b, "kvroute_backend_requests_total", status="200", **labels) == sums["requests"]
        assert value(b, "kvroute_backend_ttft_seconds_count", **labels) == sums["requests"]
        # The parts of each TTFT before the engine and in its queue: one each per
        # request, together within the TTFTs.
        assert value(b, "kvroute_backend_prepare_seconds_count", **labels) == sums["requests"]
        assert value(b, "kvroute_backend_queue_seconds_count", **labels) == sums["requests"]
        assert 0 < value(b, "kvroute_backend_prepare_seconds_sum", **labels) + value(
            b, "kvroute_backend_queue_seconds_sum", **labels) < value(
            b, "kvroute_backend_ttft_seconds_sum", **labels)
        # Of the part before the engine, the prompt's template and tokens: one per request.
        assert value(b, "kvroute_backend_prompt_seconds_count", **labels) == sums["requests"]
        assert 0 < value(b, "kvroute_backend_prompt_seconds_sum", **labels) <= value(
            b, "kvroute_backend_prepare_seconds_sum", **labels)
        assert value(proxy, "kvroute_proxy_prompt_tokens_total", **labels) == sums["prompt"]
        assert value(proxy, "kvroute_proxy_cached_tokens_total", **labels) == sums["cached"]
        assert value(proxy, "kvroute_proxy_requests_total", status="200", **labels) == sums["requests"]
        assert value(proxy, "kvroute_proxy_ttft_seconds_count", model=model) == sums["requests"]
    stats = json.loads(request(system["proxy"] + "/stats")[2])
    total_prompt = sum(s["prompt"] for s in expected.values())
    total_cached = sum(s["cached"] for s in expected.values())
    assert stats["totals"]["prompt_tokens"] == total_prompt
    assert stats["totals"]["cached_tokens"] == total_cached
    assert {m: s["prompt_tokens"] for m, s in stats["models"].items()} == {
        model: sums["prompt"] for (model, _), sums in expected.items()}


def test_stats_command_prints_the_metrics_hit_ratio(system, workload):
    proxy = samples(system["proxy"])
    ratio = (value(proxy, "kvroute_proxy_cached_tokens_total")
             / value(proxy, "kvroute_proxy_prompt_tokens_total"))
    out = subprocess.run([sys.executable, "-m", "kvroute.cli", "stats", "--url", system["proxy"]],
                         capture_output=True, text=True, timeout=30, env={"COLUMNS": "160", "PATH": ""})
    assert out.returncode == 0, out.stderr
    assert f"{ratio * 100:.1f}%" in out.stdout, out.stdout


def test_a_streamed_answer_counts_when_its_first_chunk_left_the_backend(system, workload):
    """The end of the TTFT the client sees: each streamed request adds one observation
    of its first token's way from the engine to the client's connection; whole answers
    add none."""
    backend = system["backends"]["alpha-1"]
    labels = {"model": "alpha", "backend": "alpha-1"}
    name = "kvroute_backend_first_chunk_send_seconds"
    before = samples(backend.url)
    assert value(before, name + "_count", **labels) == 0  # the workload streamed nothing
    client = openai.OpenAI(base_url=system["proxy"] + "/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(
        model="alpha", stream=True, max_tokens=8,
        messages=[{"role": "user", "content": f"{uuid.uuid4().hex} Hello."}])
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    after = samples(backend.url)
    assert value(after, name + "_count", **labels) == 1
    assert 0 < value(after, name + "_sum", **labels) < 5.0

"""The routing policies as pure functions of a constructed RouteContext (no processes)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvroute.proxy.policy.interface import Candidate, Load, PolicyConfig, RouteContext
from kvroute.proxy.policy.policies import POLICIES, CacheAware, make_policy

# 9 blocks of 400 bytes; block 0 is the model's shared header.
CHAIN = list(range(100, 109))
ENDS = [40 + 400 * i for i in range(len(CHAIN))]
REQUEST = ENDS[-1]


def cand(bid: str, advertised: int = 0, expected: int = 0, *, inflight: int = 0, queue: int = 0,
         unanswered: float = 0.0, tps: float = 1000.0, suspect: bool = False) -> Candidate:
    return Candidate(bid, f"http://{bid}", advertised, expected,
                     Load(unanswered, inflight, waiting=queue, prefill_tps=tps), suspect=suspect)


def ctx(*cands: Candidate, known: bool = True) -> RouteContext:
    return RouteContext(list(cands), CHAIN, ENDS, REQUEST, known)


def policy(name: str, **kw):
    return make_policy(PolicyConfig(name=name, **kw))


def test_every_named_policy_exists_and_unknown_names_are_refused():
    for name in POLICIES:
        assert policy(name).name == name
    with pytest.raises(ValueError, match="unknown policy"):
        policy("fastest")


def test_cache_aware_prefers_the_advertised_prefix_and_marks_only_what_is_missing():
    d = policy("cache-aware").choose(ctx(cand("a"), cand("b", advertised=5)))
    assert (d.candidate.backend_id, d.reason) == ("b", "cache-hit")
    assert d.predicted_tokens == (ENDS[4] - ENDS[0]) // 4
    assert d.prefill_tokens == (REQUEST - (ENDS[4] - ENDS[0])) / 4
    assert d.mark  # blocks 5..8 are not held yet
    full = policy("cache-aware").choose(ctx(cand("a"), cand("b", advertised=len(CHAIN))))
    assert full.candidate.backend_id == "b" and not full.mark


def test_cache_aware_follows_an_expected_prefix_as_a_pending_hit():
    d = policy("cache-aware").choose(ctx(cand("a", advertised=1), cand("b", expected=6)))
    assert (d.candidate.backend_id, d.reason) == ("b", "pending-hit")
    assert d.mark


def test_matching_the_header_alone_is_no_hit():
    d = policy("cache-aware").choose(ctx(cand("a", advertised=1), cand("b", advertised=1)))
    assert d.reason == "load" and d.predicted_tokens == 0


def test_cache_aware_leaves_a_deep_prefix_once_its_queue_costs_more_than_the_slack():
    busy = cand("b", advertised=8, unanswered=50_000)  # 50 s of queued prefill at 1000 tok/s
    d = policy("cache-aware", locality_slack=1.0).choose(ctx(cand("a"), busy))
    assert (d.candidate.backend_id, d.reason) == ("a", "load")
    slightly = cand("b", advertised=8, unanswered=1_000)  # within slack of the idle one
    d = policy("cache-aware", locality_slack=1.0).choose(ctx(cand("a"), slightly))
    assert d.candidate.backend_id == "b"


def test_cache_aware_without_a_registry_answer_routes_by_load():
    d = policy("cache-aware").choose(ctx(cand("a", inflight=3), cand("b", inflight=1), known=False))
    assert (d.candidate.backend_id, d.reason) == ("b", "no-registry")
    assert d.mark  # remembered locally so a concurrent burst still lands together


def test_cache_aware_spreads_equal_candidates():
    p = policy("cache-aware")
    chosen = Counter(p.choose(ctx(cand("a"), cand("b"), cand("c"))).candidate.backend_id
                     for _ in range(30))
    assert set(chosen) == {"a", "b", "c"}


def test_suspects_only_when_nothing_else_is_left():
    for name in POLICIES:
        d = policy(name).choose(ctx(cand("a", advertised=8, suspect=True), cand("b")))
        assert d.candidate.backend_id == "b", name
        d = policy(name).choose(ctx(cand("a", suspect=True)))
        assert d.candidate.backend_id == "a", name


def test_round_robin_cycles_in_backend_order_and_never_marks():
    p = policy("round-robin")
    c = ctx(cand("c"), cand("a", advertised=8), cand("b"))
    picks = [p.choose(c) for _ in range(6)]
    assert [d.candidate.backend_id for d in picks] == ["a", "b", "c", "a", "b", "c"]
    assert all(d.reason == "round-robin" and not d.mark for d in picks)


def test_least_loaded_counts_this_proxys_and_reported_requests():
    p = policy("least-loaded")
    d = p.choose(ctx(cand("a", inflight=1, queue=4), cand("b", inflight=2, queue=1)))
    assert (d.candidate.backend_id, d.reason) == ("b", "least-loaded")
    tie = p.choose(ctx(cand("a", inflight=1, unanswered=500), cand("b", inflight=1)))
    assert tie.candidate.backend_id == "b"
    assert p.choose(ctx(cand("a"), known=False)).reason == "no-registry"


def test_equally_loaded_backends_take_turns_without_a_registry():
    for name in ("least-loaded", "cache-aware"):
        p = policy(name)
        c = ctx(cand("a"), cand("b"), cand("c", inflight=1), known=False)
        picks = Counter(p.choose(c).candidate.backend_id for _ in range(10))
        assert picks == {"a": 5, "b": 5}, (name, picks)


def test_random_draws_from_the_pool():
    p = make_policy(PolicyConfig(name="random"))
    p._random = random.Random(7)
    picks = {p.choose(ctx(cand("a"), cand("b"))).candidate.backend_id for _ in range(40)}
    assert picks == {"a", "b"}


def test_ttft_estimate_counts_other_proxies_queue():
    p = CacheAware(PolicyConfig(per_request_wait=0.5))
    alone = p.ttft(ctx(), cand("a", inflight=2, queue=2))
    crowded = p.ttft(ctx(), cand("a", inflight=2, queue=6))
    assert crowded - alone == pytest.approx(4 * 0.5)


def test_an_empty_context_is_refused():
    with pytest.raises(ValueError):
        policy("cache-aware").choose(ctx())

"""The cost function (proxy/policy/cost.py): each documented term moves the estimate the
way a user of the fleet relies on."""

import pytest

from kvroute.proxy.policy.cost import CostInput, CostWeights, calibrated_rate, cost, fleet_median

W = CostWeights()


def test_cached_prefix_saves_its_prefill():
    cold = cost(CostInput(prompt_tokens=2000, prefill_tps=1000))
    warm = cost(CostInput(prompt_tokens=2000, matched_tokens=1500, prefill_tps=1000))
    assert cold.ttft == pytest.approx(2.0)
    assert warm.ttft == pytest.approx(0.5)


def test_queued_work_and_other_proxies_requests_add_wait():
    base = CostInput(prompt_tokens=1000, prefill_tps=1000)
    queued = CostInput(prompt_tokens=1000, prefill_tps=1000, queued_tokens=3000, other_requests=5)
    assert cost(queued).ttft == pytest.approx(cost(base).ttft + 3.0 + 5 * W.per_request_wait)


def test_decode_occupancy_slows_prefill():
    idle = cost(CostInput(prompt_tokens=1000, prefill_tps=1000, max_batch=8))
    half = cost(CostInput(prompt_tokens=1000, prefill_tps=1000, max_batch=8, decoding=4))
    assert half.occupancy == pytest.approx(0.5)
    assert half.prefill == pytest.approx(idle.prefill * (1 + W.decode_weight * 0.5))
    assert half.slot_wait == 0.0


def test_full_batch_waits_for_a_slot():
    full = cost(CostInput(prompt_tokens=100, prefill_tps=1000, max_batch=4, decoding=4,
                          decode_steps_per_s=10, reply_tokens=200))
    # The first of 4 sequences ends after 200 / 5 steps at 10 steps/s.
    assert full.slot_wait == pytest.approx(4.0)
    idle = cost(CostInput(prompt_tokens=100, prefill_tps=1000, max_batch=4))
    assert full.ttft > idle.ttft + 4.0


def test_unknown_batch_size_has_no_decode_terms():
    c = cost(CostInput(prompt_tokens=100, prefill_tps=1000, decoding=50))
    assert c.occupancy == 0.0 and c.slot_wait == 0.0


def test_restore_tokens_cost_their_read_not_a_prefill():
    x = CostInput(prompt_tokens=10000, matched_tokens=0, restore_tokens=8000, prefill_tps=1000,
                  restore_tps=40000)
    c = cost(x)
    assert c.restore == pytest.approx(0.2)
    assert c.prefill == pytest.approx(2.0)
    # Never more restored than the unmatched part.
    over = cost(CostInput(prompt_tokens=100, matched_tokens=90, restore_tokens=500,
                          prefill_tps=1000, restore_tps=1000))
    assert over.restore == pytest.approx(0.01) and over.prefill == 0.0


def test_defaults_when_unmeasured():
    c = cost(CostInput(prompt_tokens=W.default_prefill_tps))
    assert c.ttft == pytest.approx(1.0)


def test_calibrated_rate_ignores_small_differences():
    fleet = fleet_median([900.0, 1100.0, 0.0])
    assert fleet == 1000.0
    # The busier backend measured faster: no advantage from it.
    assert calibrated_rate(1500.0, fleet, 2.0) == fleet
    assert calibrated_rate(700.0, fleet, 2.0) == fleet
    assert calibrated_rate(0.0, fleet, 2.0) == fleet  # not measured yet
    # Really different hardware counts.
    assert calibrated_rate(5000.0, fleet, 2.0) == 5000.0
    assert calibrated_rate(100.0, fleet, 2.0) == 100.0
    assert calibrated_rate(300.0, 0.0, 2.0) == 300.0

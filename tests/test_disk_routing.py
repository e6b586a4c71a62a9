"""Tier-aware routing as pure functions of a RouteContext: RAM beats disk beats cold,
and a disk hit beats a long queue."""

from __future__ import annotations

import dataclasses

from tests.test_policy import CHAIN, cand, ctx, policy

FULL = len(CHAIN)


def disk(c, depth: int, restore_tps: float = 20000.0):
    return dataclasses.replace(c, disk_depth=depth, restore_tps=restore_tps)


def test_ram_hit_beats_the_same_hit_on_disk():
    d = policy("cache-aware").choose(ctx(disk(cand("d"), FULL), cand("r", advertised=FULL)))
    assert (d.candidate.backend_id, d.reason) == ("r", "cache-hit")


def test_disk_hit_beats_a_cold_prefill():
    d = policy("cache-aware").choose(ctx(cand("cold"), disk(cand("d"), FULL)))
    assert (d.candidate.backend_id, d.reason) == ("d", "disk-hit")
    assert d.predicted_tokens > 0


def test_disk_hit_beats_a_long_queue_on_the_ram_holder():
    busy = cand("r", advertised=FULL, unanswered=50_000.0)  # 50 s of queued prefill
    d = policy("cache-aware").choose(ctx(busy, disk(cand("d"), FULL)))
    assert (d.candidate.backend_id, d.reason) == ("d", "disk-hit")


def test_a_slow_disk_counts_its_restore_time():
    # Restoring at 1 token/s is slower than prefilling at 1000: the estimate says so.
    slow = disk(cand("d"), FULL, restore_tps=1.0)
    p = policy("cache-aware", locality_slack=0.0)
    assert p.choose(ctx(cand("cold"), slow)).candidate.backend_id == "cold"

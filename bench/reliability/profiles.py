"""How big a run is: clients, rates and fault windows of each variant."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Profile:
    name: str
    clients: int = 200  # concurrent streaming clients of one load round
    warmup_clients: int = 200
    disconnect_share: float = 0.2
    load_rounds: int = 1
    soak_seconds: float = 0.0  # > 0: repeat load rounds until this much time has passed
    rate: float = 4.0  # requests/s of the steady workload
    conversations: int = 8
    baseline_s: float = 5.0  # steady workload before the first fault
    stop_s: float = 5.0  # SIGSTOP of a backend (> the 3 s heartbeat TTL)
    redis_pause_s: float = 10.0  # Redis unreachable
    recover_min_s: float = 8.0  # watch at least this long after a fault is lifted
    recover_max_s: float = 20.0  # ... and at most this long
    hits_to_recover: int = 8  # consecutive follow-up hits that count as "routing is back"
    long_streams: int = 2  # long counting streams in flight alongside the conversations
    # Small on purpose: the stores evict all the time, so withdrawals run under every fault.
    cache_bytes: str = "16MiB"


PROFILES = {
    "full": Profile("full", load_rounds=3, rate=6.0, conversations=12),
    # More clients than the two backends admit (2 x --max-queue 64), so 429s happen.
    "quick": Profile("quick", clients=160, warmup_clients=160, baseline_s=4.0, stop_s=5.0,
                     redis_pause_s=6.0, recover_min_s=3.0, recover_max_s=20.0, hits_to_recover=6),
}


def soak_profile(seconds: float) -> Profile:
    return Profile("soak", soak_seconds=seconds, load_rounds=3, rate=6.0, conversations=12,
                   stop_s=15.0, redis_pause_s=30.0, recover_max_s=40.0, hits_to_recover=12)

"""The cost function: estimated time to first token of a request on one backend.

Pure code, no I/O: the policy feeds it what the registry and this proxy know of
each candidate and picks the cheapest. Every term is in seconds:

    ttft = slot_wait + queue + other_queue + restore + prefill

    prefill     = (prompt - matched - restore_tokens) / effective_rate
    queue       = queued_tokens / effective_rate       prefill work this proxy sent
                                                       there and has not seen answered
    other_queue = other_requests * per_request_wait    requests other proxies queued there
    restore     = restore_tokens / restore_tps         tokens read back from disk
                                                       instead of prefilled
    effective_rate = prefill_tps / (1 + decode_weight * occupancy)
    occupancy   = decoding / max_batch                 (0 when max_batch is unknown)
    slot_wait   = reply_tokens / (decoding + 1) / decode_steps_per_s
                  only when the batch is full (decoding >= max_batch): a new
                  sequence waits for the first decoding one to finish, which with
                  remaining lengths spread evenly over [0, reply_tokens] takes
                  reply_tokens / (decoding + 1) steps.

Decode load enters twice: a batch busy decoding interleaves its decode steps with
a new prompt's prefill chunks (occupancy slows the prefill), and a full batch
admits nobody until a sequence ends (slot_wait).

Rates are per model and calibrated (`calibrated_rate`): a backend's own measured
prefill rate counts only when it differs from the model's fleet median by more
than `rate_trust` times. Measured rates depend on the traffic a backend got (batch
sizes, warm kernels): trusting small differences would let the backend that gets
traffic win every tie and so keep getting it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CostWeights:
    per_request_wait: float = 0.02  # seconds a request queued by another proxy costs
    decode_weight: float = 1.0  # prefill slowdown at a batch full of decodes (1: half speed)
    default_prefill_tps: float = 1000.0  # no backend of the model has measured itself yet
    default_decode_steps_per_s: float = 20.0
    default_reply_tokens: float = 128.0
    default_restore_tps: float = 20000.0  # tokens/s read back from a disk tier
    rate_trust: float = 2.0  # own rate used only beyond this factor from the fleet median


@dataclass(frozen=True)
class CostInput:
    """One candidate, as the cost function sees it (tokens are estimates)."""

    prompt_tokens: float
    matched_tokens: float = 0.0  # held in the backend's KV (advertised or pending)
    restore_tokens: float = 0.0  # held on the backend's disk tier, beyond matched
    queued_tokens: float = 0.0
    other_requests: int = 0
    decoding: int = 0
    max_batch: int = 0  # 0 = unknown: no occupancy term, never "full"
    prefill_tps: float = 0.0  # calibrated; 0 = use the default
    decode_steps_per_s: float = 0.0
    reply_tokens: float = 0.0
    restore_tps: float = 0.0


@dataclass(frozen=True)
class Cost:
    ttft: float
    prefill: float
    queue: float
    other_queue: float
    restore: float
    slot_wait: float
    occupancy: float


def cost(x: CostInput, w: CostWeights = CostWeights()) -> Cost:
    rate = x.prefill_tps if x.prefill_tps > 0 else w.default_prefill_tps
    occupancy = min(1.0, x.decoding / x.max_batch) if x.max_batch > 0 else 0.0
    effective = rate / (1.0 + w.decode_weight * occupancy)
    restore_tokens = max(0.0, min(x.restore_tokens, x.prompt_tokens - x.matched_tokens))
    unmatched = max(0.0, x.prompt_tokens - x.matched_tokens - restore_tokens)
    prefill = unmatched / effective
    queue = max(0.0, x.queued_tokens) / effective
    other_queue = max(0, x.other_requests) * w.per_request_wait
    restore = restore_tokens / (x.restore_tps if x.restore_tps > 0 else w.default_restore_tps)
    slot_wait = 0.0
    if x.max_batch > 0 and x.decoding >= x.max_batch:
        steps = x.decode_steps_per_s if x.decode_steps_per_s > 0 else w.default_decode_steps_per_s
        reply = x.reply_tokens if x.reply_tokens > 0 else w.default_reply_tokens
        slot_wait = reply / (x.decoding + 1) / steps
    total = slot_wait + queue + other_queue + restore + prefill
    return Cost(total, prefill, queue, other_queue, restore, slot_wait, occupancy)


def fleet_median(values: list[float]) -> float:
    """The median of the measured (positive) values; 0 when none has measured."""
    m = sorted(v for v in values if v > 0)  # a handful of backends: cheaper than statistics
    if not m:
        return 0.0
    half = len(m) // 2
    return m[half] if len(m) % 2 else (m[half - 1] + m[half]) / 2


def calibrated_rate(own: float, fleet: float, trust: float) -> float:
    """The rate the cost uses for one backend: the fleet median unless the backend's
    own measurement is more than `trust` times off it (really different hardware)."""
    if fleet <= 0:
        return own
    if own <= 0 or fleet / trust <= own <= fleet * trust:
        return fleet
    return own

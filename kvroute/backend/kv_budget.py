"""What a prompt-cache entry costs and what the budgets keep: the KV bytes one more
token adds (measured by running the model), how long a prompt one entry may hold in
RAM and on disk (said once at start), and warnings for commits over the budgets, at
most one of a kind a minute."""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from kvroute.core.sizes import format_bytes

from .store import cache_nbytes

log = logging.getLogger("kvroute.backend.kv_budget")

KV_PROBE = 256  # tokens per chunk that measures KV bytes per token: mlx-lm's cache step

# Why a commit was kept nowhere (Commit.refused, Commit.disk_refused), in words.
REFUSALS = {
    "no_disk_tier": "there is no disk tier (--disk-cache-dir)",
    "over_disk_budget": "it is over the disk tier's budget too",
    "disk_queue_full": "the disk tier's write queue is full",
    "disk_failing": "the disk tier's writes are failing",
}
WARN_EVERY = 60.0  # seconds between two warnings of one kind


class Warnings:
    """A warning of each kind at most every `every` seconds, never none: the first
    is logged at once, later ones say how many were left out meanwhile."""

    def __init__(self, logger: logging.Logger, every: float = WARN_EVERY):
        self.logger, self.every = logger, every
        self._last: dict[str, float] = {}
        self._held: collections.Counter = collections.Counter()

    def warn(self, kind: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -self.every) < self.every:
            self._held[kind] += 1
            return
        self._last[kind] = now
        held = self._held.pop(kind, 0)
        suffix = f" ({held} more like it since the last one)" if held else ""
        self.logger.warning(message + suffix, *args)


def kv_rate(model: Any) -> tuple[float, int]:
    """(bytes of KV one more token adds to a prompt-cache entry, bytes an entry costs
    whatever its length): two chunks of KV_PROBE tokens through a fresh cache. Sliding
    windows and recurrent states stop growing, so a long entry pays at most this rate."""
    cache = make_prompt_cache(model)
    sizes = []
    for salt in (0, 1):
        model(mx.array([probe_tokens(KV_PROBE, salt=salt)]), cache=cache)
        mx.eval([c.state for c in cache])
        sizes.append(cache_nbytes(cache))
    per_token = (sizes[1] - sizes[0]) / KV_PROBE
    return per_token, max(0, int(sizes[0] - per_token * KV_PROBE))


def describe_budgets(ram_budget: int, disk_budget: int, rate: tuple[float, int],
                     context_length: int, trimmable: bool = True) -> dict[str, int | None]:
    """Log how many tokens one prompt-cache entry may hold in RAM and on disk (the
    budget over the KV bytes a token costs: `rate`, as `kv_rate` measures it), and warn where that is less
    than the model's context: a longer prompt keeps only a prefix in RAM (only its
    checkpoints that fit, where the model's cache cannot be cut: `trimmable` False),
    and goes whole to the disk tier where there is one. Returns both counts (None: no
    disk tier, or entries that do not grow with their length)."""
    per_token, fixed = rate

    def fits(budget: int) -> int | None:
        if per_token <= 0:
            return None  # e.g. recurrent states only: an entry's size does not grow
        return max(0, int((budget - fixed) // per_token))

    def count(n: int | None) -> str:
        return "any number of" if n is None else f"{n:,}"

    ram = fits(ram_budget)
    disk = fits(disk_budget) if disk_budget > 0 else None
    log.info("one prompt-cache entry holds up to %s tokens in RAM (cache budget %s) and %s on "
             "disk, at %s of KV per token; the model's context is %s tokens", count(ram),
             format_bytes(ram_budget), "none" if disk_budget <= 0 else count(disk),
             format_bytes(per_token), f"{context_length:,}")
    if ram is not None and ram < context_length:
        kept = (f"RAM keeps only their first {ram:,} tokens" if trimmable
                else "RAM keeps only their checkpoints that fit (this model's cache cannot be cut)")
        rest = (", the disk tier the whole" if disk_budget > 0 and (disk is None or disk > ram)
                else "; raise --cache-bytes or add a disk tier (--disk-cache-dir) to keep them")
        log.warning("prompts over %s tokens are over the RAM cache budget (%s): %s%s",
                    f"{ram:,}", format_bytes(ram_budget), kept, rest)
    if disk is not None and disk < context_length:
        log.warning("prompts over %s tokens are over the disk tier's budget (%s) as well",
                    f"{disk:,}", format_bytes(disk_budget))
    return {"ram_tokens": ram, "disk_tokens": disk}


def probe_tokens(n: int, salt: int = 0) -> list[int]:
    """Tokens to run a model on where their text does not matter (measurements, warm-up):
    ids below 1000 exist in every vocabulary."""
    return [(31 * i + salt) % 997 + 3 for i in range(n)]

"""What this proxy has routed, for `/stats`, the dashboard and `kvroute stats`.

Every figure here is counted from the proxied requests themselves (the backend's
`x-kvroute-prompt-tokens`, `-cached-tokens` and `-ttft-ms` headers), the same
sources as this proxy's Prometheus counters, so the dashboard and `/metrics`
agree. Memory is bounded: fixed-size rings of samples, points and decisions.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvroute.core.hits import is_cache_hit
from kvroute.core.misses import REASONS

DASHBOARD = Path(__file__).with_name("dashboard.html")  # the page that draws them (package data)
SERIES_POINTS = 300  # one point every SERIES_PERIOD seconds: 10 minutes
SERIES_PERIOD = 2.0
TTFT_SAMPLES = 1000
DECISIONS = 50
DRIFT_LOG_EVERY = 60.0  # seconds between two template-drift warnings of one model


@dataclass
class Counts:
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    seconds_saved: float = 0.0

    def add(self, prompt: int, cached: int, saved: float, error: bool) -> None:
        self.requests += 1
        self.errors += error
        self.prompt_tokens += prompt
        self.cached_tokens += cached
        self.seconds_saved += saved

    def as_dict(self) -> dict:
        return {
            "requests": self.requests,
            "errors": self.errors,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_ratio": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None,
            "seconds_saved": round(self.seconds_saved, 3),
        }


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 2)


@dataclass
class ModelStats:
    counts: Counts = field(default_factory=Counts)
    ttft: dict[str, collections.deque] = field(default_factory=lambda: {
        "cached": collections.deque(maxlen=TTFT_SAMPLES),
        "cold": collections.deque(maxlen=TTFT_SAMPLES),
    })

    def ttft_summary(self) -> dict:
        return {
            kind: {"p50": _percentile(list(s), 0.5), "p95": _percentile(list(s), 0.95),
                   "count": len(s)}
            for kind, s in self.ttft.items()
        }


@dataclass
class Missed:
    """Requests of one cache reason, and the prompt tokens and prefill seconds it lost."""

    requests: int = 0
    lost_tokens: int = 0
    seconds_lost: float = 0.0

    def as_dict(self) -> dict:
        return {"requests": self.requests, "lost_tokens": self.lost_tokens,
                "seconds_lost": round(self.seconds_lost, 3)}


@dataclass
class TeamCounts(Counts):
    """One team's figures for one model (each answered request, once it ended)."""

    generated_tokens: int = 0
    seconds_lost: float = 0.0

    def merge(self, other: "TeamCounts") -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict:
        return {**super().as_dict(), "generated_tokens": self.generated_tokens,
                "seconds_lost": round(self.seconds_lost, 3)}


def status_class(status: int) -> str:
    return f"{status // 100}xx"


class Stats:
    def __init__(self, teams: list[str] | None = None) -> None:
        self.started = time.time()
        self.totals = Counts()
        self.models: dict[str, ModelStats] = {}
        self.backends: dict[str, Counts] = {}
        self.series: collections.deque = collections.deque(maxlen=SERIES_POINTS)
        self.decisions: collections.deque = collections.deque(maxlen=DECISIONS)
        # Requests per client API (chat, completions, responses, messages), refused ones too.
        self.apis: dict[str, dict[str, int]] = {}
        # Every request to those APIs by status class (2xx, 4xx, 5xx), refused ones too.
        self.statuses: dict[str, int] = {"2xx": 0, "4xx": 0, "5xx": 0}
        self.reasons = {reason: Missed() for reason in REASONS}
        self.teams: dict[str, dict[str, TeamCounts]] = {team: {} for team in teams or []}
        self.limited: dict[str, dict[str, int]] = {team: {} for team in teams or []}
        self.drift: dict[str, dict] = {}  # model -> its last template drift

    def count_api(self, api: str, status: int) -> None:
        counts = self.apis.setdefault(api, {"requests": 0, "errors": 0})
        counts["requests"] += 1
        counts["errors"] += status >= 400
        cls = status_class(status)
        self.statuses[cls] = self.statuses.get(cls, 0) + 1

    def record(self, *, model: str, backend: str, reason: str, prefix_blocks: int,
               predicted_tokens: int, status: int, prompt_tokens: int | None,
               cached_tokens: int | None, ttft_ms: float | None, prefill_tps: float,
               team: str = "", miss=None, seconds_lost: float = 0.0) -> None:
        prompt, cached = prompt_tokens or 0, cached_tokens or 0
        saved = cached / prefill_tps if prefill_tps > 0 else 0.0
        error = status >= 400
        self.totals.add(prompt, cached, saved, error)
        m = self.models.setdefault(model, ModelStats())
        m.counts.add(prompt, cached, saved, error)
        self.backends.setdefault(backend, Counts()).add(prompt, cached, saved, error)
        if ttft_ms is not None and not error:
            m.ttft["cached" if is_cache_hit(cached, prompt) else "cold"].append(ttft_ms)
        if miss is not None:
            missed = self.reasons.setdefault(miss.reason, Missed())
            missed.requests += 1
            missed.lost_tokens += miss.lost
            missed.seconds_lost += seconds_lost
        self.decisions.appendleft({
            "t": time.time(), "model": model, "backend": backend, "reason": reason,
            "prefix_blocks": prefix_blocks, "predicted_tokens": predicted_tokens,
            "cached_tokens": cached_tokens, "prompt_tokens": prompt_tokens,
            "ttft_ms": ttft_ms, "status": status, "team": team,
            "cache_reason": miss.reason if miss is not None else None,
            "lost_tokens": miss.lost if miss is not None else 0,
            "diverged_at": miss.diverged_at if miss is not None else None,
        })

    def count_team(self, team: str, model: str, counts: TeamCounts) -> None:
        self.teams.setdefault(team, {}).setdefault(model, TeamCounts()).merge(counts)

    def count_limited(self, team: str, limit: str) -> None:
        by_limit = self.limited.setdefault(team, {})
        by_limit[limit] = by_limit.get(limit, 0) + 1

    def note_drift(self, model: str, backend: str, position: int | None, predicted: int,
                   cached: int) -> bool:
        """Keep a model's last template drift; True when it is time to log one again."""
        now = time.time()
        last = self.drift.get(model)
        self.drift[model] = {"t": now, "backend": backend, "position": position,
                             "predicted_tokens": predicted, "cached_tokens": cached,
                             "count": (last or {}).get("count", 0) + 1,
                             "logged": (last or {}).get("logged", 0.0)}
        if now - self.drift[model]["logged"] < DRIFT_LOG_EVERY:
            return False
        self.drift[model]["logged"] = now
        return True

    def sample(self, backends: list[dict]) -> None:
        """One point of the time series (cumulative counters), every SERIES_PERIOD s."""
        self.series.append({
            "t": time.time(),
            "models": {
                name: {k: v for k, v in m.counts.as_dict().items()
                       if k in ("prompt_tokens", "cached_tokens", "seconds_saved", "requests")}
                for name, m in self.models.items()
            },
            "backends": {b["id"]: {"cache_bytes": b["cache_bytes"], "queue_depth": b["queue_depth"]}
                         for b in backends},
            "reasons": {reason: m.requests for reason, m in self.reasons.items()},
        })

    def snapshot(self, backends: list[dict]) -> dict:
        out_backends = []
        for b in backends:
            counts = self.backends.get(b["id"], Counts()).as_dict()
            out_backends.append({**b, "requests": counts["requests"],
                                 "prompt_tokens": counts["prompt_tokens"],
                                 "cached_tokens": counts["cached_tokens"],
                                 "hit_ratio": counts["hit_ratio"]})
        return {
            "now": time.time(),
            "uptime_s": round(time.time() - self.started, 1),
            "totals": self.totals.as_dict(),
            "apis": {api: dict(counts) for api, counts in sorted(self.apis.items())},
            "models": {name: {**{k: v for k, v in m.counts.as_dict().items() if k != "errors"},
                              "ttft_ms": m.ttft_summary()}
                       for name, m in self.models.items()},
            "backends": out_backends,
            "cache": cache_totals(out_backends),
            "series": list(self.series),
            "decisions": list(self.decisions),
            "statuses": dict(self.statuses),
            "reasons": {reason: m.as_dict() for reason, m in self.reasons.items()},
            "teams": {team: self._team(models, self.limited.get(team, {}))
                      for team, models in self.teams.items()},
            "drift": {model: {k: v for k, v in d.items() if k != "logged"}
                      for model, d in self.drift.items()},
        }

    @staticmethod
    def _team(models: dict[str, TeamCounts], limited: dict[str, int]) -> dict:
        total = TeamCounts()
        for counts in models.values():
            total.merge(counts)
        return {**total.as_dict(), "limited": dict(limited),
                "models": {model: c.as_dict() for model, c in sorted(models.items())}}


def cache_totals(backends: list[dict]) -> dict:
    """The fleet's prompt caches together: bytes held, what they would hold without
    sharing blocks, and the ratio of the two (1.0: nothing shared)."""
    held = sum(b.get("cache_bytes", 0) for b in backends)
    # A backend that reports no sharing (an older one) holds what it would unshared.
    unshared = sum(max(b.get("cache_bytes_unshared", 0), b.get("cache_bytes", 0)) for b in backends)
    return {"bytes": held, "bytes_unshared": unshared,
            "sharing_ratio": round(unshared / held, 3) if held else 1.0,
            "blocks": sum(b.get("cache_blocks", 0) for b in backends)}

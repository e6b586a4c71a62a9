"""Prometheus metrics of one proxy process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvroute.core.misses import REASONS

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_FAST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


class ProxyMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self._children: dict[tuple, object] = {}
        self.requests = Counter(
            "kvroute_proxy_requests", "Requests by model, backend and HTTP status",
            ["model", "backend", "status"], registry=r,
        )
        self.api_requests = Counter(
            "kvroute_proxy_api_requests", "Requests by client API (chat, completions, responses, "
            "messages) and HTTP status, refused ones included",
            ["api", "status"], registry=r,
        )
        self.decisions = Counter(
            "kvroute_proxy_route_decisions", "Routing decisions by reason",
            ["model", "backend", "reason"], registry=r,
        )
        self.predicted_tokens = Counter(
            "kvroute_proxy_predicted_cached_tokens",
            "Prompt tokens the registry predicted cached (estimated from matched bytes)",
            ["model", "backend"], registry=r,
        )
        self.actual_tokens = Counter(
            "kvroute_proxy_cached_tokens", "Prompt tokens the backend reported cached",
            ["model", "backend"], registry=r,
        )
        self.prompt_tokens = Counter(
            "kvroute_proxy_prompt_tokens", "Prompt tokens the backend reported",
            ["model", "backend"], registry=r,
        )
        self.overhead = Histogram(
            "kvroute_proxy_overhead_seconds",
            "Time from receiving a request to sending it upstream (parse, keys, lookup, choice)",
            buckets=_FAST_BUCKETS, registry=r,
        )
        self.lookup = Histogram(
            "kvroute_proxy_lookup_seconds", "Registry lookup latency", buckets=_FAST_BUCKETS, registry=r
        )
        self.registry_unknown = Counter(
            "kvroute_proxy_registry_unknown", "Lookups answered 'unknown' (Redis down or slow)",
            registry=r,
        )
        self.failovers = Counter(
            "kvroute_proxy_failovers", "Requests retried on another backend after a failure",
            ["backend"], registry=r,
        )
        self.seconds_saved = Counter(
            "kvroute_proxy_prefill_seconds_saved",
            "Cached tokens over the serving backend's measured prefill rate",
            ["model", "backend"], registry=r,
        )
        self.ttft = Histogram(
            "kvroute_proxy_ttft_seconds", "Backend-measured time to first token of routed requests",
            ["model", "cached"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.backend_cache_bytes = Gauge(
            "kvroute_proxy_backend_cache_bytes", "Prompt-cache bytes each backend reports",
            ["backend"], registry=r,
        )
        self.backend_cache_unshared = Gauge(
            "kvroute_proxy_backend_cache_bytes_unshared",
            "What each backend's cache entries would hold without sharing blocks",
            ["backend"], registry=r,
        )
        self.backend_queue_depth = Gauge(
            "kvroute_proxy_backend_queue_depth", "Queue depth each backend reports",
            ["backend"], registry=r,
        )
        self.fingerprint_mismatch = Gauge(
            "kvroute_proxy_backend_fingerprint_mismatch",
            "1 for a live backend whose prefix-key fingerprint (scheme, block size, secret) "
            "differs from this proxy's: its cache is ignored for routing",
            ["backend", "field"], registry=r,
        )
        self.registry_late = Counter(
            "kvroute_proxy_registry_late",
            "Lookups that missed their own deadline (routed by load alone)", registry=r,
        )
        self.inflight = Gauge(
            "kvroute_proxy_inflight", "Requests open to each backend", ["backend"], registry=r
        )
        # Why prompts missed their cache (kvroute/core/misses.py), and each team's figures.
        self.cache_reasons = Counter(
            "kvroute_proxy_cache_reasons", "Answered requests by cache reason: hit, or why "
            "the prompt missed its cache", ["model", "reason"], registry=r,
        )
        self.seconds_lost = Counter(
            "kvroute_proxy_prefill_seconds_lost", "Prefill seconds spent on prompt tokens a "
            "cache held (or had held), by the reason they missed", ["model", "reason"], registry=r,
        )
        self.team_requests = Counter(
            "kvroute_proxy_team_requests", "Answered requests by team (API key scope; other: "
            "no key or no scope) and model", ["team", "model"], registry=r,
        )
        self.team_tokens = Counter(
            "kvroute_proxy_team_tokens", "Tokens by team and model, of kind prompt, cached or "
            "generated", ["team", "model", "kind"], registry=r,
        )
        self.team_seconds = Counter(
            "kvroute_proxy_team_prefill_seconds", "Prefill seconds by team and model: saved by "
            "the cache, or lost to misses", ["team", "model", "kind"], registry=r,
        )
        self.limited = Counter(
            "kvroute_proxy_limited_requests", "Requests refused by a usage limit, by team and "
            "limit", ["team", "limit"], registry=r,
        )
        self.limits_local = Counter(
            "kvroute_proxy_limit_checks_local", "Usage-limit checks this proxy decided alone "
            "because Redis did not answer in time", registry=r,
        )
        # Images by URL (proxy/image_fetch.py); unlabelled, so at 0 from the start.
        self.images_fetched = Counter(
            "kvroute_proxy_images_fetched", "Image URLs fetched and inlined (--fetch-images)",
            registry=r,
        )
        self.image_refusals = Counter(
            "kvroute_proxy_image_fetch_refusals", "Requests refused for an image URL (fetching "
            "off, a refused address, a limit, the server's answer)", registry=r,
        )
        self.image_fetch = Histogram(
            "kvroute_proxy_image_fetch_seconds", "Time a request spent fetching its image URLs "
            "(not counted in kvroute_proxy_overhead_seconds)", buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.teams: list[str] = []  # team labels (know_teams): bounded by the configured scopes
        self._known_backends: set[tuple[str, tuple[str, ...]]] = set()
        self._known_models: set[str] = set()

        # Configured models (`kvroute serve`), as their machines publish them in Redis.
        self.model_state = Gauge("kvroute_model_state", "1 for each configured model's state "
                                 "(loaded, loading, unloading, unloaded, failed)",
                                 ["model", "state"], registry=r)
        self.model_memory = Gauge("kvroute_model_memory_bytes", "Memory a model's replicas take "
                                  "(or would take) by the accounting", ["model"], registry=r)
        self.model_loads = Gauge("kvroute_model_loads", "Loads of a model since its machines "
                                 "started", ["model"], registry=r)
        self.model_unloads = Gauge("kvroute_model_unloads", "Unloads of a model since its "
                                   "machines started", ["model"], registry=r)
        self.model_load_seconds = Gauge("kvroute_model_load_seconds", "Seconds spent loading a "
                                        "model, summed over its loads", ["model"], registry=r)

    def child(self, metric, *values: str):
        """`metric.labels(*values)`, remembered: prometheus_client checks and joins the
        label values on every call (a few µs), and each proxied request records about ten
        samples. Bounded like the metrics themselves (models x backends x statuses)."""
        key = (id(metric), values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found

    def know_teams(self, teams: list[str], limits: tuple[str, ...]) -> None:
        """Every team's limit series, at 0 from the start."""
        self.teams = list(teams)
        for team in teams:
            for limit in limits:
                self.child(self.limited, team, limit)

    def know_backend(self, backend: str, models: list[str], route_reasons: tuple[str, ...]) -> None:
        """Create the series of a backend (and its models) the first time this proxy sees it,
        at 0: a series first created by its first event (a failover) shows "No data" in
        Grafana until then, and rate() misses that first event."""
        if (backend, tuple(models)) in self._known_backends:
            return
        self._known_backends.add((backend, tuple(models)))
        self.child(self.failovers, backend)
        self.child(self.inflight, backend)
        for model in models:
            self.child(self.requests, model, backend, "200")
            for reason in route_reasons:
                self.child(self.decisions, model, backend, reason)
            for metric in (self.predicted_tokens, self.actual_tokens, self.prompt_tokens,
                           self.seconds_saved):
                self.child(metric, model, backend)
            if model in self._known_models:
                continue
            self._known_models.add(model)
            for cached in ("true", "false"):
                self.child(self.ttft, model, cached)
            for reason in REASONS:
                self.child(self.cache_reasons, model, reason)
                self.child(self.seconds_lost, model, reason)
            for team in self.teams:
                self.child(self.team_requests, team, model)
                for kind in ("prompt", "cached", "generated"):
                    self.child(self.team_tokens, team, model, kind)
                for kind in ("saved", "lost"):
                    self.child(self.team_seconds, team, model, kind)

    def set_models(self, models: list[dict]) -> None:
        for m in models:
            name = m["model"]
            for state in ("loaded", "loading", "unloading", "unloaded", "failed"):
                self.model_state.labels(name, state).set(1.0 if m["state"] == state else 0.0)
            self.model_memory.labels(name).set(m["memory_bytes"])
            self.model_loads.labels(name).set(m["loads"])
            self.model_unloads.labels(name).set(m["unloads"])
            self.model_load_seconds.labels(name).set(m["load_seconds"])

    def render(self) -> bytes:
        return generate_latest(self.registry)

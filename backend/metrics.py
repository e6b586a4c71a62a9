"""Prometheus metrics of one backend process.

Every series carries `model` and `backend` labels so that a fleet scraped into
one Prometheus can be sliced per model and per process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

EXIT_PATHS = ("eos", "length", "stop", "tool_calls", "disconnect", "error")
COMMIT_PATHS = ("checkpoint", "disconnect_prefill", "recovered", "finish")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class BackendMetrics:
    def __init__(self, model: str, backend_id: str):
        self.registry = CollectorRegistry()
        labels = ["model", "backend"]
        r = self.registry
        self._labels = {"model": model, "backend": backend_id}
        self.requests = Counter(
            "kvroute_backend_requests", "Requests by endpoint and HTTP status",
            labels + ["endpoint", "status"], registry=r,
        )
        self.finished = Counter(
            "kvroute_backend_finished", "Finished generations by exit path",
            labels + ["exit"], registry=r,
        )
        self.prompt_tokens = Counter(
            "kvroute_backend_prompt_tokens", "Prompt tokens of admitted requests", labels, registry=r
        )
        self.cached_tokens = Counter(
            "kvroute_backend_cached_tokens", "Prompt tokens served from the prompt cache",
            labels, registry=r,
        )
        self.completion_tokens = Counter(
            "kvroute_backend_completion_tokens", "Generated tokens", labels, registry=r
        )
        self.prefill_seconds_saved = Counter(
            "kvroute_backend_prefill_seconds_saved",
            "Cached tokens divided by the measured prefill rate", labels, registry=r,
        )
        self.commits = Counter(
            "kvroute_backend_commits", "Prompt-cache commits by exit path",
            labels + ["path"], registry=r,
        )
        self.evictions = Counter(
            "kvroute_backend_evictions", "Prompt-cache entries evicted for the byte budget",
            labels, registry=r,
        )
        self.cache_bytes = Gauge(
            "kvroute_backend_cache_bytes", "Bytes held by the prompt-cache store", labels, registry=r
        )
        self.cache_budget = Gauge(
            "kvroute_backend_cache_budget_bytes", "Byte budget of the prompt-cache store",
            labels, registry=r,
        )
        self.cache_entries = Gauge(
            "kvroute_backend_cache_entries", "Entries in the prompt-cache store", labels, registry=r
        )
        self.queue_depth = Gauge(
            "kvroute_backend_queue_depth", "Requests admitted but not finished", labels, registry=r
        )
        self.batch_size = Gauge(
            "kvroute_backend_batch_size", "Sequences decoding in the current batch", labels, registry=r
        )
        self.prefill_tps = Gauge(
            "kvroute_backend_prefill_tokens_per_second", "Measured prefill rate (moving average)",
            labels, registry=r,
        )
        self.registry_failures = Gauge(
            "kvroute_backend_registry_failures", "Redis errors the publisher met (monotonic)",
            labels, registry=r,
        )
        self.registry_connected = Gauge(
            "kvroute_backend_registry_connected", "1 while the publisher is in sync with Redis",
            labels, registry=r,
        )
        self.ttft = Histogram(
            "kvroute_backend_ttft_seconds", "Time to first token",
            labels + ["cached"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.latency = Histogram(
            "kvroute_backend_request_seconds", "Total generation latency",
            labels + ["cached"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self._disk_metrics(labels, r)
        for path in EXIT_PATHS:
            self.finished.labels(**self._labels, exit=path)
        for path in COMMIT_PATHS:
            self.commits.labels(**self._labels, path=path)

    def _disk_metrics(self, labels: list[str], r: CollectorRegistry) -> None:
        # The disk tier (backend/disk.py) and the tier each hit came from.
        self.hits = Counter(
            "kvroute_backend_cache_hits", "Requests that started from a cached state, by tier",
            labels + ["tier"], registry=r,
        )
        self.tier_tokens = Counter(
            "kvroute_backend_cached_tokens_by_tier", "Prompt tokens served from cache, by tier",
            labels + ["tier"], registry=r,
        )
        self.disk_enabled = Gauge(
            "kvroute_backend_disk_enabled", "1 while the disk tier is in use", labels, registry=r
        )
        self.disk_bytes = Gauge(
            "kvroute_backend_disk_bytes", "Bytes of the disk tier's files", labels, registry=r
        )
        self.disk_budget = Gauge(
            "kvroute_backend_disk_budget_bytes", "Byte budget of the disk tier", labels, registry=r
        )
        self.disk_entries = Gauge(
            "kvroute_backend_disk_entries", "Entries in the disk tier", labels, registry=r
        )
        self.disk_queue = Gauge(
            "kvroute_backend_disk_write_queue", "Entries and removals waiting for the disk writer",
            labels, registry=r,
        )
        self.disk_writes = Counter(
            "kvroute_backend_disk_writes", "Disk writes by result (ok, failed, dropped: queue full)",
            labels + ["result"], registry=r,
        )
        self.disk_write_failures = Counter(
            "kvroute_backend_disk_write_failures", "Failed disk writes by errno name",
            labels + ["reason"], registry=r,
        )
        self.disk_dropped = Counter(
            "kvroute_backend_disk_dropped_files",
            "Files dropped unread (partial, truncated, corrupt, foreign, version)",
            labels + ["reason"], registry=r,
        )
        self.disk_evictions = Counter(
            "kvroute_backend_disk_evictions", "Disk files evicted for the disk byte budget",
            labels, registry=r,
        )
        self.disk_restore_seconds = Histogram(
            "kvroute_backend_disk_restore_seconds", "Time to read and check one file for a hit",
            labels, buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.disk_restore_bytes = Counter(
            "kvroute_backend_disk_restore_bytes", "Bytes read from disk for hits", labels, registry=r
        )
        self.disk_skipped = Counter(
            "kvroute_backend_disk_restores_skipped",
            "Disk hits prefilled instead: the measured prefill rate beat the restore rate",
            labels, registry=r,
        )
        self.disk_restore_bps = Gauge(
            "kvroute_backend_disk_restore_bytes_per_second",
            "Measured restore bandwidth (moving average)", labels, registry=r,
        )
        for tier in ("ram", "disk"):
            self.hits.labels(**self._labels, tier=tier)
            self.tier_tokens.labels(**self._labels, tier=tier)
        for result in ("ok", "failed", "dropped"):
            self.disk_writes.labels(**self._labels, result=result)

    def l(self, metric, **extra):  # noqa: E743 - short on purpose: used on every update
        return metric.labels(**self._labels, **extra)

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""Prometheus metrics of one backend process.

Every series carries `model` and `backend` labels so that a fleet scraped into
one Prometheus can be sliced per model and per process.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvroute.core.misses import BACKEND_REASONS

EXIT_PATHS = ("eos", "length", "stop", "tool_calls", "disconnect", "error")
COMMIT_PATHS = ("checkpoint", "disconnect_prefill", "recovered", "finish")
REFUSED_REASONS = ("no_disk_tier", "over_disk_budget", "disk_queue_full", "disk_failing")
GRAMMAR_KINDS = ("json_object", "json_schema", "tool_call")  # backend/grammar.py GrammarSpec
COMPILE_RESULTS = ("cached", "compiled", "refused")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class BackendMetrics:
    def __init__(self, model: str, backend_id: str):
        self.registry = CollectorRegistry()
        self._labels = {"model": model, "backend": backend_id}
        self._families: list = []
        self.requests = self._family(Counter, "kvroute_backend_requests",
                                     "Requests by endpoint and HTTP status", ("endpoint", "status"))
        self.finished = self._family(Counter, "kvroute_backend_finished",
                                     "Finished generations by exit path", ("exit",))
        self.prompt_tokens = self._family(Counter, "kvroute_backend_prompt_tokens",
                                          "Prompt tokens of admitted requests")
        self.cached_tokens = self._family(Counter, "kvroute_backend_cached_tokens",
                                          "Prompt tokens served from the prompt cache")
        self.completion_tokens = self._family(Counter, "kvroute_backend_completion_tokens",
                                              "Generated tokens")
        self.prefill_seconds_saved = self._family(
            Counter, "kvroute_backend_prefill_seconds_saved",
            "Cached tokens divided by the measured prefill rate")
        self.commits = self._family(Counter, "kvroute_backend_commits",
                                    "Prompt-cache commits kept in RAM or on disk, by exit path",
                                    ("path",))
        self.card_low = self._family(
            Counter, "kvroute_backend_card_low",
            "Times the CUDA card's free memory fell under the reserve and this backend gave "
            "its buffer cache back")
        self.commits_refused = self._family(
            Counter, "kvroute_backend_commits_refused",
            "Commits kept nowhere: over the RAM budget with no prefix that fits, and no disk "
            "tier took them, by reason", ("reason",))
        self.commits_over_budget = self._family(
            Counter, "kvroute_backend_commits_over_budget",
            "Commits over the RAM budget: RAM kept a prefix at most; whole: disk (the disk tier "
            "took it) or dropped", ("whole",))
        self.constrained = self._family(
            Counter, "kvroute_backend_constrained",
            "Requests decoded under a grammar, by kind (json_object, json_schema, tool_call)",
            ("kind",))
        self.grammar_compiles = self._family(
            Counter, "kvroute_backend_grammar_compiles",
            "Grammars asked for: cached (reused), compiled, refused (a 400)", ("result",))
        self.evictions = self._family(Counter, "kvroute_backend_evictions",
                                      "Prompt-cache entries evicted for the byte budget")
        self.cache_bytes = self._family(Gauge, "kvroute_backend_cache_bytes",
                                        "Bytes held by the prompt-cache store")
        self.cache_budget = self._family(Gauge, "kvroute_backend_cache_budget_bytes",
                                         "Byte budget of the prompt-cache store")
        self.cache_entries = self._family(Gauge, "kvroute_backend_cache_entries",
                                          "Entries in the prompt-cache store")
        self.cache_unshared = self._family(
            Gauge, "kvroute_backend_cache_bytes_unshared",
            "Bytes the store's entries would hold as whole states, each its own copy of "
            "the prefixes they share")
        self.cache_sharing = self._family(
            Gauge, "kvroute_backend_cache_sharing_ratio",
            "Unshared bytes over bytes held: how many times over shared blocks serve (1: none)")
        self.cache_hot_bytes = self._family(
            Gauge, "kvroute_backend_cache_hot_bytes",
            "Bytes of finished turns' contiguous copies, kept in the budget's free room for "
            "their conversations' next hits (the first thing eviction drops)")
        self.cache_blocks = self._family(Gauge, "kvroute_backend_cache_blocks",
                                         "Token blocks of the prompt cache held, by tier",
                                         ("tier",))
        self.memory = self._family(
            Gauge, "kvroute_backend_memory_bytes",
            "MLX memory of this process: arrays in use (active), its buffer cache (cache), the "
            "most in use at once since start (peak); on CUDA, what the device's memory pool "
            "holds for it (pool_reserved) and of that in allocations (pool_used)", ("kind",))
        self.queue_depth = self._family(Gauge, "kvroute_backend_queue_depth",
                                        "Requests admitted but not finished")
        self.batch_size = self._family(Gauge, "kvroute_backend_batch_size",
                                       "Sequences decoding in the current batch")
        self.prefill_tps = self._family(Gauge, "kvroute_backend_prefill_tokens_per_second",
                                        "Measured prefill rate (moving average)")
        self.registry_failures = self._family(Gauge, "kvroute_backend_registry_failures",
                                              "Redis errors the publisher met (monotonic)")
        self.registry_connected = self._family(Gauge, "kvroute_backend_registry_connected",
                                               "1 while the publisher is in sync with Redis")
        self.registry_pending = self._family(
            Gauge, "kvroute_backend_registry_pending",
            "Cache key changes (RAM and disk tiers) not yet written to Redis: until they "
            "are, proxies route as if the backend did not hold (or still held) them")
        self.cache_reasons = self._family(
            Counter, "kvroute_backend_cache_reasons",
            "Admitted requests by this backend's cache reason: hit, or why the prompt missed "
            "(kvroute/core/misses.py)", ("reason",))
        self.seconds_lost = self._family(
            Counter, "kvroute_backend_prefill_seconds_lost",
            "Prefill seconds spent on tokens the store held or had held (evicted, refused, "
            "uncuttable, another scope's), by reason", ("reason",))
        self.ttft = self._family(Histogram, "kvroute_backend_ttft_seconds",
                                 "Time to first token, from the request's arrival", ("cached",),
                                 buckets=_LATENCY_BUCKETS)
        self.latency = self._family(Histogram, "kvroute_backend_request_seconds",
                                    "Total generation latency", ("cached",),
                                    buckets=_LATENCY_BUCKETS)
        self.prepare = self._family(
            Histogram, "kvroute_backend_prepare_seconds",
            "From a generation request's arrival to its submission to the engine: reading "
            "and checking the body, the chat template, tokenizing, the disk tier's lookup "
            "and read (part of the TTFT)", buckets=_LATENCY_BUCKETS)
        self.prompt_time = self._family(
            Histogram, "kvroute_backend_prompt_seconds",
            "From a generation request's arrival to its prompt's tokens and prefix keys: "
            "reading and checking the body, the chat template, tokenizing (the first part "
            "of kvroute_backend_prepare_seconds)", buckets=_LATENCY_BUCKETS)
        self.send = self._family(
            Histogram, "kvroute_backend_first_chunk_send_seconds",
            "From a streamed request's first token to its first chunk written to the "
            "client's connection: the event loop's lag behind the engine (the end of the "
            "TTFT the client sees, after kvroute_backend_ttft_seconds)",
            buckets=_LATENCY_BUCKETS)
        self.queue = self._family(
            Histogram, "kvroute_backend_queue_seconds",
            "From a generation request's submission to the engine until the engine takes "
            "it up (waiting behind a step, a long prefill or the running-token budget; "
            "part of the TTFT)", buckets=_LATENCY_BUCKETS)
        self._disk_metrics()
        for path in EXIT_PATHS:
            self.finished.labels(**self._labels, exit=path)
        for path in COMMIT_PATHS:
            self.commits.labels(**self._labels, path=path)
        for reason in REFUSED_REASONS:
            self.commits_refused.labels(**self._labels, reason=reason)
        for whole in ("disk", "dropped"):
            self.commits_over_budget.labels(**self._labels, whole=whole)
        for tier in ("ram", "disk"):
            self.cache_blocks.labels(**self._labels, tier=tier)
        for kind in GRAMMAR_KINDS:
            self.constrained.labels(**self._labels, kind=kind)
        for result in COMPILE_RESULTS:
            self.grammar_compiles.labels(**self._labels, result=result)
        for reason in BACKEND_REASONS:
            self.cache_reasons.labels(**self._labels, reason=reason)
            self.seconds_lost.labels(**self._labels, reason=reason)
        for cached in ("true", "false"):
            self.ttft.labels(**self._labels, cached=cached)
            self.latency.labels(**self._labels, cached=cached)
        # Every series exists from the start, at 0: a series first created by its first
        # event (an eviction) shows "No data" in Grafana until then, and rate() and
        # increase() miss that first event.
        for family in self._families:
            if list(family._labelnames) == list(self._labels):
                self.l(family)

    def _disk_metrics(self) -> None:
        # The disk tier (backend/disk.py) and the tier each hit came from.
        self.hits = self._family(Counter, "kvroute_backend_cache_hits",
                                 "Requests that started from a cached state, by tier", ("tier",))
        self.tier_tokens = self._family(Counter, "kvroute_backend_cached_tokens_by_tier",
                                        "Prompt tokens served from cache, by tier", ("tier",))
        self.disk_enabled = self._family(Gauge, "kvroute_backend_disk_enabled",
                                         "1 while the disk tier is in use")
        self.disk_bytes = self._family(Gauge, "kvroute_backend_disk_bytes",
                                       "Bytes of the disk tier's files")
        self.disk_budget = self._family(Gauge, "kvroute_backend_disk_budget_bytes",
                                        "Byte budget of the disk tier")
        self.disk_entries = self._family(Gauge, "kvroute_backend_disk_entries",
                                         "Entries in the disk tier")
        self.disk_queue = self._family(Gauge, "kvroute_backend_disk_write_queue",
                                       "Entries and removals waiting for the disk writer")
        self.disk_writes = self._family(Counter, "kvroute_backend_disk_writes",
                                        "Disk writes by result (ok, failed, dropped: queue full)",
                                        ("result",))
        self.disk_write_failures = self._family(Counter, "kvroute_backend_disk_write_failures",
                                                "Failed disk writes by errno name", ("reason",))
        self.disk_paced = self._family(
            Counter, "kvroute_backend_disk_write_paced_seconds",
            "Seconds the disk writer paused writes that go on under load (they waited "
            "their max_delay, or RAM let their entry go): between block files (it then "
            "writes at most a quarter of the time) and while a prompt, here or on a sibling "
            "backend, waits for its first token or a restore is read")
        self.disk_dropped = self._family(
            Counter, "kvroute_backend_disk_dropped_files",
            "Files dropped unread (partial, truncated, corrupt, foreign, version)", ("reason",))
        self.disk_evictions = self._family(Counter, "kvroute_backend_disk_evictions",
                                           "Disk files evicted for the disk byte budget")
        self.disk_restore_seconds = self._family(Histogram, "kvroute_backend_disk_restore_seconds",
                                                 "Time to read and check one file for a hit",
                                                 buckets=_LATENCY_BUCKETS)
        self.disk_restore_bytes = self._family(Counter, "kvroute_backend_disk_restore_bytes",
                                               "Bytes read from disk for hits")
        self.disk_skipped = self._family(
            Counter, "kvroute_backend_disk_restores_skipped",
            "Disk hits prefilled instead: the measured prefill rate beat the restore rate")
        self.disk_early_reads = self._family(
            Counter, "kvroute_backend_disk_early_reads",
            "Restores begun from a request's prefix keys before its tokens were known, by "
            "whether its tokens then chose the same read", ("used",))
        self.disk_restore_bps = self._family(Gauge, "kvroute_backend_disk_restore_bytes_per_second",
                                             "Measured restore bandwidth (moving average)")
        for tier in ("ram", "disk"):
            self.hits.labels(**self._labels, tier=tier)
            self.tier_tokens.labels(**self._labels, tier=tier)
        for result in ("ok", "failed", "dropped"):
            self.disk_writes.labels(**self._labels, result=result)
        for kind in ("active", "cache", "peak"):
            self.memory.labels(**self._labels, kind=kind)

    def _family(self, kind: type, name: str, doc: str, extra: tuple[str, ...] = (),
                **kw: Any) -> Any:
        """One metric family of this process, labelled by model and backend (+ `extra`)."""
        family = kind(name, doc, [*self._labels, *extra], registry=self.registry, **kw)
        self._families.append(family)
        return family

    def l(self, metric, **extra):  # noqa: E743 - short on purpose: used on every update
        return metric.labels(**self._labels, **extra)

    def render(self) -> bytes:
        return generate_latest(self.registry)

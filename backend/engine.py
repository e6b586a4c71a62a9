"""The engine thread: continuous batching with mlx-lm, commit at prefill end.

One thread owns the model, the `BatchGenerator` and every KV cache (DESIGN
invariant 1). HTTP handlers talk to it through `submit` (a thread-safe inbox)
and a `cancelled` flag on their `Job`; results flow back as events on an
asyncio queue.

The commit: `BatchGenerator.next()` reports `end_of_prompt` for a sequence right
after the step that fed its last prompt token, and before the step that feeds
its first sampled token. At that moment the sequence's KV holds exactly its
prompt, so the engine copies it into the store there — before any exit path
(EOS, stop string, tool call, max tokens, disconnect, error) can occur and
before any decode step can extend it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import apply_top_p, make_logits_processors

from kvroute.errors import APIError, overloaded, server_error
from kvroute.hits import is_cache_hit
from kvroute.wire import SamplingParams

from .metrics import BackendMetrics
from .output import Chunk, OutputParser
from .store import Store, cache_tokens

log = logging.getLogger("kvroute.backend.engine")


@dataclass
class Delta:
    text: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)


@dataclass
class Finish:
    reason: str  # OpenAI finish_reason: stop, length, tool_calls
    exit: str  # exit path for metrics: eos, length, stop, tool_calls
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class Job:
    """One request as the engine sees it. Only `cancelled` is written by others."""

    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    tools: list[dict] | None
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    chain: list[int] = field(default_factory=list)  # prefix keys of the request, for the registry
    # The chain of the next turn once the reply is known (prompt + assistant message).
    extend_chain: Callable[[str, list[dict]], list[int]] | None = None
    scope: str | None = None
    fault: str | None = None
    cancelled: bool = False
    # Engine-side state.
    uid: int | None = None
    phase: str = "queued"  # queued, prefill, decode, done
    cached_tokens: int = 0
    processed: int = 0
    generated: int = 0
    submitted: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    parser: OutputParser | None = None
    detokenizer: Any = None
    pending_logprobs: list[dict] = field(default_factory=list)
    reply_text: list[str] = field(default_factory=list)
    reply_tool_calls: list[dict] = field(default_factory=list)

    def emit(self, event: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def cancel(self) -> None:
        self.cancelled = True


def make_sampler(params: SamplingParams) -> Callable | None:
    """None means greedy (the generator's fallback). A seeded request gets its own
    PRNG key so its samples do not depend on what else shares the batch."""
    if params.temperature == 0:
        return None
    temp, top_p = params.temperature, params.top_p
    key = mx.random.key(params.seed) if params.seed is not None else None

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        if 0 < top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        if key is None:
            return mx.random.categorical(logprobs * (1.0 / temp))
        key, sub = mx.random.split(key)
        return mx.random.categorical(logprobs * (1.0 / temp), key=sub)

    return sample


def make_processors(job: Job) -> list[Callable]:
    p = job.params
    processors = make_logits_processors(
        logit_bias=p.logit_bias or None,
        presence_penalty=p.presence_penalty or None,
        frequency_penalty=p.frequency_penalty or None,
    )
    if job.fault and job.fault.startswith("decode_error"):
        processors.append(_fault_processor(job.fault))
    return processors


def _fault_processor(spec: str) -> Callable:
    # Test-only (enabled by --enable-faults): fail inside the batched decode step,
    # the path a real Metal/CUDA error or OOM would take.
    after = int(spec.partition(":")[2] or 3)
    calls = itertools.count()

    def processor(tokens, logits):
        if next(calls) >= after:
            raise RuntimeError("injected decode fault")
        return logits

    return processor


class Engine:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        model_id: str,
        store: Store,
        metrics: BackendMetrics,
        *,
        prefill_step: int = 512,
        max_batch: int = 32,
        max_queue: int = 64,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.store = store
        self.metrics = metrics
        self.prefill_step = prefill_step
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.prefill_tps = 0.0
        self.peak_batch = 0
        self._inbox: queue.Queue = queue.Queue()
        self._jobs: dict[int, Job] = {}
        self._waiting = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvroute-engine", daemon=True)
        self._gen = self._new_generator()

    # -- called from the event loop ------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._inbox.put(None)
        self._thread.join(timeout)

    @property
    def queue_depth(self) -> int:
        return self._waiting + len(self._jobs)

    def submit(self, job: Job) -> None:
        if self.queue_depth >= self.max_queue:
            raise overloaded(f"The backend queue is full ({self.max_queue} requests).")
        self._waiting += 1
        self._inbox.put(("job", job))

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread (the only one allowed to read caches)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._inbox.put(("call", fn, loop, fut))
        return await fut

    def snapshot(self) -> dict:
        jobs = list(self._jobs.values())
        return {
            "queued": self._waiting + sum(j.phase == "queued" for j in jobs),
            "prefilling": sum(j.phase == "prefill" for j in jobs),
            "decoding": sum(j.phase == "decode" for j in jobs),
            "peak_batch": self.peak_batch,
            "prefill_tps": round(self.prefill_tps, 1),
            "jobs": [
                {"phase": j.phase, "processed": j.processed, "prompt": len(j.prompt),
                 "cached": j.cached_tokens, "generated": j.generated}
                for j in jobs
            ],
        }

    # -- the engine thread ---------------------------------------------------------

    def _new_generator(self) -> BatchGenerator:
        eos = [[t] for t in sorted(self.tokenizer.eos_token_ids)]
        return BatchGenerator(
            self.model,
            stop_tokens=eos,
            completion_batch_size=self.max_batch,
            prefill_batch_size=min(8, self.max_batch),
            prefill_step_size=self.prefill_step,
        )

    def _run(self) -> None:
        while not self._stopping:
            try:
                self._drain_inbox(block=not self._jobs)
                self._reap_cancelled()
                if self._jobs:
                    self._step()
            except Exception:
                log.exception("engine loop error; failing active requests")
                self._fail_all("Internal engine error.")
                self._gen = self._new_generator()
        self._fail_all("The backend is shutting down.", status=503)

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                item = self._inbox.get(block=block, timeout=0.25 if block else None)
            except queue.Empty:
                return
            block = False
            if item is None:
                return
            if item[0] == "job":
                self._waiting -= 1
                job = item[1]
                try:
                    self._admit(job)
                except Exception as exc:
                    # A request that cannot be admitted fails alone, with an answer
                    # (never a hang), and the batch already decoding is untouched.
                    log.exception("admitting a request failed")
                    if job.uid is not None:
                        try:
                            self._gen.remove([job.uid])
                        except Exception:
                            pass
                    self._fail(job, f"Generation failed: {exc}")
            else:
                _, fn, loop, fut = item
                try:
                    result, exc = fn(), None
                except Exception as e:  # handed to the caller, not the engine
                    result, exc = None, e
                loop.call_soon_threadsafe(_settle, fut, result, exc)

    def _admit(self, job: Job) -> None:
        if job.cancelled:
            job.emit(APIError(499, "Client closed the request.", "server_error"))
            return
        match = self.store.lookup(self.model_id, job.prompt, job.scope)
        job.cached_tokens = match.tokens
        job.processed = match.tokens
        caches = [match.cache] if match.cache is not None else None
        all_tokens = [list(job.prompt[: match.tokens])] if match.cache is not None else None
        sampler = make_sampler(job.params)
        (job.uid,) = self._gen.insert(
            [job.prompt[match.tokens :]],
            max_tokens=[job.max_tokens],
            caches=caches,
            all_tokens=all_tokens,
            samplers=[sampler] if sampler else None,
            logits_processors=[make_processors(job)],
        )
        tok = self.tokenizer
        job.detokenizer = tok.detokenizer
        job.parser = OutputParser(
            job.params.stop,
            tok.tool_call_start,
            tok.tool_call_end,
            tok.tool_parser,
            job.tools,
        )
        job.phase = "prefill"
        self._jobs[job.uid] = job
        self.metrics.l(self.metrics.prompt_tokens).inc(len(job.prompt))
        self.metrics.l(self.metrics.cached_tokens).inc(match.tokens)
        if match.tokens and self.prefill_tps > 0:
            self.metrics.l(self.metrics.prefill_seconds_saved).inc(match.tokens / self.prefill_tps)
        self._update_gauges()

    def _reap_cancelled(self) -> None:
        gone = [j for j in self._jobs.values() if j.cancelled]
        for job in gone:
            if job.phase == "prefill":
                # A disconnect mid-prefill keeps the chunks already processed.
                try:
                    caches = self._gen.remove([job.uid], return_prompt_caches=True)
                except Exception:  # e.g. nothing processed yet: no KV to extract
                    log.debug("no partial prefill to keep", exc_info=True)
                    self._gen.remove([job.uid])
                    caches = {}
                cache, tokens = caches.get(job.uid, (None, []))
                if cache and len(tokens) > job.cached_tokens:
                    self._commit(job, cache, tokens, "disconnect_prefill")
            else:
                self._gen.remove([job.uid])
            self._finish(job, "disconnect")

    def _step(self) -> None:
        try:
            with self._gen.stats() as stats:
                prompt_responses, gen_responses = self._gen.next()
        except Exception as exc:
            log.exception("batch step failed")
            # The batch's state is unknown after a failure inside the model; the
            # prompts it holds were committed already, so start a fresh batch.
            self._fail_all(f"Generation failed: {exc}")
            self._gen = self._new_generator()
            return
        if stats.prompt_tokens and stats.prompt_time > 0:
            rate = stats.prompt_tokens / stats.prompt_time
            self.prefill_tps = rate if not self.prefill_tps else 0.8 * self.prefill_tps + 0.2 * rate
        for r in prompt_responses:
            job = self._jobs.get(r.uid)
            if job is None:
                continue
            job.processed = job.cached_tokens + r.progress[0]
            if r.end_of_prompt:
                self._on_prefill_end(job)
        for r in gen_responses:
            job = self._jobs.get(r.uid)
            if job is None or job.cancelled:
                continue
            try:
                self._on_token(job, r)
            except Exception as exc:
                # A fault in one request's output handling costs that request only.
                log.exception("output handling failed")
                if job.uid in self._jobs:
                    self._gen.remove([job.uid])
                    self._fail(job, f"Generation failed: {exc}")
        decoding = sum(j.phase == "decode" for j in self._jobs.values())
        self.peak_batch = max(self.peak_batch, decoding)
        self._update_gauges()
        self._injected_delay()

    def _injected_delay(self) -> None:
        # Test-only: "slow_prefill:SECONDS" stretches each prefill chunk so a test
        # can reliably disconnect while a prompt is still being prefilled.
        delays = [
            float(j.fault.partition(":")[2] or 0.05)
            for j in self._jobs.values()
            if j.phase == "prefill" and j.fault and j.fault.startswith("slow_prefill")
        ]
        if delays:
            time.sleep(max(delays))

    def _on_prefill_end(self, job: Job) -> None:
        job.phase = "decode"
        job.processed = len(job.prompt)
        if self.store.covers(self.model_id, job.prompt, job.scope):
            return  # the whole prompt is cached already: nothing new to copy
        cache, tokens = self._gen.extract_cache([job.uid])[job.uid]
        self._commit(job, cache, tokens, "prefill")

    def _commit(self, job: Job, cache: list, tokens: list[int], path: str) -> None:
        tokens = np.array(tokens, dtype=np.int32)  # the generator keeps appending to its list
        mx.eval([c.state for c in cache])
        if cache_tokens(cache) != len(tokens):
            log.error("not committing: KV holds %d tokens, list has %d", cache_tokens(cache), len(tokens))
            return
        self.store.insert(self.model_id, tokens, cache, path, chain=self._chain_for(job, path),
                          scope=job.scope)
        self.metrics.l(self.metrics.commits, path=path).inc()

    def _chain_for(self, job: Job, path: str) -> list[int]:
        if path == "prefill":
            return job.chain
        if path == "finish" and job.extend_chain is not None:
            try:
                return job.extend_chain("".join(job.reply_text), job.reply_tool_calls)
            except ValueError:
                log.warning("could not compute the extended prefix chain", exc_info=True)
            return job.chain
        # A partial prefill covers an unknown part of the text: advertise nothing.
        return []

    def _on_token(self, job: Job, r: Any) -> None:
        job.generated += 1
        if job.first_token_at is None:
            job.first_token_at = time.perf_counter()
            cached = "true" if is_cache_hit(job.cached_tokens, len(job.prompt)) else "false"
            self.metrics.l(self.metrics.ttft, cached=cached).observe(job.first_token_at - job.submitted)
        is_eos = r.token in self.tokenizer.eos_token_ids
        if job.params.logprobs and not is_eos:
            job.pending_logprobs.append(self._logprob_entry(r, job.params.top_logprobs))
        chunk = Chunk()
        if not is_eos:
            job.detokenizer.add_token(r.token)
            chunk = job.parser.feed(job.detokenizer.last_segment)
        if chunk.stopped:
            self._emit_chunk(job, chunk)
            if r.finish_reason is None:
                caches = self._gen.remove([job.uid], return_prompt_caches=True)
                cache, tokens = caches[job.uid]
            else:
                # The stop string came with the last token max_tokens allowed: the
                # generator has already let the sequence go and hands its cache here.
                cache, tokens = r.prompt_cache, r.all_tokens
            self._commit(job, cache, tokens, "finish")
            self._finish(job, "stop")
            return
        if r.finish_reason is None:
            self._emit_chunk(job, chunk)
            return
        job.detokenizer.finalize()
        tail = job.parser.finish(job.detokenizer.last_segment)
        chunk.text += tail.text
        chunk.tool_calls += tail.tool_calls
        self._emit_chunk(job, chunk)
        # A normal finish: the entry grows by the reply, which the next turn
        # of the conversation will send back as its prefix.
        self._commit(job, r.prompt_cache, r.all_tokens, "finish")
        if job.parser.n_tool_calls:
            exit_path = "tool_calls"
        else:
            exit_path = "length" if r.finish_reason == "length" else "eos"
        self._finish(job, exit_path)

    def _logprob_entry(self, r: Any, top: int) -> dict:
        logprobs = r.logprobs
        entry = {"id": r.token, "logprob": logprobs[r.token].item(), "top": []}
        if top:
            ids = mx.argpartition(-logprobs, kth=top - 1)[:top]
            vals = logprobs[ids]
            order = mx.argsort(-vals)
            entry["top"] = list(zip(ids[order].tolist(), vals[order].tolist()))
        return entry

    def _emit_chunk(self, job: Job, chunk: Chunk) -> None:
        if not (chunk.text or chunk.tool_calls or job.pending_logprobs):
            return
        logprobs = [self._named_logprobs(e) for e in job.pending_logprobs]
        job.pending_logprobs = []
        job.reply_text.append(chunk.text)
        job.reply_tool_calls += chunk.tool_calls
        job.emit(Delta(chunk.text, chunk.tool_calls, logprobs))

    def _named_logprobs(self, entry: dict) -> dict:
        tok = self.tokenizer
        def name(i: int) -> str:
            return tok.decode([i])
        return {
            "token": name(entry["id"]),
            "logprob": entry["logprob"],
            "top": [(name(i), v) for i, v in entry["top"]],
        }

    def _finish(self, job: Job, exit_path: str) -> None:
        self._jobs.pop(job.uid, None)
        job.phase = "done"
        self.metrics.l(self.metrics.finished, exit=exit_path).inc()
        self.metrics.l(self.metrics.completion_tokens).inc(job.generated)
        cached = "true" if is_cache_hit(job.cached_tokens, len(job.prompt)) else "false"
        self.metrics.l(self.metrics.latency, cached=cached).observe(time.perf_counter() - job.submitted)
        if exit_path == "disconnect":
            job.emit(APIError(499, "Client closed the request.", "server_error"))
            return
        reason = {"eos": "stop", "stop": "stop", "length": "length", "tool_calls": "tool_calls"}[exit_path]
        job.emit(Finish(reason, exit_path, len(job.prompt), job.generated, job.cached_tokens))

    def _fail(self, job: Job, message: str, status: int = 500) -> None:
        self._jobs.pop(job.uid, None)
        job.phase = "done"
        self.metrics.l(self.metrics.finished, exit="error").inc()
        job.emit(server_error(message) if status == 500 else APIError(status, message, "server_error"))

    def _fail_all(self, message: str, status: int = 500) -> None:
        for job in list(self._jobs.values()):
            self._fail(job, message, status)
        self._update_gauges()

    def _update_gauges(self) -> None:
        m = self.metrics
        stats = self.store.stats()
        m.l(m.queue_depth).set(self.queue_depth)
        m.l(m.batch_size).set(sum(j.phase == "decode" for j in self._jobs.values()))
        m.l(m.cache_bytes).set(stats["bytes"])
        m.l(m.cache_entries).set(stats["entries"])
        m.l(m.prefill_tps).set(self.prefill_tps)


def _settle(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)

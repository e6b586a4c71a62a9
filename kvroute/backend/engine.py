"""The engine thread: continuous batching with mlx-lm, commit at prefill end.

One thread owns the model, the `BatchGenerator` and every KV cache (DESIGN
invariant 1). HTTP handlers talk to it through `submit` (a thread-safe inbox)
and a `cancelled` flag on their `Job`; results flow back as events on an
asyncio queue.

The commit: a prompt is inserted into the `BatchGenerator` as segments that end
at the positions worth keeping (`Job.checkpoints`, always including the prompt's
last token but one). The generator never processes across a segment boundary in
one step and reports `end_of_segment` once the step that reached it is done; the
sequence's cache then holds exactly the prompt up to there, and the engine
copies it into the store. The last one is taken before the step that feeds the
prompt's final token and samples from it, so no exit path — EOS, stop string,
tool call, max tokens, disconnect, or an error in that very step — can lose it.
It is committed once the first token has gone out (the commit's ~10 ms on a long
conversation would otherwise come before it), before any other commit of that
request, when the request ends, and before any admission looks the store up.

Full-attention models need only that last checkpoint: their entries can be
trimmed to any prefix. Models with layers that cannot be trimmed (a sliding
window that has rotated, a recurrent state) also keep the checkpoints the server
asks for: the end of the shared header (system prompt and tools) and the end of
the last complete message, so that repeats, next turns and other conversations
with the same system prompt all find a state they can extend (DESIGN.md).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from typing import Any, Callable

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from kvroute.api.errors import APIError, overloaded, server_error
from kvroute.core.accel import (card_memory, device_lost, device_trouble, keep_wired_limit, memory,
                                pool_memory)
from kvroute.core.hits import is_cache_hit
from kvroute.core.sizes import format_bytes

from . import faults, join
from .attention import avoid_cudnn_plans, fast, new_cache
from .grammar import MaskBatch
from .jobs import Delta, Finish, Job
from .kv_budget import REFUSALS, Warnings, describe_budgets, kv_rate, probe_tokens
from .metrics import BackendMetrics
from .mlx_patches import chunked_gated_delta, keep_buffer_cache, uses_gated_delta
from .output import Chunk, OutputParser
from .sampling import make_processors, make_sampler
from .store import Commit, Store, always_trimmable, common_prefix, held_tokens
from .token_bytes import TokenBytes

log = logging.getLogger("kvroute.backend.engine")

GAUGE_PERIOD = 0.05  # seconds between gauge updates while only decoding
# The CUDA-only warm-up (spread prompt lengths, one long prompt) at most: a 7B dense
# model needs ~5 s of it on an H200 (a 64k-token prompt).
WARM_CUDA_SECONDS = 30.0
EXIT_DEVICE_LOST = 70  # the backend's exit status once its GPU context is lost (EX_SOFTWARE)
LOST_MESSAGE = "The backend's GPU failed; it is restarting. Retry the request."
OOM_MESSAGE = "The backend ran out of device memory ({}); retry the request."
CARD_CHECK_S = 0.25  # how often a CUDA backend looks at its card's free memory
# Free card memory under which a backend gives its buffer cache back: a step's transient
# arrays (a batched prefill's) can take several GB, and at 2 GiB a step still failed.
CARD_RESERVE = 0.06  # of the card's memory
CARD_RESERVE_MIN = 2 << 30


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
        serial_prefill: bool = False,
        max_batch: int = 32,
        max_queue: int = 64,
        max_running_tokens: int = 0,
        keep_buffers: bool | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.token_bytes = TokenBytes(tokenizer)  # each logprob's real bytes
        self.model_id = model_id
        self.store = store
        self.metrics = metrics
        self.prefill_step = prefill_step
        self.serial_prefill = serial_prefill
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.max_running_tokens = max_running_tokens  # 0: only max_batch bounds the batch
        self.peak_running_tokens = 0
        self.prefill_tps = 0.0
        self.decode_steps_per_s = 0.0  # batch steps/s: each decoding sequence gains a token
        self.reply_tokens = 0.0  # mean tokens of a finished reply
        self.decoding = 0  # sequences in the decode phase after the last step
        self.peak_batch = 0
        self.misses: Any = None  # backend/misses.py Misses: each admitted request's cache reason
        # Called (engine thread) when waiting, running or decoding changed: the
        # publisher then writes the record at once instead of at the next heartbeat,
        # and the busy board tells sibling backends (busy.py).
        self.load_listeners: list[Callable[[], None]] = []
        self._load_seen = (0, 0, 0)
        # Whether entries need checkpoints: some layer cannot always be trimmed.
        self.checkpointing = not always_trimmable(make_prompt_cache(model))
        self.on_cuda = avoid_cudnn_plans(prefill_step)
        self._card_checked = self._card_logged = float("-inf")  # _mind_the_card
        if self.on_cuda:
            log.info("CUDA: attention calls of new shapes skip cuDNN's per-shape plans")
            # Gated-delta layers (Qwen3-Next, Qwen3.5) prefill by chunks there, not by
            # mlx-lm's per-token loop (MLX's fused `mx.fast.gated_delta_update` measured
            # slower than the loop on an H200). Not on a CPU or a Mac: a hit there
            # answers bit for bit as a cold prefill, which chunks would not keep.
            if uses_gated_delta(model):
                chunked_gated_delta()
        # Keep MLX's buffer cache across prefill chunks (keep_buffer_cache): by default
        # on a GPU; the server asks for it only where a cache limit bounds it.
        self.keep_buffers = (mx.default_device().type == mx.gpu if keep_buffers is None
                             else keep_buffers)
        if self.keep_buffers:
            keep_buffer_cache()
        self._inbox: queue.Queue = queue.Queue()
        self._jobs: dict[int, Job] = {}
        # Requests waiting their turn: long prompts behind a long prefill, and any
        # request beyond the running-token budget.
        self._held: collections.deque[Job] = collections.deque()
        self._followers: list[Job] = []  # choices n > 1 waiting for the first one's prompt
        # Events of one loop turn, handed to the event loop in one call: one wake-up
        # per decode step instead of one per token of every sequence in the batch.
        self._outbox: list[tuple[Job, Any]] = []
        # Sequences whose last token the step handed out: (job, cache, tokens, exit
        # path, stop), committed and finished once it has gone (_after_sending).
        self._endings: list[tuple[Job, list, list[int], str, str | None]] = []
        # Jobs in the inbox = submitted - taken; each counter has one writer
        # (the event loop and the engine thread), so neither update can be lost.
        self._submitted = 0
        self._taken = 0
        self._stopping = False
        self.lost = ""  # why the GPU context is gone (device_lost): the engine has stopped
        self.on_lost: Callable[[], None] = lambda: None  # then called once (engine thread)
        self._gauges_at = 0.0
        self._gauged_jobs = 0
        self._faults = False  # any job with a test fault admitted: look for delays
        self._warnings = Warnings(log)
        self._kv_rate: tuple[float, int] | None = None
        self._masks: MaskBatch | None = None  # constrained rows' masks, filled together
        self._thread = threading.Thread(target=self._run, name="kvroute-engine", daemon=True)
        self._gen = self._new_generator()

    # -- called from the event loop ------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the engine thread after its current step, and wait for the device
        to finish what was queued: a process may only exit (on CUDA, without
        aborting in a destructor) once no thread or stream is still working."""
        self._stopping = True
        self._inbox.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the engine thread did not stop within %.0fs", timeout)

    @property
    def waiting(self) -> int:
        # In the inbox, held back behind a long prefill (serial_prefill), or a later
        # choice waiting for the first one's prompt.
        return self._submitted - self._taken + len(self._held) + len(self._followers)

    @property
    def queue_depth(self) -> int:
        return self.waiting + len(self._jobs)

    @property
    def prefilling(self) -> bool:
        """Whether a request waits for its first token (queued, or its prompt being
        prefilled): what a user waits on, which the disk writer's paced writes keep
        off (any thread may ask)."""
        return self._awaited("first_token_at")

    @property
    def answering(self) -> bool:
        """Whether a request waits for its first output to reach its client: as
        `prefilling`, until the event loop has written the first token's chunk: the
        TTFT the client sees ends there, and the disk writer's own hold-off lasts that
        long (it shares the GIL with the loop that writes the chunk)."""
        return self._awaited("first_out_at")

    def _awaited(self, mark: str) -> bool:
        """Whether a request is queued, or a running one has no `mark` time yet."""
        if self.waiting:
            return True
        try:
            return any(getattr(job, mark) is None for job in list(self._jobs.values()))
        except RuntimeError:  # changed while copied: ask again next time
            return True

    def submit(self, job: Job) -> None:
        if self.lost:
            raise APIError(503, LOST_MESSAGE, "server_error")
        if self.queue_depth >= self.max_queue:
            raise overloaded(f"The backend queue is full ({self.max_queue} requests).")
        self._submitted += 1
        job.queued_at = time.perf_counter()
        self._inbox.put(("job", job))

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread (the only one allowed to read caches)."""
        if self.lost:
            raise RuntimeError(LOST_MESSAGE)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._inbox.put(("call", fn, loop, fut))
        return await fut

    def snapshot(self) -> dict:
        jobs = list(self._jobs.values())
        return {
            "queued": self.waiting + sum(j.phase == "queued" for j in jobs),
            "prefilling": sum(j.phase == "prefill" for j in jobs),
            "decoding": sum(j.phase == "decode" for j in jobs),
            "peak_batch": self.peak_batch,
            "running_tokens": sum(self._need(j) for j in jobs),
            "max_running_tokens": self.max_running_tokens,
            "peak_running_tokens": self.peak_running_tokens,
            "prefill_tps": round(self.prefill_tps, 1),
            "jobs": [
                {"phase": j.phase, "processed": j.processed, "prompt": len(j.prompt),
                 "cached": j.cached_tokens, "generated": j.generated}
                for j in jobs
            ],
        }

    # -- the engine thread ---------------------------------------------------------

    def _new_generator(self) -> BatchGenerator:
        self._masks = None  # rows a failed step queued are gone with the old generator
        eos = [[t] for t in sorted(self.tokenizer.eos_token_ids)]
        gen = BatchGenerator(
            self.model,
            stop_tokens=eos,
            completion_batch_size=self.max_batch,
            prefill_batch_size=min(8, self.max_batch),
            prefill_step_size=self.prefill_step,
        )
        keep_wired_limit()
        return gen

    def warm_up(self, long_tokens: int = 0) -> float:
        """Run the shapes serving will use once, on the engine thread, so that
        kernels are compiled before the backend says it is healthy: a full and a
        partial prefill chunk on the fused path, a cache hit, padded batched
        prefill and decode on the masked path and, on CUDA, prompts of lengths
        spread over a chunk and one prompt of `long_tokens` (see `_warm_long`);
        then a warm prefill rate for the proxies' estimates. Returns the seconds
        it took."""
        t0 = time.perf_counter()
        gen = BatchGenerator(self.model, stop_tokens=[], completion_batch_size=self.max_batch,
                             prefill_batch_size=min(8, self.max_batch),
                             prefill_step_size=self.prefill_step)
        keep_wired_limit()
        try:
            long_ = probe_tokens(self.prefill_step + self.prefill_step // 2 + 7)
            done = _drain(gen, gen.insert([long_], max_tokens=[3], caches=[new_cache(self.model)]))
            cache, tokens = done[0]
            if always_trimmable(cache):  # a hit: the stored prefix plus a suffix
                _drain(gen, gen.insert([long_[-5:] + long_[:9]], max_tokens=[3],
                                       caches=[fast(cache)], all_tokens=[tokens]))
            short = [probe_tokens(n, salt=n) for n in (9, 33, 33, 70)]
            _drain(gen, gen.insert(short, max_tokens=[4, 6, 6, 8],
                                   caches=[new_cache(self.model) for _ in short]))
            if self.on_cuda:
                self._warm_cuda(gen, long_tokens)
            # The first prefill rate the proxies see is a warm one: a backend whose
            # first request measured a cold rate looked slower than its peers, lost
            # every tie to them and, getting no traffic, never measured again.
            t1 = time.perf_counter()
            _drain(gen, gen.insert([long_[::-1]], max_tokens=[1], caches=[new_cache(self.model)]))
            self.prefill_tps = len(long_) / (time.perf_counter() - t1)
        finally:
            gen.close()
            mx.synchronize()
            if not self.keep_buffers:  # on a GPU its buffers are the first request's
                mx.clear_cache()
        return time.perf_counter() - t0

    def _warm_cuda(self, gen: BatchGenerator, long_tokens: int) -> None:
        """What only CUDA needs warmed, within WARM_CUDA_SECONDS: a model that
        prefills slowly there (a hybrid's per-token recurrence: ~500 tokens/s for a 7B
        Qwen3-Next on an H200) would otherwise spend minutes before it says healthy.

        A matrix size cuBLAS has not run yet launches more slowly the first time (up to
        ~6 ms a call, ~1 ms once the process ran a spread of sizes), and a prompt
        touches several: its first request at a new length cost 20-30 ms more than the
        next (H200, 2k tokens). Prompts of lengths spread over a prefill chunk take most
        of that away; then one long prompt (`_warm_long`), as long as the time left
        allows at the rate the spread measured."""
        join.warm()  # the kernel that joins a hit's blocks, built and checked
        t0 = time.perf_counter()
        deadline = t0 + WARM_CUDA_SECONDS
        spread = max(self.prefill_step // 21, 1)
        tokens = 0
        for n in range(spread, self.prefill_step, spread):
            if time.perf_counter() >= deadline:
                log.info("warm-up: prompt lengths spread up to %d tokens (its time is up)", n)
                return
            _drain(gen, gen.insert([probe_tokens(n, salt=n)], max_tokens=[1],
                                   caches=[new_cache(self.model)]))
            tokens += n
        rate = tokens / max(time.perf_counter() - t0, 1e-6)
        affordable = int(rate * max(deadline - time.perf_counter(), 0.0))
        if affordable < long_tokens:
            log.info("warm-up: the long prompt cut to %d of %d tokens (this model prefills "
                     "~%.0f tokens/s here)", affordable, long_tokens, rate)
        self._warm_long(gen, min(long_tokens, affordable))

    def _warm_long(self, gen: BatchGenerator, tokens: int) -> None:
        """Prefill one prompt of `tokens` (CUDA). cuDNN builds an attention plan for
        each length of keys a full prefill chunk meets, and chunks start at multiples
        of the prefill step (`_alignments`), so one long prompt visits every length a
        later prompt's full chunks will: on an H200 (7B) each new length cost its
        chunk ~60 ms, the first 32k-token prompt 1.66 s against 1.23 s for the next."""
        if tokens <= 2 * self.prefill_step:
            return
        t0 = time.perf_counter()
        _drain(gen, gen.insert([probe_tokens(tokens, salt=5)], max_tokens=[1],
                               caches=[new_cache(self.model)]))
        log.info("prefill shapes warmed up to %d tokens in %.1fs", tokens,
                 time.perf_counter() - t0)

    def kv_bytes_per_token(self) -> tuple[float, int]:
        """`kv_rate` of this engine's model, measured once (engine thread only: it
        runs the model)."""
        if self._kv_rate is None:
            self._kv_rate = kv_rate(self.model)
        return self._kv_rate

    def describe_budgets(self, disk_budget: int, context_length: int) -> dict[str, int | None]:
        """`describe_budgets` for this engine's store and model (engine thread only).
        A model the measurement cannot run costs a warning, never the start."""
        try:
            rate = self.kv_bytes_per_token()
        except Exception:
            log.warning("could not measure the KV bytes per token of this model", exc_info=True)
            return {}
        return describe_budgets(self.store.budget_bytes, disk_budget, rate, context_length,
                                trimmable=not self.checkpointing)

    def _run(self) -> None:
        while not self._stopping:
            try:
                self._release_held()
                self._drain_inbox(block=not (self._jobs or self._held or self._followers))
                self._reap_cancelled()
                self._release_held()
                if self._jobs:
                    self._mind_the_card()
                    self._step()
                    self._flush()  # the step's tokens go out before its commits are made
                    self._after_sending()
            except Exception as exc:
                log.exception("engine loop error; failing active requests")
                if device_lost(exc):
                    self._lose_device(exc)
                    continue
                if device_trouble(exc):  # a failed step's recovery found the card full too
                    self._out_of_memory()
                    self._fail_all(OOM_MESSAGE.format(exc), status=503)
                else:
                    self._fail_all("Internal engine error.")
                self._gen = self._new_generator()
            finally:
                self._flush()
        self._fail_all("The backend is shutting down.", status=503)
        if self.lost:  # what arrived while it was being lost
            self._fail_inbox()
        self._flush()
        if not self.lost:  # a lost context fails every call, this one too
            mx.synchronize()  # this thread's streams are idle before the process may exit

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
                self._taken += 1
                self._route(item[1])
            else:
                _, fn, loop, fut = item
                try:
                    result, exc = fn(), None
                except Exception as e:  # handed to the caller, not the engine
                    result, exc = None, e
                loop.call_soon_threadsafe(_settle, fut, result, exc)

    # -- one long prefill at a time (serial_prefill) -----------------------------
    # A prompt with more than one chunk left to prefill enters the generator only
    # when no other such prompt is prefilling: alone, its chunks have no padding
    # and run on the fused causal kernel (attention.py), while the batch keeps
    # decoding between chunks. Two long prompts prefilled together would be padded
    # against each other for their whole length, on the slower masked path, and
    # would both finish late. Short prompts join at once, as before; the wait also
    # lets a request behind another with the same prefix find it committed. On the
    # CPU, where attention has no fused kernel, prompts are batched as they come.

    def _long(self, job: Job) -> bool:
        return len(job.prompt) - job.start > self.prefill_step

    def _long_prefill(self) -> bool:
        return any(j.phase == "prefill" and self._long(j) for j in self._jobs.values())

    def _uncached(self, job: Job) -> int:
        """Tokens of the prompt no stored entry holds (an estimate, so that a cache
        hit with a short remainder is not held back), prompts just ended included."""
        self._commit_taken()
        prompt = np.asarray(job.prompt, dtype=np.int32)
        best = max((common_prefix(e.tokens, prompt) for e in list(self.store.entries.values())
                    if e.model == self.model_id and e.scope == job.scope), default=0)
        return len(prompt) - best

    def _flush(self) -> None:
        if not self._outbox:
            return
        items = self._outbox[:]
        del self._outbox[:]  # jobs hold this very list
        by_loop: dict[Any, list] = {}
        for job, event in items:
            by_loop.setdefault(job.loop, []).append((job.events, event))
        for loop, events in by_loop.items():
            loop.call_soon_threadsafe(_deliver, events)

    def _route(self, job: Job) -> None:
        job.outbox = self._outbox
        if job.after is not None and job.after.phase in ("queued", "prefill"):
            self._followers.append(job)
            return
        if ((self._held and not self._fits(self._held[0])) or not self._fits(job)
                or (self.serial_prefill and len(job.prompt) > self.prefill_step
                    and (self._held or self._long_prefill())
                    and self._uncached(job) > self.prefill_step)):
            self._held.append(job)
            return
        self._admit_or_fail(job)

    def _release_held(self) -> None:
        while self._held and self._may_release(self._held[0]):
            self._admit_or_fail(self._held.popleft())
        if self._followers:
            # The first choice committed its prompt (or ended): the others now hit it.
            ready = [j for j in self._followers if j.cancelled or j.after.cancelled
                     or j.after.phase not in ("queued", "prefill")]
            self._followers = [j for j in self._followers if j not in ready]
            for job in ready:
                self._admit_or_fail(job)

    def _may_release(self, job: Job) -> bool:
        # A short prompt waits only for room in the running budget; a long one also
        # for the long prefill running now (serial_prefill).
        long_ = self.serial_prefill and len(job.prompt) > self.prefill_step
        return self._fits(job) and not (long_ and self._long_prefill())

    # -- the running-token budget ------------------------------------------------
    # A sequence's KV grows up to its prompt plus its completion cap. Admitting only
    # while the running sequences' sum stays within max_running_tokens bounds the KV
    # the batch can reach (what `kvroute serve`'s memory check counts): a burst waits
    # in arrival order (a later small request never passes a waiting large one, which
    # would then wait forever) instead of growing past the memory the check reserved.
    # One request always runs alone, whatever it needs: the prompt limits bound it.

    @staticmethod
    def _need(job: Job) -> int:
        return len(job.prompt) + job.max_tokens

    @property
    def running_tokens(self) -> int:
        return sum(self._need(j) for j in self._jobs.values())

    def _fits(self, job: Job) -> bool:
        if self.max_running_tokens <= 0 or not self._jobs or job.cancelled:
            return True
        return self.running_tokens + self._need(job) <= self.max_running_tokens

    def _admit_or_fail(self, job: Job) -> None:
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

    def _admit(self, job: Job) -> None:
        if job.cancelled:
            job.phase = "done"  # never prefilled: what it holds (images) may go
            job.emit(APIError(499, "Client closed the request.", "server_error"))
            return
        if not job.readmitted and job.queued_at:
            self.metrics.l(self.metrics.queue).observe(time.perf_counter() - job.queued_at)
        self._commit_taken()  # a prompt just prefilled may be this one's prefix
        hit = self.store.lookup(self.model_id, job.prompt, job.scope)
        hit, tier = self._disk_hit(job, hit)
        job.start = job.processed = hit.tokens
        wanted = job.checkpoints if self.checkpointing else {
            p: k for p, k in job.checkpoints.items() if p == len(job.prompt) - 1}
        commits = [p for p in wanted if hit.tokens < p < len(job.prompt)]
        job.aligned = set(self._alignments(hit.tokens, commits, len(job.prompt) - 1))
        job.boundaries = sorted({*commits, *job.aligned})
        sampler = make_sampler(job.params)
        processors = [*make_processors(job.params),
                      *faults.logits_processors(job.fault, self.tokenizer)]
        if job.grammar is not None:
            # Last of the row's processors, so the mask is applied to the final logits
            # (in its sampler, after the whole batch's masks were filled at once).
            matcher = job.grammar.matcher(self._mask_batch(job.grammar.vocab_size))
            processors.append(matcher)
            sampler = matcher.sampler(sampler)
        cache = fast(hit.cache) if hit.cache is not None else new_cache(self.model)
        (job.uid,) = self._gen.insert_segments(
            [self._segments(job.prompt, hit.tokens, job.boundaries)],
            max_tokens=[job.max_tokens],
            caches=[cache],
            all_tokens=[list(job.prompt[: hit.tokens])],
            samplers=[sampler] if sampler else None,
            logits_processors=[processors],
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
        self._faults = self._faults or bool(job.fault)
        self._jobs[job.uid] = job
        self.peak_running_tokens = max(self.peak_running_tokens, self.running_tokens)
        if not job.readmitted:
            job.cached_tokens = hit.tokens
            if self.misses is not None:
                job.miss = self.misses.explain(self.model_id, job.prompt, job.scope, job.chain,
                                               hit.tokens, self.prefill_tps)
            self.metrics.l(self.metrics.prompt_tokens).inc(len(job.prompt))
            self.metrics.l(self.metrics.cached_tokens).inc(hit.tokens)
            if hit.tokens and self.prefill_tps > 0:
                self.metrics.l(self.metrics.prefill_seconds_saved).inc(hit.tokens / self.prefill_tps)
            if hit.tokens:
                self.metrics.l(self.metrics.hits, tier=tier).inc()
                self.metrics.l(self.metrics.tier_tokens, tier=tier).inc(hit.tokens)
        self._update_gauges()

    def _mask_batch(self, vocab_size: int) -> MaskBatch:
        if self._masks is None or self._masks.words != (vocab_size + 31) // 32:
            self._masks = MaskBatch(vocab_size)
        return self._masks

    @staticmethod
    def _disk_hit(job: Job, hit: Any) -> tuple[Any, str]:
        """The disk tier's state when it serves more of the prompt than RAM does;
        its private view is made here, on the engine thread."""
        restored, job.restored = job.restored, None  # the shared state may be large
        if restored is not None and restored.tokens > hit.tokens:
            job.restored_blocks = restored.state.blocks  # until its commit (Job.restored_blocks)
            return restored.hit(), "disk"
        return hit, "ram"

    def _alignments(self, start: int, commits: list[int], end: int) -> list[int]:
        """Segment ends (not commits) that put every full prefill chunk of a prompt
        resumed at `start` (a cache hit) or after a checkpoint at a multiple of the
        prefill step, as a cold prompt's are (CUDA): the lengths of keys its chunks
        meet are then ones warm-up and earlier prompts gave cuDNN a plan for, where
        chunks counted from the hit met new lengths, each a plan (~60 ms on an H200)."""
        if not self.on_cuda:
            return []
        step, cuts = self.prefill_step, []
        for a, b in zip([start, *sorted(commits)], [*sorted(commits), end]):
            first = -(-a // step) * step
            if a < first < b:
                cuts.append(first)
        return cuts

    @staticmethod
    def _segments(prompt: list[int], start: int, boundaries: list[int]) -> list[list[int]]:
        """The prompt after `start`, cut at each boundary; the final token alone
        last, so the generator reports the boundary before it (see module doc)."""
        cuts = [start, *boundaries, len(prompt) - 1, len(prompt)]
        return [prompt[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]

    def _reap_cancelled(self) -> None:
        if any(j.cancelled for j in self._held):
            waiting = self._held
            self._held = collections.deque(j for j in waiting if not j.cancelled)
            for job in waiting:
                if job.cancelled:
                    self._admit_or_fail(job)  # answers 499
        gone = [j for j in self._jobs.values() if j.cancelled]
        for job in gone:
            if job.phase == "prefill":
                # A disconnect mid-prefill keeps the chunks already processed.
                self._keep_partial(job, "disconnect_prefill")
            self._gen.remove([job.uid])
            self._finish(job, "disconnect")

    def _keep_partial(self, job: Job, path: str) -> None:
        """Commit what a sequence still in prefill has processed, when its state
        is whole (after a failed step it may not be: then nothing is kept)."""
        try:
            found = self._gen.extract_cache([job.uid])
        except Exception:  # e.g. nothing processed yet: no state to extract
            log.debug("no partial prefill to keep", exc_info=True)
            return
        cache, tokens = found.get(job.uid, (None, []))
        if not cache or len(tokens) <= job.start:
            return
        held = held_tokens(cache)
        if held != len(tokens):
            # A recurrent-only model (None) gives no count to check the state by.
            log.info("not keeping a partial prefill: state holds %s tokens, list has %d",
                     held, len(tokens))
            return
        self._commit(job, cache, tokens, path)

    def _step(self) -> None:
        try:
            before = _counts(self._gen)
            prompt_responses, gen_responses = self._gen.next()
            prompt_tokens, prompt_time, steps, decode_time = (
                b - a for a, b in zip(before, _counts(self._gen)))
        except Exception as exc:
            log.exception("batch step failed")
            if device_lost(exc):
                self._lose_device(exc)
                return
            if device_trouble(exc):  # the card's state now, not the request's fault
                self._out_of_memory()
                self._recover(OOM_MESSAGE.format(exc), status=503)
                return
            self._recover(f"Generation failed: {exc}")
            return
        if prompt_tokens and prompt_time > 0:
            rate = prompt_tokens / prompt_time
            self.prefill_tps = rate if not self.prefill_tps else 0.8 * self.prefill_tps + 0.2 * rate
        if steps and decode_time > 0:
            per_s = steps / decode_time
            old = self.decode_steps_per_s
            self.decode_steps_per_s = per_s if not old else 0.9 * old + 0.1 * per_s
        for r in prompt_responses:
            job = self._jobs.get(r.uid)
            if job is None:
                continue
            job.processed = job.start + r.progress[0]
            if r.end_of_prompt:
                job.phase = "decode"
                job.processed = len(job.prompt)
            elif r.end_of_segment and job.boundaries:
                position = job.boundaries.pop(0)
                if position not in job.aligned:
                    self._checkpoint(job, position)
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
        decoding = self.decoding = self._decoding_now()
        self.peak_batch = max(self.peak_batch, decoding)
        # Every change of who is in the batch shows at once; pure decoding, at a rate.
        self._update_gauges(force=bool(prompt_responses) or len(self._jobs) != self._gauged_jobs)
        if self._faults:
            faults.delay_prefill(self._jobs.values())

    def _checkpoint(self, job: Job, position: int) -> None:
        """The step that just ran ended a segment: the state holds the prompt up
        to `position` exactly. At the prompt's end it is kept on the job for
        `_commit_taken`."""
        cache, tokens = self._gen.extract_cache([job.uid])[job.uid]
        if len(tokens) != position:
            log.error("not checkpointing: generator holds %d tokens, expected %d", len(tokens), position)
            return
        if position != len(job.prompt) - 1:
            self._commit(job, cache, tokens, "checkpoint")
            return
        # Evaluated now: the extracted copy must not wait on the generator's next
        # step, which writes into the arrays it was copied from.
        mx.eval([c.state for c in cache])
        job.taken = (cache, list(tokens))

    def _commit_taken(self, job: Job | None = None, sent_only: bool = False) -> None:
        """Commit prompts' states taken at their end: `job`'s, or every job's (with
        `sent_only`, of those whose first token has gone out)."""
        for j in [job] if job is not None else list(self._jobs.values()):
            if j.taken is None or (sent_only and j.first_token_at is None):
                continue
            (cache, tokens), j.taken = j.taken, None
            if self.lost:
                continue  # nothing runs on the device any more
            try:
                self._commit(j, cache, tokens, "checkpoint")
            except Exception:
                log.exception("committing a prompt's state failed")

    def _commit(self, job: Job, cache: list, tokens: list[int], path: str) -> None:
        if job.taken is not None and path != "checkpoint":
            self._commit_taken(job)  # the prompt first: a finish then supersedes it
        tokens = np.array(tokens, dtype=np.int32)  # the generator keeps appending to its list
        mx.eval([c.state for c in cache])
        held = held_tokens(cache)
        if held is not None and held != len(tokens):
            log.error("not committing: the cache holds %d tokens, the list has %d", held, len(tokens))
            return
        done = self.store.commit(self.model_id, tokens, cache, path,
                                 chain=self._chain_for(job, path, len(tokens)), scope=job.scope,
                                 prefix_chains=job.checkpoints)
        job.restored_blocks = None  # the store holds what it took of them
        self._count_commit(done, path)
        if path == "finish" and done.entry is not None and done.kept == len(tokens):
            # The conversation's next turn most likely comes back here (the proxy
            # routes it so): its hit then starts from this copy, not from blocks.
            self.store.keep_hot(done.entry, cache)
        if self.misses is not None:
            self.misses.on_commit(done, tokens, self.model_id, job.scope)

    def _count_commit(self, done: Commit, path: str) -> None:
        """A commit kept nowhere is refused, never counted as a commit, and never
        silent; one over the RAM budget is a commit that says what RAM kept."""
        m, budget = self.metrics, format_bytes(self.store.budget_bytes)
        if done.refused:
            m.l(m.commits_refused, reason=done.refused).inc()
            self._warnings.warn(
                f"refused:{done.refused}", "not keeping a prompt cache of %d tokens (%s): over "
                "the RAM budget (%s) with no prefix that fits, and %s", done.tokens,
                format_bytes(done.nbytes), budget, REFUSALS.get(done.refused, done.refused))
            return
        m.l(m.commits, path=path).inc()
        if done.over_budget:
            m.l(m.commits_over_budget, whole="disk" if done.on_disk else "dropped").inc()
            self._warnings.warn(
                f"over:{done.disk_refused}", "a prompt cache of %d tokens (%s) is over the RAM "
                "budget (%s): RAM keeps %s; %s", done.tokens, format_bytes(done.nbytes), budget,
                f"its first {done.kept} tokens" if done.kept else "none of it (its cache cannot be cut)",
                "the disk tier keeps the whole" if done.on_disk
                else f"the rest is lost: {REFUSALS.get(done.disk_refused, done.disk_refused)}")

    def _chain_for(self, job: Job, path: str, n_tokens: int) -> list[int]:
        if path == "finish" and job.extend_chain is not None:
            try:
                return job.extend_chain("".join(job.reply_text), job.reply_tool_calls)
            except ValueError:
                log.warning("could not compute the extended prefix chain", exc_info=True)
            return job.chain
        # A checkpoint, or a partial prefill: the keys of the deepest checkpoint
        # it contains (a partial one also inherits the keys of what it supersedes).
        held = [p for p in job.checkpoints if p <= n_tokens]
        depth, keys = (max(held), job.checkpoints[max(held)]) if held else (0, [])
        if path in ("disconnect_prefill", "recovered") and job.partial_chain is not None:
            # A model that keeps no checkpoints mid-prompt (full attention) would
            # advertise nothing for it: the proxy could not route the retry back.
            try:
                position, more = job.partial_chain(n_tokens)
            except Exception:
                log.warning("could not compute a partial prefill's prefix chain", exc_info=True)
            else:
                if position > depth:
                    keys = more
        return keys

    def _on_token(self, job: Job, r: Any) -> None:
        job.generated += 1
        if job.first_token_at is None:
            job.first_token_at = time.perf_counter()
            cached = "true" if is_cache_hit(job.cached_tokens, len(job.prompt)) else "false"
            self.metrics.l(self.metrics.ttft, cached=cached).observe(job.first_token_at - job.submitted)
        is_eos = r.token in self.tokenizer.eos_token_ids
        chunk = Chunk()
        if not is_eos:
            job.detokenizer.add_token(r.token)
            start = job.parser.fed
            chunk = job.parser.feed(job.detokenizer.last_segment)
            if job.params.logprobs:
                self._place_logprob(job, r, start, bool(chunk.tool_calls))
        if chunk.stopped:
            self._emit_chunk(job, chunk, end="stop")
            if r.finish_reason is None:
                caches = self._gen.remove([job.uid], return_prompt_caches=True)
                cache, tokens = caches[job.uid]
            else:
                # The stop string came with the last token max_tokens allowed: the
                # generator has already let the sequence go and hands its cache here.
                cache, tokens = r.prompt_cache, r.all_tokens
            self._endings.append((job, cache, tokens, "stop", chunk.stop))
            return
        if r.finish_reason is None:
            self._emit_chunk(job, chunk)
            return
        job.detokenizer.finalize()
        tail = job.parser.finish(job.detokenizer.last_segment, cut=r.finish_reason == "length")
        chunk.text += tail.text
        chunk.tool_calls += tail.tool_calls
        self._emit_chunk(job, chunk, end="finish")
        # Cut by max tokens is "length" even after whole calls: the reply may have
        # been about to call more, or to say more (as OpenAI reports it).
        if r.finish_reason == "length":
            exit_path = "length"
        else:
            exit_path = "tool_calls" if job.parser.n_tool_calls else "eos"
        self._endings.append((job, r.prompt_cache, r.all_tokens, exit_path, None))

    def _after_sending(self) -> None:
        """The commits the step's tokens did not wait for. Finished sequences: the
        entry grows by the reply, which the next turn of the conversation sends back
        as its prefix; the request's end goes out after it (a client that sends the
        next turn on it finds it). Then prompts whose first token has gone out."""
        endings, self._endings = self._endings, []
        for job, cache, tokens, exit_path, stop in endings:
            if job.phase == "done":  # failed meanwhile (an engine error)
                continue
            try:
                self._commit(job, cache, tokens, "finish")
            except Exception:  # the reply is whole and sent: the request still succeeds
                log.exception("committing a finished reply failed")
            self._finish(job, exit_path, stop=stop)
        self._commit_taken(sent_only=True)
        if endings:
            self.decoding = self._decoding_now()
            self._update_gauges()

    def _decoding_now(self) -> int:
        return sum(j.phase == "decode" for j in self._jobs.values())

    def _place_logprob(self, job: Job, r: Any, start: int, ended_call: bool) -> None:
        """Queue the token's logprob with where its text lies in the text fed to the
        parser (`_sendable_logprobs` reads it). The detokenizer holds a token back
        while its text is not whole (a byte of a multi-byte character, a lone space):
        the tokens held share the span of the text that comes out with a later one."""
        entry = self._logprob_entry(r, job.params.top_logprobs)
        # A token read while the parser is inside a tool call, or that ended one, is
        # the call's (its marker may be one special token that comes out with a space).
        entry["call"] = job.parser.in_tool or ended_call
        entry["start"], entry["text"] = start, None
        job.pending_logprobs.append(entry)
        if not getattr(job.detokenizer, "_unflushed", ""):  # all text out: spans known
            for e in reversed(job.pending_logprobs):
                if e["text"] is not None:
                    break
                e["text"] = (e["start"], job.parser.fed)

    def _logprob_entry(self, r: Any, top: int) -> dict:
        logprobs = r.logprobs
        # Read from a copy: on CUDA a host read of the element (a view) would move the
        # batch's whole logprobs buffer into managed memory, which MLX's buffer cache
        # then hands back to the next step's GPU writes, page faults and all.
        entry = {"id": r.token, "logprob": mx.array(logprobs[r.token]).item(), "top": []}
        if top:
            ids = mx.argpartition(-logprobs, kth=top - 1)[:top]
            vals = logprobs[ids]
            order = mx.argsort(-vals)
            entry["top"] = list(zip(ids[order].tolist(), vals[order].tolist()))
        return entry

    def _emit_chunk(self, job: Job, chunk: Chunk, end: str = "") -> None:
        logprobs = self._sendable_logprobs(job, end)
        if not (chunk.text or chunk.tool_calls or logprobs):
            if job.generated == 1:  # nothing of the first token to send: none waits on it
                job.first_out_at = job.first_token_at
            return
        job.reply_text.append(chunk.text)
        job.reply_tool_calls += chunk.tool_calls
        job.emit(Delta(chunk.text, chunk.tool_calls, logprobs))

    def _sendable_logprobs(self, job: Job, end: str) -> list[dict]:
        """The logprobs that go out now: those of tokens whose text the parser has
        decided, by position in the text fed to it (not by token length: a byte token
        of a character decodes alone to a replacement character). Tokens of text held
        back (a possible stop string) wait for it; a tool call's tokens are dropped (a
        chat answer's logprobs are its content's); at a stop, every token that holds
        part of the stop string is dropped, as the string is; at the finish, the rest
        goes."""
        p, pending = job.parser, job.pending_logprobs
        limit = p.stop_at if end == "stop" else (float("inf") if end == "finish" else p.consumed)
        n = 0  # how many, from the first, go now
        while n < len(pending) and (end == "finish" or pending[n]["text"] is not None
                                    and pending[n]["text"][1] <= limit):
            n += 1
        # At the finish an entry still held by the detokenizer spans what came out after it.
        spans = [e["text"] or (e["start"], p.fed) for e in pending[:n]]
        out = [self._named_logprobs(e) for e, span in zip(pending[:n], spans)
               if not (e["call"] or p.in_call(*span))]
        job.pending_logprobs = [] if end else pending[n:]
        return out

    def _named_logprobs(self, entry: dict) -> dict:
        name = self.token_bytes.text
        return {
            "token": name(entry["id"]),
            "bytes": self.token_bytes(entry["id"]),
            "logprob": entry["logprob"],
            "top": [(name(i), v) for i, v in entry["top"]],
            "top_bytes": [self.token_bytes(i) for i, _ in entry["top"]],
        }

    def _finish(self, job: Job, exit_path: str, stop: str | None = None) -> None:
        self._commit_taken(job)
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
        self.reply_tokens = (job.generated if not self.reply_tokens
                             else 0.9 * self.reply_tokens + 0.1 * job.generated)
        job.emit(Finish(reason, exit_path, len(job.prompt), job.generated, job.cached_tokens, stop))

    def _fail(self, job: Job, message: str, status: int = 500) -> None:
        self._commit_taken(job)  # taken before the failure: a whole state
        self._jobs.pop(job.uid, None)
        job.phase = "done"
        self.metrics.l(self.metrics.finished, exit="error").inc()
        job.emit(server_error(message) if status == 500 else APIError(status, message, "server_error"))

    def _fail_all(self, message: str, status: int = 500) -> None:
        held = []
        if self._stopping:  # after a failed step, waiting prompts are unaffected
            held, self._held = [*self._held, *self._followers], collections.deque()
            self._followers = []
        for job in [*held, *self._jobs.values()]:
            self._fail(job, message, status)
        self._update_gauges()

    def _lose_device(self, exc: BaseException) -> None:
        """The GPU context is gone: every request here fails with a 503 (a proxy
        retries it on another backend), as does every later one, the engine stops,
        and `on_lost` has the process exit so that it is restarted (what it wrote to
        its disk tier, where one is configured, is there for its successor)."""
        self.lost = str(exc)
        log.critical("the GPU failed for good in this process (%s): failing its requests and "
                     "exiting with status %d so that it is restarted", exc, EXIT_DEVICE_LOST)
        self._stopping = True
        self._fail_all(LOST_MESSAGE, status=503)
        self._fail_inbox()
        self._flush()
        self.on_lost()

    def _fail_inbox(self) -> None:
        """Requests and calls not yet taken, once the GPU is lost: nothing runs them."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[0] == "job":
                self._taken += 1
                self._fail(item[1], LOST_MESSAGE, 503)
            elif item is not None:
                _, _, loop, fut = item
                loop.call_soon_threadsafe(_settle, fut, None, RuntimeError(LOST_MESSAGE))

    def _recover(self, message: str, status: int = 500) -> None:
        """After a failed step the generator's state is unknown. Sequences that
        were decoding, or completing their prompt in that step, fail (their
        prompts were committed at their last checkpoint). Those still in prefill
        keep their progress: what they processed is committed when their state is
        whole, and they start again in a fresh generator from the best entry —
        once; a second failure fails them too."""
        survivors = []
        held = self._in_generator()
        for job in list(self._jobs.values()):
            if job.phase == "prefill" and not job.readmitted and job.uid in held:
                self._keep_partial(job, "recovered")
                survivors.append(job)
            else:
                self._fail(job, message, status)
        self._jobs.clear()
        self._gen = self._new_generator()
        for job in survivors:
            job.uid, job.phase, job.readmitted = None, "queued", True
            self._admit_or_fail(job)
        self._update_gauges()

    def _mind_the_card(self) -> None:
        """Replicas share one card, and MLX caps only its own arrays and buffer cache:
        the card also holds each process's CUDA context, libraries' workspaces and
        what its memory pool keeps. Two 7B replicas on an 80 GB H100, each within its
        cap, left the card ~1 GB free and failed allocations while each kept ~3.5 GB
        of freed buffers. When the card's free memory falls under `CARD_RESERVE` of it
        (`CARD_RESERVE_MIN` at least), this backend gives its buffer cache back, for its
        own next step or a sibling's. (CUDA's pool gives back at once what MLX frees in
        whole; what it keeps are holes between live arrays, which no trim releases:
        measured on an H100, BENCHMARKS.md.)"""
        now = time.monotonic()
        if not self.on_cuda or now < self._card_checked + CARD_CHECK_S:
            return
        self._card_checked = now
        card = card_memory()
        if card is None or not mx.get_cache_memory():
            return
        free, total = card
        if free >= max(CARD_RESERVE * total, CARD_RESERVE_MIN):
            return
        released = mx.get_cache_memory()
        mx.clear_cache()
        self.metrics.l(self.metrics.card_low).inc()
        if now >= self._card_logged + 60:
            self._card_logged = now
            log.info("the card has %s free: gave back %s of MLX's buffer cache (said at most "
                     "once a minute)", format_bytes(free), format_bytes(released))

    def _out_of_memory(self) -> None:
        """After a step found no device memory: say what this process held (the
        operator's first question), and give its buffer cache back to the device, where
        another replica's allocation may be what failed next."""
        stats = self.store.stats()
        log.error("out of device memory: %s; prompt cache %s (+%s of finished turns' copies); "
                  "%d sequences running, %d KV tokens",
                  ", ".join(f"{k} {format_bytes(v)}" for k, v in memory().items()),
                  format_bytes(stats["bytes"]), format_bytes(stats["hot_bytes"]),
                  len(self._jobs), self.running_tokens)
        self.store.drop_hot()
        mx.clear_cache()

    def _in_generator(self) -> set[int]:
        # Sequences the generator still holds; one that was completing its prompt
        # in a failed step is in neither its prompt nor its generation batch.
        # (mlx-lm has no public "holds uid"; extract_cache would copy every state.)
        try:
            return set(self._gen._find_uids(list(self._jobs)))
        except Exception:
            return set()

    def _update_gauges(self, force: bool = True) -> None:
        # Per decode step only every GAUGE_PERIOD: at 200 steps/s the gauges
        # cost more Python time than one token's worth of the step budget allows.
        load = (self.waiting, len(self._jobs), self.decoding)
        if load != self._load_seen:
            self._load_seen = load
            for listener in self.load_listeners:
                listener()
        now = time.perf_counter()
        if not force and now - self._gauges_at < GAUGE_PERIOD:
            return
        self._gauges_at = now
        self._gauged_jobs = len(self._jobs)
        m = self.metrics
        stats = self.store.stats()
        m.l(m.queue_depth).set(self.queue_depth)
        m.l(m.batch_size).set(self._decoding_now())
        m.l(m.cache_bytes).set(stats["bytes"])
        m.l(m.cache_entries).set(stats["entries"])
        m.l(m.cache_unshared).set(stats["bytes_unshared"])
        m.l(m.cache_sharing).set(stats["sharing_ratio"])
        m.l(m.cache_hot_bytes).set(stats["hot_bytes"])
        m.l(m.cache_blocks, tier="ram").set(stats["blocks"])
        m.l(m.prefill_tps).set(self.prefill_tps)
        m.l(m.memory, kind="active").set(mx.get_active_memory())
        m.l(m.memory, kind="cache").set(mx.get_cache_memory())
        m.l(m.memory, kind="peak").set(mx.get_peak_memory())
        pool = pool_memory() if self.on_cuda else None
        if pool is not None:
            m.l(m.memory, kind="pool_reserved").set(pool[0])
            m.l(m.memory, kind="pool_used").set(pool[1])


def _counts(gen: BatchGenerator) -> tuple[int, float, int, float]:
    """The generator's prompt tokens and seconds, decode steps and seconds so far.
    Read from its counters: its `stats()` copies them twice (`dataclasses.asdict`,
    deep) and reads the peak memory twice, ~0.1 ms of a decode step's Python on a
    CPU, where 8 streams' steps take ~3 ms."""
    c = gen._counters
    return c.prompt_tokens, c.prompt_time, c.generation_steps, c.decode_time


def _settle(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def _drain(gen: BatchGenerator, uids: list[int]) -> list[tuple[list, list[int]]]:
    """Step `gen` until the sequences `uids` finish; their final caches."""
    done: dict[int, tuple[list, list[int]]] = {}
    while len(done) < len(uids):
        _, responses = gen.next()
        for r in responses:
            if r.finish_reason is not None:
                done[r.uid] = (r.prompt_cache, r.all_tokens)
    return [done[u] for u in uids]


def _deliver(events: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue_, event in events:
        queue_.put_nowait(event)

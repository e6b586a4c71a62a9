"""A request as the engine sees it (`Job`), and the events it answers with: `Delta`s
of the reply, then a `Finish` (or an `APIError`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .output import OutputParser
from .requests import SamplingParams


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
    stop: str | None = None  # the stop string that ended generation, when one did


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
    # Token positions worth a store entry -> the prefix keys of what they hold.
    # The server always gives the prompt's last position but one.
    checkpoints: dict[int, list[int]] = field(default_factory=dict)
    # The chain of the next turn once the reply is known (prompt + assistant message).
    extend_chain: Callable[[str, list[dict]], list[int]] | None = None
    # (token end, keys) of the deepest message boundary within a prefix of n tokens:
    # what a partial prefill (disconnect, recovery) is advertised by.
    partial_chain: Callable[[int], tuple[int, list[int]]] | None = None
    scope: str | None = None
    fault: str | None = None
    cancelled: bool = False
    restored: Any = None  # a disk tier state for this prompt (backend/disk.py Restored)
    # Its blocks, held from admission until the prompt is committed: the store takes
    # them as they are (paged.Pool.restored) instead of copying them again.
    restored_blocks: Any = None
    miss: Any = None  # why its prompt missed the cache, at admission (backend/misses.py View)
    grammar: Any = None  # what the answer must be: a compiled backend/grammar.py Grammar
    # Another choice of the same request (n > 1): admitted once `after` has committed its
    # prompt, so that this one finds it in the store and prefills only its last token.
    after: "Job | None" = None
    # Engine-side state.
    uid: int | None = None
    phase: str = "queued"  # queued, prefill, decode, done
    cached_tokens: int = 0  # what the client is told came from cache
    start: int = 0  # where the generator's copy of the prompt begins (a cache hit)
    boundaries: list[int] = field(default_factory=list)  # segment ends still ahead
    aligned: set[int] = field(default_factory=set)  # of those, chunk alignments: no commit
    # The prompt's state at its end (cache, tokens), taken there and committed once its
    # first token has gone out, or when it ends before that (Engine._commit_taken).
    taken: tuple[list, list[int]] | None = None
    readmitted: bool = False
    processed: int = 0
    generated: int = 0
    submitted: float = field(default_factory=time.perf_counter)
    queued_at: float = 0.0  # when it was handed to the engine
    first_token_at: float | None = None
    # When its first output reached the client's connection (a stream's first chunk
    # written; a whole answer's first event in the handler), or its first token's time
    # when that token had nothing to send: until then a user waits on this request.
    first_out_at: float | None = None
    parser: OutputParser | None = None
    detokenizer: Any = None
    pending_logprobs: list[dict] = field(default_factory=list)
    outbox: list | None = None
    reply_text: list[str] = field(default_factory=list)
    reply_tool_calls: list[dict] = field(default_factory=list)

    def emit(self, event: Any) -> None:
        if self.outbox is not None:  # the engine delivers a step's events together
            self.outbox.append((self, event))
        else:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def cancel(self) -> None:
        self.cancelled = True

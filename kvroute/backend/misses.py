"""Why a request's prompt missed this backend's prompt cache, by what its store knows:
what it holds (in this scope, in other scopes, in entries that cannot be cut), what it
held (evicted for the RAM budget, then perhaps from the disk tier too) and what it would
not keep (over the budgets). The reasons are kvroute/core/misses.py's.

`Misses.explain` runs on the engine thread at admission, right after the store's lookup,
so that it describes the store that lookup saw (a moment later the request's own commit
is in it). Its `View` goes to the proxy in the answer's headers (`view_headers`), which
combines it with the routing's facts, and is counted in the backend's metrics.

What was evicted or refused is remembered as token arrays only: 4 bytes a token, where
an entry's KV costs KiB to MiB a token; at most `keep_tokens` of them, oldest out first.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvroute.core import misses as reasons
from kvroute.core.misses import MIN_LOST_TOKENS

from .store import Commit, Entry, Event, Store, common_prefix

log = logging.getLogger("kvroute.backend.misses")

KEEP_TOKENS = 1 << 21  # tokens of evicted or refused entries remembered (8 MiB)


@dataclass(frozen=True)
class View:
    """The backend's reason for one request, the tokens it lost, and where the prompt
    leaves the entry that holds its deepest advertised prefix key (None: no entry does)."""

    reason: str
    lost: int = 0
    diverged_at: int | None = None


@dataclass(frozen=True)
class _Gone:
    model: str
    scope: str | None
    tokens: np.ndarray
    cause: str  # EVICTED_RAM (the disk may still hold it) or TOO_LARGE


class Misses:
    def __init__(self, store: Store, metrics: Any, disk: Any = None, opening: int = 0,
                 keep_tokens: int = KEEP_TOKENS):
        self.store = store
        self.metrics = metrics
        self.disk = disk  # backend/disk.py's DiskTier, or None
        self.opening = opening  # tokens every chat prompt starts with (template_opening)
        self.keep_tokens = keep_tokens
        self._gone: collections.deque[_Gone] = collections.deque()
        self._gone_tokens = 0
        # Prefix key -> the entries advertised under it, kept from the store's events: the
        # entry a request's deepest key points at is found in one walk of its chain.
        self._holders: dict[int, set[int]] = collections.defaultdict(set)
        self._entries: dict[int, Entry] = {}
        store.listeners.append(self.on_store_event)

    # -- what the store holds and let go (engine thread) -----------------------------

    def on_store_event(self, event: Event) -> None:
        e = event.entry
        if e is None:
            return
        if event.kind == "insert":  # a new entry, or more keys for one
            self._entries[e.id] = e
            for key in e.chain:
                self._holders[key].add(e.id)
            return
        if event.reason == "trimmed":  # cut shorter by eviction; it stays, under fewer keys
            kept = set(e.chain)
            self._unhold(e.id, [k for k in event.before.chain if k not in kept])
            self._remember(_Gone(e.model, e.scope, event.before.tokens, reasons.EVICTED_RAM))
            return
        if self._entries.pop(e.id, None) is not None:
            self._unhold(e.id, e.chain)
        if event.reason == "evicted":
            self._remember(_Gone(e.model, e.scope, e.tokens, reasons.EVICTED_RAM))

    def _unhold(self, entry_id: int, keys: list[int]) -> None:
        for key in keys:
            ids = self._holders.get(key)
            if ids is not None:
                ids.discard(entry_id)
                if not ids:
                    del self._holders[key]

    def on_commit(self, done: Commit, tokens: np.ndarray, model: str, scope: str | None) -> None:
        """A commit over the budgets that RAM kept only in part (or not at all) and the
        disk tier did not take whole."""
        if done.kept < done.tokens and not done.on_disk:
            self._remember(_Gone(model, scope, np.asarray(tokens, dtype=np.int32),
                                 reasons.TOO_LARGE))

    def _remember(self, gone: _Gone) -> None:
        self._gone.append(gone)
        self._gone_tokens += len(gone.tokens)
        while self._gone_tokens > self.keep_tokens and len(self._gone) > 1:
            self._gone_tokens -= len(self._gone.popleft().tokens)

    # -- one request (engine thread, at admission) -----------------------------------

    def explain(self, model: str, prompt: list[int], scope: str | None, chain: list[int],
                cached: int, prefill_tps: float = 0.0) -> View:
        tokens = np.asarray(prompt, dtype=np.int32)
        limit = len(tokens) - 1  # the last token always runs through the model
        own, other = self._held(model, tokens, scope, limit)
        diverged = self._diverged(model, tokens, scope, chain, limit)
        causes = [(own - cached, reasons.NO_CHECKPOINT), (other - max(cached, own), reasons.OTHER_SCOPE)]
        causes += self._let_go(model, tokens, scope, cached, limit)
        lost, reason = max(causes, key=lambda c: c[0])
        if lost < MIN_LOST_TOKENS:
            lost, reason = 0, self._hit_or_new(cached, limit)
        view = View(reason, lost, diverged)
        m = self.metrics
        m.l(m.cache_reasons, reason=reason).inc()
        if lost and prefill_tps > 0:
            m.l(m.seconds_lost, reason=reason).inc(lost / prefill_tps)
        return view

    def _held(self, model: str, tokens: np.ndarray, scope: str | None,
              limit: int) -> tuple[int, int]:
        """The longest common prefix with an entry of this scope, usable or not; the
        same for other scopes."""
        own = other = 0
        with self.store.lock:
            for e in self.store.entries.values():
                if e.model == model:
                    n = min(common_prefix(e.tokens, tokens), limit)
                    if e.scope == scope:
                        own = max(own, n)
                    else:
                        other = max(other, n)
        return own, other

    def _diverged(self, model: str, tokens: np.ndarray, scope: str | None, chain: list[int],
                  limit: int) -> int | None:
        """Where the prompt leaves the entry advertised under the deepest key of its chain
        (what the registry told the proxy); None when no entry holds one. Key 0, the
        header, is every request's."""
        for key in reversed(chain[1:]):
            held = [self._entries[i] for i in self._holders.get(key, ())]
            held = [e for e in held if e.model == model and e.scope == scope]
            if held:
                return max(min(common_prefix(e.tokens, tokens), limit) for e in held)
        return None

    def _let_go(self, model: str, tokens: np.ndarray, scope: str | None, cached: int,
                limit: int) -> list[tuple[int, str]]:
        best: dict[str, int] = {}
        for g in self._gone:
            if g.model == model and g.scope == scope:
                best[g.cause] = max(best.get(g.cause, 0), min(common_prefix(g.tokens, tokens), limit))
        out = []
        for cause, n in best.items():
            if n - cached < MIN_LOST_TOKENS:
                continue
            if cause == reasons.EVICTED_RAM and self.disk is not None and self.disk.enabled:
                if self.disk.best(model, tokens, scope, above=n - 1)[0] >= n:
                    continue  # on disk: a restore (or a prefill the engine chose over one)
                cause = reasons.EVICTED_DISK
            out.append((n - cached, cause))
        return out

    def _hit_or_new(self, cached: int, limit: int) -> str:
        # Past the template's opening: a real prefix, at least half of a short prompt.
        beyond = cached - self.opening
        return reasons.HIT if beyond > 0 and beyond >= min(MIN_LOST_TOKENS, (limit - self.opening) // 2) \
            else reasons.NEW_PREFIX


def view_headers(view: View | None) -> dict[str, str]:
    """The view as the answer's headers, for the proxy (none before admission)."""
    if view is None:
        return {}
    out = {reasons.REASON_HEADER: view.reason, reasons.LOST_HEADER: str(view.lost)}
    if view.diverged_at is not None:
        out[reasons.DIVERGED_HEADER] = str(view.diverged_at)
    return out


def template_opening(tokenizer: Any) -> int:
    """How many tokens every chat prompt of this template starts with whatever its
    messages say (`<|im_start|>system\\n`, a default system prompt): cached for every
    conversation, so matching them alone is no hit. 0 when the template refuses the
    probes."""
    probes = [([{"role": "system", "content": word}, {"role": "user", "content": "Hi"}])
              for word in ("Alpha", "Zulu")], [[{"role": "user", "content": word}]
                                              for word in ("Alpha", "Zulu")]
    opening = 0
    for a, b in probes:
        try:
            ta, tb = (np.asarray(list(tokenizer.apply_chat_template(m, add_generation_prompt=True)),
                                 dtype=np.int32) for m in (a, b))
        except Exception:
            log.debug("template opening probe refused", exc_info=True)
            continue
        opening = max(opening, common_prefix(ta, tb))
    return opening

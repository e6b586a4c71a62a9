"""The prompt-cache store: committed KV caches keyed by the tokens they hold.

Only the engine thread calls into the store (DESIGN invariant 1); listeners it
notifies must therefore hand work off (e.g. to an asyncio loop) rather than block.

- `lookup` finds the entry sharing the longest token prefix with a prompt and
  returns a cache holding exactly that prefix (trimming a longer entry when its
  cache type allows it);
- `insert` commits an entry, dropping entries it makes redundant;
- a byte budget is enforced by LRU eviction;
- every insert and eviction is an `Event` for listeners (the registry publisher),
  with the prefix keys that became held or released by this store as a whole.
"""

from __future__ import annotations

import copy
import functools
import itertools
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache


@dataclass
class Entry:
    id: int
    model: str
    tokens: np.ndarray  # int32, exactly the tokens whose KV `cache` holds
    cache: list[Any]  # mlx-lm cache objects, one per layer
    nbytes: int
    exit_path: str  # why it was committed: prefill, disconnect, length, ...
    chain: list[int] = field(default_factory=list)  # prefix keys advertised for it
    scope: str | None = None  # cache scope (tenant): entries never serve another scope
    created: float = field(default_factory=time.time)
    hits: int = 0

    @property
    def trimmable(self) -> bool:
        return can_trim_prompt_cache(self.cache)


@dataclass
class Event:
    kind: str  # "insert" or "evict"
    model: str
    entry_id: int
    keys: list[int]  # keys this store newly holds (insert) or no longer holds (evict)
    nbytes: int
    reason: str = ""


@dataclass
class Match:
    tokens: int  # how many leading prompt tokens `cache` holds
    cache: list[Any] | None
    entry_id: int | None = None


def cache_nbytes(cache: list[Any]) -> int:
    return sum(c.nbytes for c in cache)


def cache_tokens(cache: list[Any]) -> int:
    """Tokens held by a per-layer cache (its first layer's offset)."""
    return cache[0].size() if cache else 0


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def _synchronized(method: Callable) -> Callable:
    @functools.wraps(method)
    def wrapper(self: "Store", *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)

    return wrapper


class Store:
    def __init__(self, budget_bytes: int, max_entries: int = 256):
        self.budget_bytes = budget_bytes
        self.max_entries = max_entries
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # LRU order, oldest first
        self.nbytes = 0
        self.evictions = 0
        self.listeners: list[Callable[[Event], None]] = []
        self._ids = itertools.count(1)
        self._key_refs: dict[str, Counter] = {}
        # Entries change on the engine thread; `snapshot` and `stats` are read from
        # the event loop, so both sides take this lock.
        self.lock = threading.RLock()

    def __len__(self) -> int:
        return len(self.entries)

    @_synchronized
    def lookup(self, model: str, tokens: list[int] | np.ndarray, scope: str | None = None) -> Match:
        """The longest cached prefix of `tokens` that leaves at least one token to
        process (a prompt's last token must run through the model to give logits)."""
        prompt = np.asarray(tokens, dtype=np.int32)
        limit = len(prompt) - 1
        best: tuple[int, Entry] | None = None
        for entry in self.entries.values():
            if entry.model != model or entry.scope != scope:
                continue
            n = min(common_prefix(entry.tokens, prompt), limit)
            if n < len(entry.tokens) and not entry.trimmable:
                continue
            if n > 0 and (best is None or n > best[0]):
                best = (n, entry)
        if best is None:
            return Match(0, None)
        n, entry = best
        entry.hits += 1
        self.entries.move_to_end(entry.id)
        return Match(n, self._view(entry, n), entry.id)

    def _view(self, entry: Entry, n: int) -> list[Any]:
        # Shallow copies share the (immutable) MLX arrays; trimming only moves the
        # copy's offset, so the stored entry is never altered by its users.
        cache = [copy.copy(c) for c in entry.cache]
        excess = len(entry.tokens) - n
        if excess:
            trim_prompt_cache(cache, excess)
        return cache

    @_synchronized
    def insert(
        self,
        model: str,
        tokens: list[int] | np.ndarray,
        cache: list[Any],
        exit_path: str,
        chain: list[int] | None = None,
        scope: str | None = None,
    ) -> Entry | None:
        """Commit `cache`, which must hold exactly `tokens`. Returns the new entry,
        or None when an existing entry already covers it (that one is refreshed)."""
        tokens = np.asarray(tokens, dtype=np.int32)
        held = cache_tokens(cache)
        if held != len(tokens):
            raise ValueError(f"cache holds {held} tokens but {len(tokens)} were given")
        if len(tokens) == 0:
            return None
        covering = self._covering(model, tokens, scope)
        if covering is not None:
            self.entries.move_to_end(covering.id)
            self._merge_chain(covering, chain or [])
            return None
        nbytes = cache_nbytes(cache)
        if nbytes > self.budget_bytes:
            return None
        entry = Entry(next(self._ids), model, tokens, cache, nbytes, exit_path, list(chain or []), scope)
        self.entries[entry.id] = entry
        self.nbytes += nbytes
        self._emit("insert", entry, self._hold(model, entry.chain))
        # Entries this one extends are now redundant: a trimmed view serves them.
        if entry.trimmable:
            for old in list(self.entries.values()):
                if (old is not entry and old.model == model and old.scope == scope
                        and self._is_prefix(old.tokens, tokens)):
                    self._remove(old, "superseded")
        self._enforce_budget(keep=entry.id)
        return entry

    @_synchronized
    def covers(self, model: str, tokens: list[int] | np.ndarray, scope: str | None = None) -> bool:
        """Whether some entry already holds all of `tokens` (so a commit would add nothing)."""
        return self._covering(model, np.asarray(tokens, dtype=np.int32), scope) is not None

    def _covering(self, model: str, tokens: np.ndarray, scope: str | None) -> Entry | None:
        for entry in self.entries.values():
            if entry.model != model or entry.scope != scope or len(entry.tokens) < len(tokens):
                continue
            if len(entry.tokens) > len(tokens) and not entry.trimmable:
                continue
            if self._is_prefix(tokens, entry.tokens):
                return entry
        return None

    @staticmethod
    def _is_prefix(short: np.ndarray, long: np.ndarray) -> bool:
        return len(short) <= len(long) and common_prefix(short, long) == len(short)

    def _merge_chain(self, entry: Entry, chain: list[int]) -> None:
        # A covering entry may have been advertised under a shorter chain (e.g. a
        # prompt committed before the reply extended it); it now holds more.
        if len(chain) > len(entry.chain) and chain[: len(entry.chain)] == entry.chain:
            new_keys = chain[len(entry.chain) :]
            entry.chain = list(chain)
            added = self._hold(entry.model, new_keys)
            if added:
                self._emit("insert", entry, added)

    @_synchronized
    def remove(self, entry_id: int, reason: str = "removed") -> None:
        entry = self.entries.get(entry_id)
        if entry is not None:
            self._remove(entry, reason)

    @_synchronized
    def clear(self) -> None:
        for entry in list(self.entries.values()):
            self._remove(entry, "cleared")

    def _remove(self, entry: Entry, reason: str) -> None:
        del self.entries[entry.id]
        self.nbytes -= entry.nbytes
        if reason == "evicted":
            self.evictions += 1
        self._emit("evict", entry, self._release(entry.model, entry.chain), reason)

    def _enforce_budget(self, keep: int) -> None:
        while (self.nbytes > self.budget_bytes or len(self.entries) > self.max_entries) and len(
            self.entries
        ) > 1:
            oldest = next(iter(self.entries.values()))
            if oldest.id == keep:
                break
            self._remove(oldest, "evicted")

    def _hold(self, model: str, keys: list[int]) -> list[int]:
        refs = self._key_refs.setdefault(model, Counter())
        added = [k for k in keys if refs[k] == 0]
        refs.update(keys)
        return added

    def _release(self, model: str, keys: list[int]) -> list[int]:
        refs = self._key_refs.get(model, Counter())
        released = []
        for k in keys:
            refs[k] -= 1
            if refs[k] <= 0:
                del refs[k]
                released.append(k)
        return released

    def _emit(self, kind: str, entry: Entry, keys: list[int], reason: str = "") -> None:
        event = Event(kind, entry.model, entry.id, keys, entry.nbytes, reason)
        for listener in self.listeners:
            listener(event)

    @_synchronized
    def snapshot(self) -> dict[str, list[list[int]]]:
        """model -> chains of every entry: what a publisher re-advertises."""
        out: dict[str, list[list[int]]] = {}
        for entry in self.entries.values():
            if entry.chain:
                out.setdefault(entry.model, []).append(list(entry.chain))
        return out


    @_synchronized
    def stats(self) -> dict:
        return {
            "entries": len(self.entries),
            "bytes": self.nbytes,
            "budget_bytes": self.budget_bytes,
            "evictions": self.evictions,
        }

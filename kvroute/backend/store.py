"""The prompt-cache store: committed caches keyed by the tokens they hold.

Only the engine thread calls into the store (DESIGN invariant 1); listeners it
notifies must therefore hand work off (e.g. to an asyncio loop) rather than block.

An entry is one model state: per layer, whatever mlx-lm's cache for that layer
holds (`KVCache` keys/values, a sliding window's `RotatingKVCache`, the recurrent
state of an `ArraysCache`, a `CacheList` of those). Two kinds matter here:

- *trimmable* entries (every layer can drop its newest tokens: full attention)
  serve any prefix of their tokens, so one entry per conversation suffices and
  an entry that extends another supersedes it;
- *non-trimmable* entries (a window that has rotated, a recurrent state) serve
  only prompts that extend all of their tokens. The engine stores them as
  checkpoints at chosen positions (see `engine.py`), and they never supersede.

Entries keep their full-attention layers as shared token blocks (paged.py): a
prefix many conversations share is held once, and the byte budget counts each
block once. Layers that cannot be cut stay whole in their entry.

- `lookup` finds the entry sharing the longest usable prefix with a prompt and
  returns a private copy holding exactly that prefix, assembled from its blocks;
- `insert` commits an entry, dropping entries it makes redundant;
- a byte budget is enforced by LRU eviction, from the least recently used entry's
  tail inward, block by block: a block other entries still use is never freed,
  so a shared head outlives the tails that use it (an entry cut back to a block
  another entry passes through is covered by that entry, and removed);
- an entry larger than the whole budget is still committed (`commit`): RAM keeps
  the longest prefix of it that fits, where its cache can be cut (never more than
  what the budget holds), and the whole goes to `overflow` (the disk tier) when
  one is set. What is kept nowhere is refused, and the caller is told why;
- every insert and eviction is an `Event` for listeners (the registry publisher),
  with the prefix keys that became held or released by this store as a whole.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import (
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    can_trim_prompt_cache,
    trim_prompt_cache,
)

from .paged import BLOCK_TOKENS, Paged, Pool, for_disk, page, private_copy, release, root_key

# Layer caches that can always drop their newest tokens, whatever they hold.
_ALWAYS_TRIMMABLE = (KVCache, QuantizedKVCache, ConcatenateKVCache, ChunkedKVCache)


@dataclass(eq=False)
class Entry:
    id: int
    model: str
    tokens: np.ndarray  # int32, exactly the tokens whose KV `cache` holds
    state: Paged | None  # its blocks and own layers (None: a whole kept unpaged, in `raw`)
    nbytes: int  # what it would hold alone, unshared
    exit_path: str  # why it was committed: checkpoint, finish, disconnect_prefill, ...
    # Prefix keys advertised for it: its own chain, plus the keys of entries it
    # superseded (it holds their tokens too, so routing should still find it).
    chain: list[int] = field(default_factory=list)
    scope: str | None = None  # cache scope (tenant): entries never serve another scope
    trimmable: bool = True  # whether it can serve a prefix of its tokens (see module doc)
    created: float = field(default_factory=time.time)
    hits: int = 0
    # The id of the whole entry this one is a prefix of, when that whole went to the
    # disk tier (over the RAM budget): the disk need not write this part again.
    part_of: int | None = None
    raw: list[Any] | None = None  # the whole state of an entry handed to the disk whole
    # Token position -> keys its first tokens are advertised under: what it still
    # advertises once eviction cuts it shorter.
    depths: dict[int, list[int]] = field(default_factory=dict)
    # For the disk writer (`for_disk`): the blocks its first tokens are in, written
    # apart and once; `raw` then holds the rest of its state.
    shared: list[Any] = field(default_factory=list)

    @property
    def cache(self) -> list[Any]:
        """Its whole state as mlx-lm caches, assembled from its blocks: a private copy
        (engine thread: it runs MLX)."""
        return self.raw if self.raw is not None else self.state.assemble()

    def for_disk(self) -> "Entry":
        """A copy for the disk writer (another thread: it must find every array
        evaluated, as a graph recorded here cannot run there): its shared blocks in
        `shared`, the rest of its state in `raw` (paged.for_disk); where blocks are
        stored quantized, its whole state assembled and evaluated here."""
        shared: list[Any] = []
        if self.raw is not None:
            cache = self.raw
        else:
            parts = for_disk(self.state)
            if parts is None:
                cache = self.cache
                mx.eval([c.state for c in cache])
            else:
                cache, shared = parts
        return dataclasses.replace(self, tokens=self.tokens.copy(), chain=list(self.chain),
                                   raw=cache, state=None, depths=dict(self.depths), shared=shared)


@dataclass
class Event:
    kind: str  # "insert" or "evict"
    model: str
    entry_id: int
    keys: list[int]  # keys this store newly holds (insert) or no longer holds (evict)
    nbytes: int
    reason: str = ""
    entry: Entry | None = None  # the entry itself, for listeners that persist it (the disk tier)
    # Reason "trimmed": eviction cut the entry shorter and it stays; what it was before.
    before: Entry | None = None


@dataclass
class Hit:
    """What `lookup` found: a private cache holding the prompt's first `tokens`."""

    tokens: int
    cache: list[Any] | None
    entry_id: int | None = None


@dataclass
class Commit:
    """What `Store.commit` did with one committed state."""

    tokens: int  # tokens of the committed state
    nbytes: int  # its bytes
    kept: int  # tokens RAM holds of it: all, a prefix (over the budget), or 0
    entry: Entry | None = None  # the RAM entry made for it (None: covered, or none kept)
    over_budget: bool = False  # larger than the whole RAM budget
    disk_refused: str = ""  # over the budget: why the overflow did not take the whole

    @property
    def on_disk(self) -> bool:
        """The whole went to the overflow (the disk tier)."""
        return self.over_budget and not self.disk_refused

    @property
    def refused(self) -> str:
        """Why it is kept nowhere; "" when RAM or the disk keeps it."""
        return self.disk_refused if self.over_budget and not self.kept else ""


def cache_nbytes(cache: list[Any]) -> int:
    return sum(c.nbytes for c in cache)


def _layer_offset(layer: Any) -> int | None:
    # `offset` counts every token a layer has seen, also past a sliding window
    # (where `size()` stops at the window). Recurrent states keep no count.
    if isinstance(layer, CacheList):
        known = [o for o in map(_layer_offset, layer.caches) if o is not None]
        return max(known) if known else None
    offset = getattr(layer, "offset", None)
    return offset if isinstance(offset, int) else None


def held_tokens(cache: list[Any]) -> int | None:
    """How many tokens a per-model cache has seen, from the layers that count
    them; None when no layer does (a pure recurrent model). Layers that disagree
    mean the state is torn (e.g. a step failed half-way): -1."""
    known = {o for o in map(_layer_offset, cache) if o is not None}
    if not known:
        return None
    return known.pop() if len(known) == 1 else -1


def always_trimmable(cache: list[Any]) -> bool:
    """Whether every layer can drop tokens however many it holds: then one entry
    serves all its prefixes and no checkpoints are needed."""
    def ok(layer: Any) -> bool:
        if isinstance(layer, CacheList):
            return all(map(ok, layer.caches))
        return isinstance(layer, _ALWAYS_TRIMMABLE)
    return all(map(ok, cache))


def trimmed_copy(cache: list[Any], excess: int) -> list[Any]:
    """A private copy of `cache` without its newest `excess` tokens."""
    view = private_copy(cache)
    if excess:
        trim_prompt_cache(view, excess)
    return view


def _cut(value: Any, n: int) -> Any:
    # The first n tokens (axis 2 of a [batch, heads, tokens, dim] array) in a buffer of
    # their own: a slice would keep the whole state's buffer alive (mx.array copies).
    if isinstance(value, (tuple, list)):  # a quantized cache's (data, scales, biases)
        return type(value)(_cut(v, n) for v in value)
    return mx.array(value[..., :n, :])


def prefix_cache(cache: list[Any], n: int) -> list[Any] | None:
    """A copy of `cache` holding only its first `n` tokens, in arrays of its own, so
    that it costs only what those tokens cost; None where some layer cannot be cut
    (a rotated window, a recurrent state, a layout this code does not know)."""
    def cut(layer: Any) -> Any | None:
        if isinstance(layer, CacheList):
            parts = [cut(c) for c in layer.caches]
            return None if any(p is None for p in parts) else CacheList(*parts)
        kind = type(layer)
        keys = getattr(layer, "keys", None)
        if keys is None or getattr(layer, "offset", None) is None or layer.offset < n:
            return None
        if kind in (KVCache, ConcatenateKVCache, QuantizedKVCache):
            new = copy.copy(layer)
        elif kind is RotatingKVCache and layer.offset < layer.max_size and layer._idx == layer.offset:
            new = copy.copy(layer)  # a window that has not rotated: its tokens in order
            new._idx = n
        else:
            return None
        new.keys, new.values, new.offset = _cut(layer.keys, n), _cut(layer.values, n), n
        return new
    out = [cut(layer) for layer in cache]
    return None if any(layer is None for layer in out) else out


def _plain_kv(layer: Any) -> bool:
    # mlx-lm's KVCache or a subclass that only changes how it grows (the engine's).
    return isinstance(layer, KVCache) and not isinstance(layer, ChunkedKVCache) and layer.keys is not None


def _first(cache: list[Any], n: int) -> list[Any]:
    """A hot copy as a hit of its first `n` tokens: views, no copy."""
    for layer in cache:
        if n < layer.offset:
            layer.keys, layer.values = layer.keys[..., :n, :], layer.values[..., :n, :]
            layer.offset = n
    return cache


# Lookups compare a prompt with every entry and record, most of which part from it
# within a few tokens: the head alone settles those without comparing (and allocating)
# the whole of a 30k-token prompt.
_HEAD = 64


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    head = min(n, _HEAD)
    diff = np.flatnonzero(a[:head] != b[:head])
    if len(diff):
        return int(diff[0])
    diff = np.flatnonzero(a[head:n] != b[head:n])
    return head + int(diff[0]) if len(diff) else n


def usable_prefix(item: Any, model: str, scope: str | None, prompt: np.ndarray) -> int:
    """How many of `prompt`'s tokens a store entry or disk record can serve: none for
    another model or scope, none when it holds more than it shares and cannot be
    trimmed, and never the prompt's last token (it must run through the model)."""
    if item.model != model or item.scope != scope:
        return 0
    n = min(common_prefix(item.tokens, prompt), len(prompt) - 1)
    return 0 if n < len(item.tokens) and not item.trimmable else n


def _synchronized(method: Callable) -> Callable:
    @functools.wraps(method)
    def wrapper(self: "Store", *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)

    return wrapper


class Store:
    def __init__(self, budget_bytes: int, max_entries: int = 256, quantization: int = 0):
        self.budget_bytes = budget_bytes
        self.max_entries = max_entries
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # LRU order, oldest first
        # The blocks every entry's full-attention layers are kept in; quantized to
        # `quantization` bits (8, 4) when set: opt-in, a hit is then not exact.
        self.pool = Pool(bits=quantization)
        self.own_bytes = 0  # what entries hold alone: tails, layers kept whole
        self.evictions = 0
        self.blocks_evicted = 0
        # Entry id -> a contiguous copy of its whole state, kept in the budget's free
        # room for its conversation's next turn (`keep_hot`): used once, dropped first.
        self.hot: OrderedDict[int, tuple[list[Any], int]] = OrderedDict()  # (copy, its bytes)
        self.hot_bytes = 0
        self.hot_hits = 0
        self.listeners: list[Callable[[Event], None]] = []
        # Where an entry over the budget goes whole (the disk tier: engine thread, it
        # only enqueues): "" when it took the entry, else why not.
        self.overflow: Callable[[Entry], str] | None = None
        # Bytes evicted entries still hold elsewhere (the disk tier's queued writes):
        # counted in the budget, which bounds the memory the cache takes, not just
        # what this store holds.
        self.pinned: Callable[[], int] = lambda: 0
        self._ids = itertools.count(1)
        self._key_refs: dict[str, Counter] = {}
        # Entries change on the engine thread; `snapshot` and `stats` are read from
        # the event loop, so both sides take this lock.
        self.lock = threading.RLock()

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def nbytes(self) -> int:
        """Bytes held: each block once, plus what entries hold alone."""
        return self.pool.nbytes + self.own_bytes

    @_synchronized
    def lookup(self, model: str, tokens: list[int] | np.ndarray, scope: str | None = None) -> Hit:
        """The longest cached prefix of `tokens` that leaves at least one token to
        process (a prompt's last token must run through the model to give logits)."""
        prompt = np.asarray(tokens, dtype=np.int32)
        best: tuple[int, Entry] | None = None
        for entry in self.entries.values():
            n = usable_prefix(entry, model, scope, prompt)
            if n > 0 and (best is None or n > best[0]):
                best = (n, entry)
        if best is None:
            return Hit(0, None)
        n, entry = best
        entry.hits += 1
        self.entries.move_to_end(entry.id)
        hot = self._take_hot(entry.id)
        if hot is not None:
            self.hot_hits += 1
            return Hit(n, _first(hot, n), entry.id)
        return Hit(n, entry.state.assemble(n), entry.id)

    @_synchronized
    def keep_hot(self, entry: Entry, cache: list[Any]) -> bool:
        """Keep a contiguous copy of `cache` (holding exactly `entry`'s tokens) for the
        entry's next hit, while the budget has room for it beside every entry. A hit
        then skips assembling the entry from its blocks: on an H200 a 31k-token
        conversation is ~980 blocks, whose concatenation took ~25 ms of a ~100 ms
        turn. Full-attention layers only (their copy is their keys and values); not
        where blocks are stored quantized (a hit must answer as every hit does)."""
        if (self.entries.get(entry.id) is not entry or entry.state is None or self.pool.bits
                or not entry.trimmable or held_tokens(cache) != len(entry.tokens)
                or not all(_plain_kv(layer) for layer in cache)):
            return False
        self._drop_hot(entry.id)
        copy = []  # lazy until evaluated: its size is known before any memory is taken
        for layer in cache:
            new = KVCache()
            new.keys, new.values = (mx.array(x[..., :layer.offset, :]) for x in (layer.keys, layer.values))
            new.offset = layer.offset
            copy.append(new)
        # The copy's own size: a working cache's buffers run past its tokens.
        nbytes = cache_nbytes(copy)
        if self._counted() + nbytes > self.budget_bytes:
            return False
        mx.async_eval([x for c in copy for x in (c.keys, c.values)])  # the copy runs behind
        self.hot[entry.id] = (copy, nbytes)
        self.hot_bytes += nbytes
        return True

    def _take_hot(self, entry_id: int) -> list[Any] | None:
        cache, nbytes = self.hot.pop(entry_id, (None, 0))
        self.hot_bytes -= nbytes
        return cache

    def drop_hot(self) -> None:
        """Every finished turn's copy goes (the device is short of memory)."""
        while self.hot:
            self._drop_hot(next(iter(self.hot)))

    def _drop_hot(self, entry_id: int) -> None:
        self._take_hot(entry_id)

    @_synchronized
    def advertises(self, model: str, keys: list[int]) -> bool:
        """Whether an entry is advertised by any of `keys`: the disk tier asks before
        a prompt's tokens are known (`DiskTier.read_early`)."""
        refs = self._key_refs.get(model)
        return bool(refs) and any(k in refs for k in keys)

    @_synchronized
    def depth(self, model: str, tokens: list[int] | np.ndarray, scope: str | None = None) -> int:
        """How many tokens `lookup` would find now, without touching LRU order or hits."""
        prompt = np.asarray(tokens, dtype=np.int32)
        best = 0
        for entry in self.entries.values():
            if entry.model == model and entry.scope == scope:
                n = min(common_prefix(entry.tokens, prompt), len(prompt) - 1)
                if n == len(entry.tokens) or entry.trimmable:
                    best = max(best, n)
        return best

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
        """Commit `cache`, which must hold exactly `tokens`. Returns the new RAM entry
        (a prefix of it when it is over the budget), or None when an existing entry
        already covers it (that one is refreshed) or RAM keeps none of it."""
        return self.commit(model, tokens, cache, exit_path, chain, scope).entry

    @_synchronized
    def commit(
        self,
        model: str,
        tokens: list[int] | np.ndarray,
        cache: list[Any],
        exit_path: str,
        chain: list[int] | None = None,
        scope: str | None = None,
        prefix_chains: dict[int, list[int]] | None = None,
    ) -> Commit:
        """`insert`, telling what was kept where. `chain` is the prefix keys of all of
        `tokens`; `prefix_chains` maps a token position to the keys its first tokens
        hold: what a RAM prefix of an entry over the budget may advertise (the keys of
        the deepest position inside it; none when no position is known)."""
        tokens = np.asarray(tokens, dtype=np.int32)
        held = held_tokens(cache)
        if held is not None and held != len(tokens):
            raise ValueError(f"cache holds {held} tokens but {len(tokens)} were given")
        nbytes = cache_nbytes(cache) if len(tokens) else 0
        done = Commit(len(tokens), nbytes, kept=len(tokens))
        if len(tokens) == 0 or self._refresh_covering(model, tokens, scope, chain or []):
            return done
        depths = {p: list(k) for p, k in (prefix_chains or {}).items() if 0 < p <= len(tokens)}
        if chain:
            depths[len(tokens)] = list(chain)
        if nbytes <= self.budget_bytes:
            done.entry = self._add(self._paged(model, tokens, cache, exit_path, list(chain or []),
                                               scope, depths))
            return done
        whole = Entry(next(self._ids), model, tokens, None, nbytes, exit_path, list(chain or []),
                      scope, can_trim_prompt_cache(cache), raw=cache, depths=depths)
        return self._commit_over_budget(done, whole, prefix_chains or {})

    def _paged(self, model: str, tokens: np.ndarray, cache: list[Any], exit_path: str,
               chain: list[int], scope: str | None, depths: dict[int, list[int]],
               part_of: int | None = None) -> Entry:
        state = page(cache, tokens, root_key(model, scope), self.pool)
        self.own_bytes += state.own_bytes
        return Entry(next(self._ids), model, tokens, state, state.nbytes, exit_path, chain, scope,
                     can_trim_prompt_cache(cache), part_of=part_of, depths=depths)

    def _commit_over_budget(self, done: Commit, whole: Entry, prefix_chains: dict[int, list[int]]) -> Commit:
        """An entry larger than the whole budget: the whole to the overflow (it
        inherits the keys of the entries it extends, as `_add` does), the longest
        prefix that fits to RAM."""
        whole.chain = self._inherited(whole.chain, self._superseded_by(whole))
        done.over_budget, done.kept = True, 0
        done.disk_refused = self.overflow(whole) if self.overflow is not None else "no_disk_tier"
        part = self._fitting_prefix(whole) if whole.trimmable else None
        if part is not None:
            n, view = part
            mx.eval([c.state for c in view])
            tokens = whole.tokens[:n]
            known = [p for p in prefix_chains if 0 < p <= n]
            keys = list(prefix_chains[max(known)]) if known else []
            done.kept = n
            if not self._refresh_covering(whole.model, tokens, whole.scope, keys):
                depths = {p: list(k) for p, k in prefix_chains.items() if 0 < p <= n}
                done.entry = self._add(self._paged(
                    whole.model, tokens, view, whole.exit_path, keys, whole.scope, depths,
                    part_of=whole.id if done.on_disk else None))
        return done

    def _fitting_prefix(self, whole: Entry) -> tuple[int, list[Any]] | None:
        """The longest prefix of `whole` whose own cache fits the budget, as (tokens,
        cache); None when not even one token does or its layers cannot be cut. Views
        are lazy: their sizes come from shapes, nothing is computed before `eval`."""
        n = len(whole.tokens) - 1
        view = prefix_cache(whole.cache, n)
        size = cache_nbytes(view) if view is not None else 0
        for _ in range(8):  # a cut cache's bytes are linear in its tokens: one round
            if view is None or n <= 0:
                return None
            if size <= self.budget_bytes:
                return n, view
            n = min(n - 1, n * self.budget_bytes // size)
            view = prefix_cache(whole.cache, n)
            size = cache_nbytes(view) if view is not None else 0
        return None

    def _refresh_covering(self, model: str, tokens: np.ndarray, scope: str | None,
                          chain: list[int]) -> bool:
        covering = self._covering(model, tokens, scope)
        if covering is None:
            return False
        self.entries.move_to_end(covering.id)
        self._merge_chain(covering, chain, len(tokens))
        return True

    @staticmethod
    def _inherited(chain: list[int], superseded: list[Entry]) -> list[int]:
        return list(dict.fromkeys([*chain, *(k for old in superseded for k in old.chain)]))

    def _superseded_by(self, entry: Entry) -> list[Entry]:
        # Entries this one extends are redundant when a trimmed view of it serves them.
        return [
            old for old in self.entries.values()
            if entry.trimmable and old.model == entry.model and old.scope == entry.scope
            and self._is_prefix(old.tokens, entry.tokens)
        ]

    def _add(self, entry: Entry) -> Entry:
        # It inherits the keys of the entries it supersedes, so what routed to them
        # still finds it (and, cut shorter later, the depths those keys belong to).
        superseded = self._superseded_by(entry)
        entry.chain = self._inherited(entry.chain, superseded)
        for old in superseded:
            for p, keys in old.depths.items():
                entry.depths[p] = list(dict.fromkeys([*entry.depths.get(p, []), *keys]))
        self.entries[entry.id] = entry
        self._emit("insert", entry, self._hold(entry.model, entry.chain))
        for old in superseded:
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

    def _merge_chain(self, entry: Entry, chain: list[int], depth: int) -> None:
        # A covering entry may have been advertised under fewer keys (e.g. a
        # prompt committed before the reply extended it); it holds those tokens too.
        known = set(entry.chain)
        new_keys = [k for k in dict.fromkeys(chain) if k not in known]
        if new_keys:
            entry.chain = entry.chain + new_keys
            entry.depths[depth] = list(dict.fromkeys([*entry.depths.get(depth, []), *new_keys]))
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
        self._drop_hot(entry.id)
        if entry.state is not None:
            self.own_bytes -= entry.state.own_bytes
            release(entry.state, self.pool)
        if reason == "evicted":
            self.evictions += 1
        self._emit("evict", entry, self._release(entry.model, entry.chain), reason)

    def _counted(self, elsewhere: int | None = None) -> int:
        """What the budget counts: entries, hot copies, and what evicted entries still
        hold elsewhere (`elsewhere`, when given, in place of what they hold now)."""
        return self.nbytes + self.hot_bytes + (self.pinned() if elsewhere is None else elsewhere)

    def _over(self, elsewhere: int) -> bool:
        return (self._counted(elsewhere) > self.budget_bytes
                or len(self.entries) > self.max_entries)

    def _enforce_budget(self, keep: int) -> None:
        # An entry evicted while its disk write waits frees nothing until that write,
        # which then goes at once, is done: its bytes move from RAM's count to the
        # writer's. Counting them again here made one commit evict every entry RAM
        # held (a busy engine's writes all wait), for no memory back. So RAM fits what
        # waited elsewhere before this commit; what this eviction hands the writers is
        # the budget's only excess, and only until they have written it.
        elsewhere = self.pinned()
        while self.hot and self._counted(elsewhere) > self.budget_bytes:
            self._drop_hot(next(iter(self.hot)))  # copies go before any entry does
        while self._over(elsewhere) and len(self.entries) > 1:
            oldest = next(iter(self.entries.values()))
            if oldest.id == keep:
                break
            if len(self.entries) > self.max_entries or not self._cut_back(oldest, elsewhere):
                self._remove(oldest, "evicted")

    def _cut_back(self, entry: Entry, elsewhere: int) -> bool:
        """Free `entry`'s own tokens from its tail inward, a block at a time, until the
        budget holds (with `elsewhere` as `_enforce_budget` counts it) or it reaches a
        block another entry uses (then that entry covers what is left). False when it
        should go whole (nothing of it stays useful, or its state cannot be cut)."""
        state = entry.state
        if state is None or state.whole or not entry.trimmable or not state.slots:
            return False
        before = dataclasses.replace(entry, chain=list(entry.chain))
        while self._over(elsewhere) and state.tokens:
            if state.tokens > len(state.blocks) * BLOCK_TOKENS:
                self.own_bytes -= state.drop_tail()
            elif state.blocks[-1].refs == 1:
                self.pool.release(state.blocks.pop())
                state.tokens -= BLOCK_TOKENS
                self.blocks_evicted += 1
            else:
                break
        if not state.tokens or state.tokens == len(before.tokens) or (
                state.blocks[-1].refs > 1 and state.tokens == len(state.blocks) * BLOCK_TOKENS):
            return False  # nothing left, nothing freed, or what is left another entry holds
        self._emit_trim(entry, before)
        return True

    def _emit_trim(self, entry: Entry, before: Entry) -> None:
        self._drop_hot(entry.id)
        n = entry.state.tokens
        entry.tokens = entry.tokens[:n].copy()
        entry.nbytes = entry.state.nbytes
        entry.depths = {p: k for p, k in entry.depths.items() if p <= n}
        kept = {k for keys in entry.depths.values() for k in keys}
        entry.chain = [k for k in entry.chain if k in kept]
        dropped = [k for k in before.chain if k not in kept]
        event = Event("evict", entry.model, entry.id, self._release(entry.model, dropped),
                      before.nbytes - entry.nbytes, "trimmed", entry, before)
        for listener in self.listeners:
            listener(event)

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
        event = Event(kind, entry.model, entry.id, keys, entry.nbytes, reason, entry)
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
        unshared = sum(e.nbytes for e in self.entries.values())
        held = self.nbytes
        return {
            "entries": len(self.entries),
            "bytes": held,
            "budget_bytes": self.budget_bytes,
            "evictions": self.evictions,
            # Sharing: what the entries would hold as whole states, and how many times
            # what is held that is (1.0: nothing shared).
            "bytes_unshared": unshared,
            "sharing_ratio": round(unshared / held, 3) if held else 1.0,
            "blocks": len(self.pool.blocks),
            "block_bytes": self.pool.nbytes,
            "block_tokens": BLOCK_TOKENS,
            "quantization": self.pool.bits,
            "blocks_evicted": self.blocks_evicted,
            # Contiguous copies kept for a conversation's next turn, and hits they served.
            "hot_entries": len(self.hot),
            "hot_bytes": self.hot_bytes,
            "hot_hits": self.hot_hits,
        }

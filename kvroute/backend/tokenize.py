"""Tokenizing a rendered prompt, reusing the tokens of an earlier prompt it extends.

A conversation's next turn renders to the previous turn's prompt plus a few
messages, and tokenizing its whole text again is most of what a long cached turn
costs a backend before the model runs (a 31k-token prompt: tens of milliseconds,
where the model needs ~0.1 s on an H200). Tokenizers split a text at its special
tokens before anything else (the chat template's turn markers), and tokenize the
pieces between them apart: so the tokens of a text up to the start of a special
token are those of any longer text with the same beginning. `PrefixTokenizer`
keeps the last prompts it tokenized with where each special token starts, and
tokenizes only what follows the latest such start a new prompt shares.

A tokenizer for which that does not hold (a normaliser or pre-tokeniser that looks
across special tokens) is found before the first prompt: a conversation rendered by
the model's own chat template is tokenized whole and cut at each special token, and
one mismatch turns reuse off. The first real reuses are checked again against a
whole tokenization, in a thread of their own once the request has gone on (the check
costs what reuse saves: ~20 ms of a 31k-token turn); a mismatch there also turns it
off, with a warning.

Tokenizing runs in the Rust tokenizer's batch call, which lets go of the GIL: its
single-text `encode` holds it throughout (~20 ms for 31k tokens), which stalls the
engine thread's decoding and the event loop for as long.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger("kvroute.backend")

MIN_CHARS = 8192  # shorter texts are tokenized whole: reuse saves nothing there
KEEP = 32  # prompts remembered (a few hundred KB each for a 30k-token prompt)
VERIFY = 8  # reuses checked against a whole tokenization before trusting it
_UNFIT = ("this tokenizer does not tokenize a prompt's pieces between special tokens "
          "apart: prompts are tokenized whole%s")
# The self-check's conversation: texts that begin and end with spaces, newlines and
# non-ASCII characters next to the template's special tokens.
_PROBE = [
    {"role": "system", "content": " You are\n a helper. "},
    {"role": "user", "content": "\n\nHello  there\t"},
    {"role": "assistant", "content": "  Hi! ¿Qué tal? 你好 "},
    {"role": "user", "content": "x\n"},
]


@dataclass
class _Tokenized:
    text: str
    ids: np.ndarray  # int32
    starts: list[int]  # character offset where each special token starts, ascending
    index: list[int]  # the token index of each of those special tokens


def common_prefix_length(a: str, b: str, block: int = 4096) -> int:
    """Characters `a` and `b` share from the start: compared a block at a time (C-speed
    comparisons of short slices, so an unrelated prompt costs one), then a binary search
    within the first block that differs."""
    n = min(len(a), len(b))
    lo = 0
    while lo < n and a[lo:lo + block] == b[lo:lo + block]:
        lo += block
    if lo >= n:
        return n
    hi = min(lo + block, n)  # a[:lo] == b[:lo]; they differ before hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixTokenizer:
    def __init__(self, tokenizer: Any, keep: int = KEEP, min_chars: int = MIN_CHARS):
        self.tokenizer = tokenizer
        self.keep, self.min_chars = keep, min_chars
        self._backend = _backend_of(tokenizer)
        self._special = _special_ids(self._backend) if self._backend is not None else set()
        self._special_array = np.fromiter(self._special, dtype=np.int32)
        self.enabled = self._backend is not None and bool(self._special)
        self._recent: OrderedDict[int, _Tokenized] = OrderedDict()
        self._serial = 0
        self._verified = 0  # reuses whose check has started
        self._lock = threading.Lock()
        self._checker: ThreadPoolExecutor | None = None
        self.checks: list[Future] = []  # the checks of the first reuses (tests wait on them)
        self.reused_tokens = 0  # tokens taken from an earlier prompt, since start
        if self.enabled and not self._self_check():
            self.enabled = False
            log.warning(_UNFIT, "")

    def encode(self, text: str) -> list[int]:
        """The tokens of `text` as `tokenizer.encode(text, add_special_tokens=False)`
        gives them (what a chat template's rendering is tokenized with)."""
        if not self.enabled or len(text) < self.min_chars:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        base, j = self._best(text)
        if base is None:
            found = self._encode(text, 0)
        else:
            cut, k = base.starts[j], base.index[j]
            tail = self._encode(text[cut:], cut)
            found = _Tokenized(text, np.concatenate([base.ids[:k], tail.ids]),
                               [*base.starts[:j], *tail.starts],
                               [*base.index[:j], *(k + i for i in tail.index)])
        self._remember(found)
        if base is not None:
            self.reused_tokens += base.index[j]
            self._check_later(text, found.ids)
        return found.ids.tolist()

    def _best(self, text: str) -> tuple[_Tokenized | None, int]:
        """The remembered prompt sharing the longest beginning with `text` cut at the
        start of one of its special tokens, and which one (its index in `starts`)."""
        with self._lock:
            recent = list(self._recent.values())
        best, best_j, best_cut = None, -1, self.min_chars // 2
        for item in recent:
            shared = common_prefix_length(item.text, text)
            # The latest special token starting within what both texts share.
            j = bisect.bisect_right(item.starts, shared) - 1
            if j >= 0 and item.starts[j] > best_cut:
                best, best_j, best_cut = item, j, item.starts[j]
        return best, best_j

    def _encode(self, text: str, offset: int) -> _Tokenized:
        (enc,) = self._backend.encode_batch([text], add_special_tokens=False)  # frees the GIL
        ids = np.asarray(enc.ids, dtype=np.int32)
        at = np.flatnonzero(np.isin(ids, self._special_array)).tolist()
        return _Tokenized(text, ids, [offset + enc.token_to_chars(i)[0] for i in at], at)

    def _remember(self, item: _Tokenized) -> None:
        with self._lock:
            self._serial += 1
            self._recent[self._serial] = item
            while len(self._recent) > self.keep:
                self._recent.popitem(last=False)

    def _self_check(self) -> bool:
        """Whether a conversation rendered by the chat template tokenizes, cut at the
        start of each of its special tokens, as it does whole (True where there is
        no template to render one: the first reuses are still checked)."""
        try:
            text = self.tokenizer.apply_chat_template(_PROBE, add_generation_prompt=True,
                                                      tokenize=False)
        except Exception:
            return True
        whole = self._encode(text, 0)
        return all(
            np.array_equal(np.concatenate([whole.ids[:k], self._encode(text[cut:], cut).ids]),
                           whole.ids)
            for cut, k in zip(whole.starts, whole.index))

    def _check_later(self, text: str, ids: np.ndarray) -> None:
        with self._lock:
            if self._verified >= VERIFY:
                return
            self._verified += 1
            if self._checker is None:
                self._checker = ThreadPoolExecutor(1, thread_name_prefix="kvroute-tokcheck")
        self.checks.append(self._checker.submit(self._check, text, ids))

    def _check(self, text: str, ids: np.ndarray) -> bool:
        whole = list(self.tokenizer.encode(text, add_special_tokens=False))
        if whole == ids.tolist():
            return True
        self.enabled = False
        with self._lock:
            self._recent.clear()
        log.warning(_UNFIT, " from now on")
        return False


def _backend_of(tokenizer: Any) -> Any | None:
    """The Rust tokenizer (`tokenizers.Tokenizer`) under mlx-lm's wrapper and
    Hugging Face's fast tokenizer, which gives each token's character offsets."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(hf, "backend_tokenizer", None)
    return backend if backend is not None and hasattr(backend, "encode") else None


def _special_ids(backend: Any) -> set[int]:
    try:
        added = backend.get_added_tokens_decoder()
    except Exception:
        return set()
    return {i for i, t in added.items() if getattr(t, "special", False)}

"""Prompts tokenized from an earlier prompt they extend (backend/tokenize.py) equal a
whole tokenization, turn after turn, with the demo model's real tokenizer."""

from __future__ import annotations

import random
import threading
import time

import pytest
from mlx_lm.utils import load_tokenizer

from kvroute.backend import tokenize
from kvroute.backend.tokenize import PrefixTokenizer, common_prefix_length


@pytest.fixture(scope="module")
def tokenizer(text_model):
    return load_tokenizer(text_model)


def _words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(["ka", "lo mi", "ren", "tosa", "vel!", "nor\n", "qu'di", "pa.zu"])
                    for _ in range(n))


def _render(tokenizer, messages) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_a_growing_conversation_is_tokenized_as_whole_and_reuses_its_past(tokenizer):
    tokens = PrefixTokenizer(tokenizer, min_chars=1000)
    messages = [{"role": "system", "content": _words(1, 600)}]
    reused = []
    for turn in range(6):
        messages.append({"role": "user", "content": _words(10 + turn, 40 + 7 * turn)})
        text = _render(tokenizer, messages)
        got = tokens.encode(text)
        reused.append(tokens.reused_tokens)
        assert got == list(tokenizer.encode(text, add_special_tokens=False))
        assert got == tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                    tokenize=True)
        messages.append({"role": "assistant", "content": _words(100 + turn, 30)})
    assert tokens.enabled
    assert reused[0] == 0 and all(b > a for a, b in zip(reused, reused[1:]))


def test_texts_that_part_mid_message_or_mid_word_are_exact(tokenizer):
    tokens = PrefixTokenizer(tokenizer, min_chars=1000)
    head = [{"role": "system", "content": _words(2, 500)}, {"role": "user", "content": "hi"}]
    tokens.encode(_render(tokenizer, head))
    for other in ("hi there", "h", _words(3, 50)):  # the last message differs within itself
        text = _render(tokenizer, [head[0], {"role": "user", "content": other}])
        assert tokens.encode(text) == list(tokenizer.encode(text, add_special_tokens=False))
    system = head[0]["content"]
    text = _render(tokenizer, [{"role": "system", "content": system[:-40] + "x" + system[-39:]},
                               head[1]])
    assert tokens.encode(text) == list(tokenizer.encode(text, add_special_tokens=False))


def test_short_texts_are_tokenized_whole(tokenizer):
    tokens = PrefixTokenizer(tokenizer)
    text = _render(tokenizer, [{"role": "user", "content": "short"}])
    assert tokens.encode(text) == list(tokenizer.encode(text, add_special_tokens=False))
    assert tokens.encode(text) and tokens.reused_tokens == 0


def test_a_tokenizer_that_looks_across_special_tokens_turns_reuse_off(tokenizer):
    """A stand-in for a tokenizer whose pieces between special tokens are not
    tokenized apart (none of the families here is one): its whole tokenization
    differs from the pieces', and the check of the first reuses, which runs once the
    request has gone on, turns reuse off for the prompts after it."""
    tokens = PrefixTokenizer(tokenizer, min_chars=1000)
    messages = [{"role": "system", "content": _words(4, 500)}, {"role": "user", "content": "a"}]
    tokens.encode(_render(tokenizer, messages))
    real = tokenizer.encode

    class Shifted:
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def encode(self, text, **kw):
            return [i + 1 if i > 10 else i for i in real(text, **kw)]

    tokens.tokenizer = Shifted()
    messages.append({"role": "user", "content": "b"})
    tokens.encode(_render(tokenizer, messages))
    assert [c.result(timeout=60) for c in tokens.checks] == [False]
    assert not tokens.enabled
    messages.append({"role": "user", "content": "c"})
    text = _render(tokenizer, messages)
    assert tokens.encode(text) == Shifted().encode(text, add_special_tokens=False)
    assert tokens.reused_tokens > 0 and len(tokens.checks) == 1


def test_the_self_check_turns_reuse_off_before_the_first_prompt(tokenizer, monkeypatch):
    """A stand-in for a normaliser that prepends a space to the whole text
    (SentencePiece's Prepend, were it applied before the split at special tokens):
    a piece that starts at a special token then gains a token it lacks inside the
    whole. The self-check on a rendered conversation finds it at construction."""
    real = tokenize._backend_of(tokenizer)

    class Prepending:
        def encode_batch(self, texts, **kw):
            return real.encode_batch([" " + t for t in texts], **kw)

    assert PrefixTokenizer(tokenizer).enabled
    monkeypatch.setattr(tokenize, "_backend_of", lambda _tok: Prepending())
    specials = tokenize._special_ids(real)
    monkeypatch.setattr(tokenize, "_special_ids", lambda _backend: specials)
    tokens = PrefixTokenizer(tokenizer, min_chars=1000)
    assert not tokens.enabled
    text = _render(tokenizer, [{"role": "system", "content": _words(5, 500)},
                               {"role": "user", "content": "a"}])
    assert tokens.encode(text) == list(tokenizer.encode(text, add_special_tokens=False))


def test_tokenizing_a_long_prompt_lets_other_threads_run(tokenizer, monkeypatch):
    """The engine thread decodes while a handler tokenizes a long prompt: the Rust
    tokenizer's single-text encode would hold the GIL for all of it (tens of ms)."""
    monkeypatch.setattr(tokenize, "VERIFY", 0)  # no whole tokenization beside it
    tokens = PrefixTokenizer(tokenizer, min_chars=1000)
    text = _render(tokenizer, [{"role": "user", "content": _words(6, 40_000)}])
    ran, done = [0], threading.Event()

    def spin():
        while not done.is_set():
            ran[0] += 1
            time.sleep(0)

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        tokens.encode(text)
    finally:
        done.set()
        spinner.join()
    assert ran[0] > 30  # holding the GIL throughout, it ran about 3 times


def test_common_prefix_length():
    assert common_prefix_length("abcdef", "abcxyz") == 3
    assert common_prefix_length("abc", "abc") == 3
    assert common_prefix_length("", "abc") == 0
    assert common_prefix_length("abc", "abcdef") == 3
    assert tokenize.VERIFY > 0

"""Prompts tokenized from an earlier prompt they extend (backend/tokenize.py) equal a
whole tokenization, turn after turn, with the demo model's real tokenizer."""

from __future__ import annotations

import random

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


def test_a_tokenizer_that_looks_across_special_tokens_turns_reuse_off(tokenizer, monkeypatch):
    """A stand-in for a tokenizer whose pieces between special tokens are not
    tokenized apart (none of the families here is one): its whole tokenization
    differs from the pieces', and the check of the first reuses catches it."""
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
    text = _render(tokenizer, messages)
    assert tokens.encode(text) == Shifted().encode(text, add_special_tokens=False)
    assert not tokens.enabled


def test_common_prefix_length():
    assert common_prefix_length("abcdef", "abcxyz") == 3
    assert common_prefix_length("abc", "abc") == 3
    assert common_prefix_length("", "abc") == 0
    assert common_prefix_length("abc", "abcdef") == 3
    assert tokenize.VERIFY > 0

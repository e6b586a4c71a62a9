"""Samplers: what the batch of decoding rows shares and what each row keeps its own.

mlx-lm's generator samples the whole batch in one call only when every row's sampler
is the same object, and otherwise row by row (on the 2-core VM, 8 sampled streams
decoded ~1.4x faster with one sampler than with one a request; BENCHMARKS.md). So
unseeded requests with the same settings share one sampler, which must still draw
each row on its own; a seeded request keeps its own random stream.
"""

from __future__ import annotations

import mlx.core as mx

from kvroute.backend.requests import SamplingParams
from kvroute.backend.sampling import make_sampler

VOCAB = 1000


def uniform(rows: int) -> mx.array:
    return mx.full((rows, VOCAB), -float(mx.log(mx.array(VOCAB))))


def test_unseeded_requests_with_the_same_settings_share_one_sampler():
    a = make_sampler(SamplingParams(temperature=0.7, top_p=0.95))
    assert a is make_sampler(SamplingParams(temperature=0.7, top_p=0.95))
    assert a is not make_sampler(SamplingParams(temperature=0.8, top_p=0.95))
    assert a is not make_sampler(SamplingParams(temperature=0.7, top_p=0.95, seed=1))
    assert make_sampler(SamplingParams(temperature=0.0)) is None  # greedy: the generator's own


def test_a_shared_sampler_draws_every_row_on_its_own():
    sampler = make_sampler(SamplingParams(temperature=1.0))
    rows = sampler(uniform(64)).tolist()
    # 64 draws from 1000 equally likely tokens: a shared draw would repeat one id.
    assert len(set(rows)) > 32, rows


def test_a_shared_sampler_filters_each_row_by_its_own_distribution():
    # Row 0 favours the high ids, row 1 the low ones (but id 0: a row the filter emptied
    # would come back as id 0), both nearly flat: each filter must cut each row's own tail.
    ramp = mx.arange(VOCAB, dtype=mx.float32) / VOCAB
    low_side = mx.where(mx.arange(VOCAB) == 0, -1e9, -ramp)
    logprobs = mx.stack([ramp, low_side])
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    filters = {"top_k": ({"top_k": 3}, 3), "top_p": ({"top_p": 0.01}, 20),
               "min_p": ({"min_p": 0.999}, 3)}
    for name, (setting, kept) in filters.items():
        sampler = make_sampler(SamplingParams(temperature=1.0, **setting))
        for _ in range(20):
            high, low = sampler(logprobs).tolist()
            assert high >= VOCAB - kept and 1 <= low <= kept, (name, high, low)


def test_a_seeded_request_repeats_its_draws_whatever_else_samples():
    first = make_sampler(SamplingParams(temperature=1.0, seed=42))
    draws = [first(uniform(1)).item() for _ in range(5)]
    make_sampler(SamplingParams(temperature=1.0))(uniform(8))  # others sample meanwhile
    again = make_sampler(SamplingParams(temperature=1.0, seed=42))
    assert [again(uniform(1)).item() for _ in range(5)] == draws

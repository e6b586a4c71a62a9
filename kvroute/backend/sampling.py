"""From a request's sampling parameters to what mlx-lm's generator takes: a sampler
and logits processors."""

from __future__ import annotations

import functools
from typing import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from .requests import SamplingParams

# Below this a temperature is greedy. The sampler scales the logprobs by 1/T in the
# model's dtype: in float16 (largest 65504) the most likely token's logprob, down to
# about -ln(vocabulary) = -12, times 1/T must stay finite, so 1/T < 65504/12 and
# T > 1.8e-4; tinier ones overflow to inf (1e-39 does even in float32) and inf * 0
# is NaN: a random token. At such temperatures sampling would pick the most likely
# token anyway, but for near-exact ties.
MIN_TEMPERATURE = 2e-4


def make_sampler(params: SamplingParams) -> Callable | None:
    """None means greedy (the generator's fallback). A seeded request gets its own
    PRNG key so its samples do not depend on what else shares the batch. Unseeded
    requests with the same settings share one sampler: the generator samples the
    batch in one call when every row's sampler is the same object, and otherwise row
    by row, each row its own pass of sampling ops over the vocabulary (so one row
    unlike the others, greedy, seeded or constrained, still costs the batch that)."""
    if params.temperature < MIN_TEMPERATURE:
        return None
    settings = (params.temperature, params.top_p, params.top_k, params.min_p)
    if params.seed is None:
        return _shared_sampler(*settings)
    return _sampler(*settings, key=mx.random.key(params.seed))


@functools.lru_cache(maxsize=256, typed=True)  # bounded: clients choose the floats
def _shared_sampler(temp: float, top_p: float, top_k: int, min_p: float) -> Callable:
    return _sampler(temp, top_p, top_k, min_p, key=None)


def _sampler(temp: float, top_p: float, top_k: int, min_p: float,
             key: mx.array | None) -> Callable:
    """Samples one token id per row of logprobs; with a key, from that key's stream
    (a sampler with a key is one request's)."""

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        # mlx-lm's filters, in the order its make_sampler applies them.
        if 0 < top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        if min_p > 0:
            logprobs = apply_min_p(logprobs, min_p)
        if 0 < top_k < logprobs.shape[-1]:  # k past the vocabulary keeps every token
            logprobs = apply_top_k(logprobs, top_k)
        if key is None:
            return mx.random.categorical(logprobs * (1.0 / temp))
        key, sub = mx.random.split(key)
        return mx.random.categorical(logprobs * (1.0 / temp), key=sub)

    return sample


def make_processors(params: SamplingParams) -> list[Callable]:
    processors = make_logits_processors(
        logit_bias=params.logit_bias or None,
        presence_penalty=params.presence_penalty or None,
        frequency_penalty=params.frequency_penalty or None,
        repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1.0 else None,
        repetition_context_size=params.repetition_context_size,
    )
    if params.presence_penalty or params.frequency_penalty:
        # The penalties index the logits by the tokens seen, prompt included; an
        # image's ids are negative (image_prompt.py): they count as token 0 instead
        # of reading outside the logits.
        return [_no_image_ids(p) for p in processors]
    return processors


def _no_image_ids(processor: Callable) -> Callable:
    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        return processor(mx.maximum(tokens, 0), logits)
    return process

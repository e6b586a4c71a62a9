"""Prefill chunks after a cache hit start at multiples of the prefill step (CUDA).

On CUDA the engine cuts a prompt resumed from a cache hit (or after a checkpoint) at
the next multiple of its prefill step, so that its full chunks meet the lengths of
keys a cold prompt's chunks meet, which warm-up gave an attention plan (engine.py
`_alignments`). There is no CUDA here: the test turns the alignment on in an
in-process engine with the demo model and checks what must hold on every machine:
the chunks the generator runs, that an alignment cut commits nothing, and that the
answer is the one a cold prefill gives.
"""

from __future__ import annotations

import pytest
from mlx_lm import load
from tests.test_commit_order import run_turn

from kvroute.backend.engine import Engine
from kvroute.backend.metrics import BackendMetrics
from kvroute.backend.store import Store

STEP = 16


@pytest.fixture(scope="module")
def engine(text_model):
    model, tokenizer = load(str(text_model))
    e = Engine(model, tokenizer, "demo", Store(64 << 20), BackendMetrics("demo", "t"),
               prefill_step=STEP, max_batch=4)
    e.on_cuda = True  # the alignment only: nothing else of the CUDA path runs here
    e.start()
    yield e
    e.stop()


def test_chunks_after_a_hit_are_aligned_and_answer_as_cold(engine, monkeypatch):
    prompt = [(13 * i) % 700 + 20 for i in range(70)]
    run_turn(engine, prompt[:37], 6)  # the store now holds these 37 (and a reply)
    segments, commits = [], []
    cut, commit = Engine._segments, Store.commit
    monkeypatch.setattr(Engine, "_segments", staticmethod(
        lambda *a: segments.append(cut(*a)) or segments[-1]))
    monkeypatch.setattr(Store, "commit", lambda self, model, tokens, *a, **k:
                        commits.append(len(tokens)) or commit(self, model, tokens, *a, **k))
    text, finish = run_turn(engine, prompt, 6)
    assert finish.cached_tokens == 37
    # From the hit to the next multiple of the step, then a segment the generator cuts
    # into chunks of 16 from 48 (48 -> 64 -> 69), then the last token alone.
    assert [len(s) for s in segments[0]] == [11, 21, 1]
    assert commits[0] == 69, commits  # the alignment cut at 48 committed nothing
    engine.store.clear()
    assert run_turn(engine, prompt, 6)[0] == text  # a cold prefill answers alike


def test_cold_prompts_and_the_cpu_path_are_not_cut(engine, monkeypatch):
    assert engine._alignments(0, [], 69) == []  # a cold prompt's chunks are aligned already
    assert engine._alignments(36, [50], 69) == [48, 64]  # after the hit and the checkpoint
    assert engine._alignments(32, [], 69) == []  # a hit on a multiple needs no cut
    monkeypatch.setattr(engine, "on_cuda", False)
    assert engine._alignments(36, [], 69) == []

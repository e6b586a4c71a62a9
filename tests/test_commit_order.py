"""Commits are made after the tokens of the step that called for them have gone out,
never later than anything that could use them.

The commit of a long conversation's state takes ~10 ms on a GPU (its new blocks, its
keys, the store's bookkeeping); taken in the step that ends the prompt, it delayed
every first token by that much. The engine now takes the state there and commits it
once the first token has been handed to the event loop; a finished reply's commit
likewise comes after its last token, and the request's end after that commit. An
in-process engine with the demo model: the order of what it hands out and what it
commits, and that a request admitted meanwhile (the second choice of n=2) still
finds the prompt.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from mlx_lm import load

from kvroute.backend.engine import Engine
from kvroute.backend.jobs import Delta, Finish, Job
from kvroute.backend.metrics import BackendMetrics
from kvroute.backend.requests import SamplingParams
from kvroute.backend.store import Store


@pytest.fixture(scope="module")
def engine(text_model):
    model, tokenizer = load(str(text_model))
    e = Engine(model, tokenizer, "demo", Store(64 << 20), BackendMetrics("demo", "t"),
               prefill_step=16, max_batch=4)
    e.start()
    yield e
    e.stop()


def _job(prompt: list[int], max_tokens: int, loop, after: Job | None = None) -> Job:
    return Job(prompt=prompt, params=SamplingParams(temperature=0.0), max_tokens=max_tokens,
               tools=None, loop=loop, events=asyncio.Queue(), after=after,
               checkpoints={len(prompt) - 1: [len(prompt)]})


async def _answer(job: Job) -> tuple[str, Finish]:
    text = []
    while True:
        event = await job.events.get()
        if isinstance(event, Delta):
            text.append(event.text)
        else:
            assert isinstance(event, Finish), event
            return "".join(text), event


def run_turn(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[str, Finish]:
    """One request through `engine`, greedy: its text and its end."""
    async def go():
        job = _job(prompt, max_tokens, asyncio.get_running_loop())
        engine.submit(job)
        return await _answer(job)
    return asyncio.run(go())


def _record(engine: Engine, monkeypatch) -> list[tuple]:
    order: list[tuple] = []
    flush, commit = engine._flush, Store.commit

    def recorded_flush():
        sent = [type(e).__name__ for _, e in engine._outbox]
        if sent:
            order.append(("sent", *sent))
        flush()

    def recorded_commit(self, model, tokens, cache, path, *a, **k):
        order.append(("commit", path, len(tokens)))
        return commit(self, model, tokens, cache, path, *a, **k)

    monkeypatch.setattr(engine, "_flush", recorded_flush)
    monkeypatch.setattr(Store, "commit", recorded_commit)
    return order


def test_the_prompt_is_committed_after_its_first_token_is_sent(engine, monkeypatch):
    prompt = [(7 * i) % 500 + 30 for i in range(45)]
    order = _record(engine, monkeypatch)

    text, finish = run_turn(engine, prompt, 4)
    assert finish.completion_tokens == 4
    commits = [o for o in order if o[0] == "commit"]
    assert commits[0] == ("commit", "checkpoint", len(prompt) - 1), order
    assert commits[-1][1] == "finish", order
    first_sent = next(i for i, o in enumerate(order) if o[0] == "sent" and "Delta" in o)
    assert first_sent < order.index(commits[0]), order
    # What was committed is the prompt: its repeat starts from it and answers alike.
    engine.store.clear()  # (the finish entry would serve it too)
    order.clear()

    async def twice():
        loop = asyncio.get_running_loop()
        first = _job(prompt, 4, loop)
        engine.submit(first)
        await first.events.get()  # its first token: the prompt's state is committed next
        second = _job(prompt, 4, loop)
        engine.submit(second)
        return await _answer(second)

    again, finish = asyncio.run(twice())
    assert finish.cached_tokens == len(prompt) - 1
    assert again == text


def test_a_second_choice_admitted_before_the_first_token_finds_the_prompt(engine, monkeypatch):
    # Choice 2 waits only for choice 1's prefill to end, which comes two generator
    # steps before choice 1's first token: its admission commits the state first.
    prompt = [(11 * i) % 600 + 25 for i in range(40)]
    order = _record(engine, monkeypatch)

    async def go():
        loop = asyncio.get_running_loop()
        first = _job(prompt, 3, loop)
        second = _job(prompt, 3, loop, after=first)
        engine.submit(first)
        engine.submit(second)
        return await asyncio.gather(_answer(first), _answer(second))

    (text1, finish1), (text2, finish2) = asyncio.run(go())
    assert finish1.cached_tokens == 0
    assert finish2.cached_tokens == len(prompt) - 1, order
    assert text2 == text1
    assert [o for o in order if o[0] == "commit"][0] == ("commit", "checkpoint", len(prompt) - 1)


def test_a_one_token_reply_goes_out_before_its_commits_and_ends_after_them(engine, monkeypatch):
    prompt = [(5 * i) % 400 + 40 for i in range(33)]
    order = _record(engine, monkeypatch)

    _, finish = run_turn(engine, prompt, 1)
    assert finish.completion_tokens == 1
    token = next(i for i, o in enumerate(order) if o[0] == "sent" and "Delta" in o)
    commits = [i for i, o in enumerate(order) if o[0] == "commit"]
    end = next(i for i, o in enumerate(order) if o[0] == "sent" and "Finish" in o)
    assert [order[i][1] for i in commits] == ["checkpoint", "finish"], order
    assert token < commits[0] and commits[-1] < end, order
    # The next turn, sent on the end, finds prompt and reply.
    assert engine.store.depth("demo", prompt + [1, 2]) >= len(prompt)


def test_the_engine_says_whether_a_request_waits_for_its_first_token(engine):
    """What the disk writer asks before a paced write's next file: true while a request
    is queued or its prompt prefilled, false once its first token is out (decoding) and
    when the engine is idle. `answering` (the writer's own hold-off) stays true until
    the handler has written that token's chunk to the client (it marks `first_out_at`)."""
    prompt = [(3 * i) % 300 + 50 for i in range(40)]

    async def go() -> list[tuple[bool, bool]]:
        loop = asyncio.get_running_loop()
        seen = [(engine.prefilling, engine.answering)]
        release = asyncio.Event()
        held = asyncio.ensure_future(engine.call(lambda: asyncio.run_coroutine_threadsafe(
            release.wait(), loop).result(30)))  # the engine thread busy with something else
        job = _job(prompt, 8, loop)
        engine.submit(job)
        seen.append((engine.prefilling, engine.answering))  # queued behind it
        release.set()
        await held
        first = await job.events.get()
        assert isinstance(first, Delta) and first.text
        seen.append((engine.prefilling, engine.answering))  # out of the engine, not sent
        job.first_out_at = time.perf_counter()  # what the handler does once it is written
        seen.append((engine.prefilling, engine.answering))  # decoding
        await _answer(job)
        seen.append((engine.prefilling, engine.answering))
        return seen

    assert asyncio.run(go()) == [(False, False), (True, True), (False, True), (False, False),
                                 (False, False)]

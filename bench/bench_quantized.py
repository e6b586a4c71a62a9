"""Quantized prompt-cache storage (`cache_quantization`): how far a hit strays from a
cold prefill, per model family.

In process, no HTTP: for each family's tiny random-weight model (and the demo model),
a chat prompt is prefilled cold and decoded greedily for `--tokens` tokens; then the
prompt minus its last token is committed to a store with `cache_quantization` = 0, 8
and 4 bits, looked up (a hit to the last token but one, as the engine makes it), and
decoded the same way. Reported: the largest |logprob difference| of the cold path's
own tokens (teacher-forced: the hit scores the cold path's tokens), and greedy-token
agreement: the share of the N free-running greedy tokens equal to the cold ones.

    python -m bench.bench_quantized --tokens 32
"""

from __future__ import annotations

import argparse
import os
import platform

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
from rich.console import Console
from rich.table import Table

from bench.command import command_line
from kvroute.backend.store import Store
from kvroute.devtools import arch_models, demo_model

SYSTEM = ("You are the release assistant of a small team. Answer in short sentences, cite the "
          "ticket number when there is one, never invent a version. ") * 4


def prompt_ids(tokenizer) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Which ticket blocks the Thursday release?"}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def log_probs(model, tokens: list[int], cache) -> mx.array:
    logits = model(mx.array(tokens)[None], cache=cache)[0, -1].astype(mx.float32)
    return logits - mx.logsumexp(logits)


def greedy(model, cache, first: mx.array, n: int, forced: list[int] | None = None):
    """n greedy tokens from `first` (the log-probs after the prompt); with `forced`, the
    forced tokens are fed instead and their log-probs returned."""
    out, scores, lp = [], [], first
    for i in range(n):
        token = int(mx.argmax(lp).item())
        out.append(token)
        fed = forced[i] if forced is not None else token
        scores.append(float(lp[fed].item()))
        lp = log_probs(model, [fed], cache)
    return out, scores


def measure(path: str, bits: int, n: int) -> tuple[float, float, int, int]:
    model, tokenizer = load(path)
    ids = prompt_ids(tokenizer)
    cold = make_prompt_cache(model)
    cold_tokens, cold_scores = greedy(model, cold, log_probs(model, ids, cold), n)

    store = Store(1 << 34, quantization=bits)
    part = make_prompt_cache(model)
    model(mx.array(ids[:-1])[None], cache=part)
    mx.eval([c.state for c in part])
    store.insert("m", ids[:-1], part, "checkpoint")
    hit = store.lookup("m", ids)
    assert hit.tokens == len(ids) - 1, hit.tokens
    state = [c for c in hit.cache]
    _, forced_scores = greedy(model, state, log_probs(model, ids[-1:], state), n, cold_tokens)

    hit = store.lookup("m", ids)
    state = hit.cache
    free_tokens, _ = greedy(model, state, log_probs(model, ids[-1:], state), n)
    delta = max(abs(a - b) for a, b in zip(cold_scores, forced_scores))
    agree = sum(a == b for a, b in zip(cold_tokens, free_tokens)) / n
    return delta, agree, store.nbytes, store.stats()["bytes_unshared"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--families", default=",".join(["demo", *arch_models.ARCHES]))
    args = ap.parse_args()
    console = Console(width=160)
    console.print(f"{command_line()} · {platform.machine()}, {os.cpu_count()} cores, "
                  f"mlx {mx.__version__}")
    table = Table(title=f"a hit from quantized blocks vs a cold prefill, {args.tokens} greedy tokens")
    for col in ("family", "bits", "max |Δ logprob|", "greedy agreement", "store bytes"):
        table.add_column(col, justify="right")
    for family in args.families.split(","):
        path = str(demo_model.ensure("text") if family == "demo" else arch_models.ensure(family))
        for bits in (0, 8, 4):
            delta, agree, held, _ = measure(path, bits, args.tokens)
            table.add_row(family, str(bits) if bits else "exact", f"{delta:.2e}", f"{agree:.2f}",
                          f"{held:,}")
    console.print(table)


if __name__ == "__main__":
    main()

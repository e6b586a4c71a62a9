"""What constrained decoding costs: compile time per schema, mask time per token, a
batch's masks filled together, and decode tokens/s of a batch of 8 with 0, 4 and 8
constrained rows (kvroute/backend/grammar.py, llguidance).

Mask times replay a valid answer of each schema through a fresh matcher: the first
pass (llguidance builds its lexer states as it meets them) and the steady state (the
per-token minimum over --repeat passes of further matchers of the same compiled
grammar, as later requests with that schema see it). They are measured on the demo
model's tokenizer and, with --vocab N (default 150000, 0 to skip), on a byte-level
BPE tokenizer of about N tokens trained here on this Python's own sources, the size
of Qwen's. The decode rate runs the demo model through mlx-lm's BatchGenerator.

    python -m bench.bench_grammar [--vocab 150000] [--repeat 5] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import BatchGenerator
from mlx_lm.tokenizer_utils import load as load_tokenizer
from rich.console import Console
from rich.table import Table
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from kvroute.backend import grammar
from kvroute.devtools import demo_model

# Schemas as applications send them, each with an answer a model might give.
CASES: dict[str, tuple[dict, dict]] = {
    "classification": (
        {"type": "object", "properties": {"label": {"enum": ["spam", "ham", "unsure"]},
                                          "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
         "required": ["label", "confidence"], "additionalProperties": False},
        {"label": "ham", "confidence": 0.93}),
    "extraction": (
        {"type": "object", "properties": {
            "name": {"type": "string"}, "email": {"type": "string", "format": "email"},
            "joined": {"type": "string", "format": "date-time"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 5}},
         "required": ["name", "email", "joined", "tags"], "additionalProperties": False},
        {"name": "Ada Lovelace", "email": "ada@example.com", "joined": "2024-05-01T12:30:00Z",
         "tags": ["math", "engines"]}),
    "agent_plan": (
        {"$defs": {"Step": {"type": "object", "properties": {
            "tool": {"enum": ["search", "read", "write"]}, "input": {"type": "string"},
            "why": {"type": "string", "maxLength": 80}},
            "required": ["tool", "input", "why"], "additionalProperties": False}},
         "type": "object", "properties": {"steps": {"type": "array", "items": {"$ref": "#/$defs/Step"},
                                                    "minItems": 1, "maxItems": 6},
                                          "done": {"type": "boolean"}},
         "required": ["steps", "done"], "additionalProperties": False},
        {"steps": [{"tool": "search", "input": "kv cache routing", "why": "find prior art"},
                   {"tool": "read", "input": "DESIGN.md", "why": "learn the invariants"}], "done": False}),
    "invoice": (
        {"type": "object", "properties": {
            "id": {"type": "string", "pattern": "^INV-[0-9]{6}$"},
            "lines": {"type": "array", "items": {"type": "object", "properties": {
                "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
                "price": {"type": "number", "exclusiveMinimum": 0}},
                "required": ["sku", "qty", "price"], "additionalProperties": False}},
            "currency": {"const": "EUR"},
            "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
         "required": ["id", "lines", "currency", "note"], "additionalProperties": False},
        {"id": "INV-004217", "lines": [{"sku": "A-1", "qty": 2, "price": 9.5},
                                       {"sku": "B-7", "qty": 1, "price": 120}],
         "currency": "EUR", "note": None}),
    "json_object": (None, {"title": "Report", "items": [1, 2, {"nested": [True, None, "text"]}]}),
}


def spec(schema: dict | None) -> grammar.GrammarSpec:
    return grammar.json_object() if schema is None else grammar.json_schema(schema)


def big_tokenizer(vocab: int, out: Path) -> Path:
    """A byte-level BPE tokenizer of about `vocab` tokens, trained on this Python's
    sources (with the demo model's pre-tokenizer, special tokens and template)."""
    files = sorted(Path(sys.prefix).rglob("*.py")) + sorted(Path(sys.base_prefix).rglob("*.py"))

    def texts():
        for f in dict.fromkeys(files):
            try:
                yield f.read_text(encoding="utf-8", errors="ignore")
            except OSError:
                continue

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, min_frequency=2, show_progress=False,
        special_tokens=[AddedToken(t, special=True) for t in demo_model.SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t in (demo_model.TOOL_CALL_START, demo_model.TOOL_CALL_END)])
    out.mkdir(parents=True, exist_ok=True)
    demo_model.write_tokenizer(out, tok)
    return out


def replay(g: grammar.Grammar, tokens: list[int]) -> list[float]:
    """Seconds per mask along `tokens` (then end-of-sequence), on a fresh matcher."""
    m = g.matcher()
    times = []
    for t in tokens:
        t0 = time.perf_counter()
        m.allowed()
        times.append(time.perf_counter() - t0)
        if not m.advance(t):
            raise RuntimeError(f"the answer does not fit the grammar: {m.error}")
    t0 = time.perf_counter()
    m.allowed()
    times.append(time.perf_counter() - t0)
    return times


def ms(x: float) -> str:
    return f"{x * 1e3:.3f}"


def mask_table(console: Console, tok, vocab_size: int, repeat: int, label: str) -> None:
    t0 = time.perf_counter()
    grammars = grammar.Grammars(tok, vocab_size)
    setup = time.perf_counter() - t0
    table = Table(title=f"{label}: {vocab_size:,} logits (tokenizer set up in {setup:.2f} s)")
    for col in ("schema", "compile ms", "tokens", "first pass ms/token", "steady ms/token",
                "steady p99 ms"):
        table.add_column(col, justify="left" if col == "schema" else "right")
    first_all, steady_all, compiled = [], [], {}
    for name, (schema, answer) in CASES.items():
        t0 = time.perf_counter()
        g = compiled[name] = grammars.compile(spec(schema))
        compile_s = time.perf_counter() - t0
        tokens = tok.encode(json.dumps(answer), add_special_tokens=False)
        first = replay(g, tokens)
        steady = [min(col) for col in zip(*(replay(g, tokens) for _ in range(repeat)))]
        first_all += first
        steady_all += steady
        table.add_row(name, ms(compile_s), str(len(first)), ms(statistics.mean(first)),
                      ms(statistics.mean(steady)), ms(sorted(steady)[int(0.99 * (len(steady) - 1))]))
    table.add_row("all", "", str(len(first_all)), ms(statistics.mean(first_all)),
                  ms(statistics.mean(steady_all)), ms(sorted(steady_all)[int(0.99 * (len(steady_all) - 1))]))
    console.print(table)
    batch_fill(console, tok, vocab_size, compiled, repeat)


def batch_fill(console: Console, tok, vocab_size: int, compiled: dict, repeat: int) -> None:
    """8 rows (the cases, repeated) stepping through their answers together: each
    row's mask in turn, against a MaskBatch filling them at once."""
    names = (list(compiled) * 2)[:8]
    answers = [tok.encode(json.dumps(CASES[n][1]), add_special_tokens=False) for n in names]
    steps = min(map(len, answers))
    batch = grammar.MaskBatch(vocab_size)
    best = {"one row at a time": float("inf"), "MaskBatch (together)": float("inf")}
    for _ in range(repeat):
        for mode in best:
            ms_ = [compiled[n].matcher(batch if mode.startswith("Mask") else None) for n in names]
            total = 0.0
            for i in range(steps):
                t0 = time.perf_counter()
                if mode.startswith("Mask"):
                    for m in ms_:
                        batch.queue(m)
                    for m in ms_:
                        batch.mask(m)
                else:
                    for m in ms_:
                        m.allowed()
                total += time.perf_counter() - t0
                for m, a in zip(ms_, answers):
                    m.advance(a[i])
            best[mode] = min(best[mode], total / steps)
    console.print("  masks of a batch of 8 rows, per step: " +
                  ", ".join(f"{k} {ms(v)} ms" for k, v in best.items()))


def decode_rates(console: Console, model_dir: Path, steps: int, repeat: int) -> None:
    """Decode tokens/s of 8 rows, 0, 4 or 8 of them constrained (masks per row, or
    filled together by a MaskBatch). The demo model counts digits forever after a
    digit, so every row, constrained to an object of integers or free, decodes all
    `steps` tokens."""
    model, tok = load(str(model_dir))
    grammars = grammar.Grammars(tok, model.args.vocab_size)
    # One required integer: once a row writes its first digit the demo model counts on
    # forever, so no row ends early and leaves a smaller batch.
    g = grammars.compile(grammar.json_schema(
        {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
         "additionalProperties": False}))
    prompt = tok.encode("Count: 1", add_special_tokens=False)
    table = Table(title=f"decode, batch of 8, {steps} steps, demo model (mlx {mx.default_device()})")
    for col in ("constrained rows", "masks", "tokens/s", "vs unconstrained"):
        table.add_column(col, justify="right")
    configs = [(0, "-"), (4, "per row"), (8, "per row"), (4, "MaskBatch"), (8, "MaskBatch")]
    rates: dict[tuple, float] = {c: 0.0 for c in configs}
    for _ in range(repeat):  # configurations interleaved, best of each: a busy machine
        for n, mode in configs:  # slows them alike rather than one of them
            batch = grammar.MaskBatch(model.args.vocab_size) if mode == "MaskBatch" else None
            ms_ = [g.matcher(batch) if i < n else None for i in range(8)]
            gen = BatchGenerator(model, stop_tokens=[[t] for t in tok.eos_token_ids],
                                 completion_batch_size=8)
            gen.insert([prompt] * 8, max_tokens=[steps + 1] * 8,
                       samplers=[m.sampler() if m is not None and batch else None for m in ms_],
                       logits_processors=[[m] if m is not None else [] for m in ms_])
            while not gen.next()[1]:  # prefill, up to the first tokens
                pass
            t0 = time.perf_counter()
            tokens = sum(len(gen.next()[1]) for _ in range(steps - 1))
            elapsed = time.perf_counter() - t0
            gen.close()
            if tokens != 8 * (steps - 1):
                raise RuntimeError(f"rows ended early: {tokens} tokens in {steps - 1} steps")
            rates[(n, mode)] = max(rates[(n, mode)], tokens / elapsed)
    base = rates[(0, "-")]
    for (n, mode), rate in rates.items():
        table.add_row(str(n), mode, f"{rate:.1f}", f"{rate / base:.2f}x")
    console.print(table)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_grammar", description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=150_000,
                    help="size of the locally trained large tokenizer (0: skip it)")
    ap.add_argument("--repeat", type=int, default=5, help="passes for the steady state")
    ap.add_argument("--steps", type=int, default=200, help="decode steps per measurement")
    args = ap.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = demo_model.ensure("text", cache_dir=Path(tmp))
        _, tok = load(str(model_dir))
        mask_table(console, tok, len(tok._tokenizer), args.repeat, "demo tokenizer")
        if args.vocab:
            t0 = time.perf_counter()
            big = load_tokenizer(big_tokenizer(args.vocab, Path(tmp) / "big"))
            console.print(f"trained a {len(big._tokenizer):,}-token tokenizer in "
                          f"{time.perf_counter() - t0:.0f} s")
            # Models pad their logits past the tokenizer (Qwen: 151,936 for 151,665).
            mask_table(console, big, -(-len(big._tokenizer) // 128) * 128, args.repeat,
                       "large tokenizer")
        decode_rates(console, model_dir, args.steps, args.repeat)


if __name__ == "__main__":
    main()

"""What constrained decoding costs: compile time per schema, mask time per token, a
batch's masks filled together, and decode tokens/s of a batch of 8 with 0, 4 and 8
constrained rows, engine-side and through the proxy (kvroute/backend/grammar.py, llguidance).

Parts (`--parts`, default all):

- masks: each schema's answer replayed through a fresh matcher: the first pass
  (llguidance builds its lexer states as it meets them) and the steady state (the
  per-token minimum over --repeat passes of further matchers of the same compiled
  grammar, as later requests with that schema see it). On the demo model's tokenizer
  and, with --vocab N (default 150000, 0 to skip the large parts), on a byte-level
  BPE tokenizer of about N tokens trained here on this Python's own sources, the
  size of Qwen's.
- demo: decode rate of the demo model (a ~3 ms step) through mlx-lm's
  BatchGenerator, the engine's path, masks per row or filled by a MaskBatch.
- vocab: the same with a model that is next to nothing but its vocabulary projection
  at the large tokenizer's size (150k logits, a step of ~27 ms on a 2-core CPU): the
  mask path's fixed cost per step at that vocabulary, the worst case.
- real: the same at real size: a random-weight model of Qwen2.5-0.5B's shape in
  float32 around the large tokenizer (bench/models.py, preset 0.5b), its rows
  constrained to `{"text": "..."}`.
- serve: what a user sees: `kvroute serve` with that model on one backend, 8
  concurrent streaming chat requests (the official client), 0, 4 or 8 of them with
  a json_schema response_format, tokens/s while all 8 decode.

Configurations are interleaved, best of the passes. The large tokenizer and the model
are built once into --cache (delete it to rebuild).

    python -m bench.bench_grammar [--parts masks,demo,vocab,real,serve] [--vocab 150000]
        [--repeat 5] [--steps 200] [--real-steps 12] [--real-repeat 2] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import openai
from mlx_lm import load
from mlx_lm.generate import BatchGenerator
from mlx_lm.tokenizer_utils import load as load_tokenizer
from rich.console import Console
from rich.table import Table
from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, trainers
from tokenizers import models as token_models

from bench import models
from bench.command import command_line, machine
from kvroute.backend import grammar
from kvroute.devtools import demo_model
from tests.harness import ServeProcess, get_json

PARTS = ("masks", "demo", "vocab", "real", "serve")

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

    tok = Tokenizer(token_models.BPE())
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


# The real-size model's schema: one free string. The grammar forces `{"text": "` (and
# bounded whitespace); the model's lm_head never picks a quote or a backslash
# (bench/models.py), so greedy decoding stays inside the string and no row ends early.
TEXT_SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
               "additionalProperties": False}
# One required integer: once a row writes its first digit the demo model counts on
# forever, so no row ends early and leaves a smaller batch.
COUNT_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                "additionalProperties": False}
DEMO_CONFIGS = [(0, "-"), (4, "per row"), (8, "per row"), (4, "MaskBatch"), (8, "MaskBatch")]
# At real size only the engine's path (a MaskBatch); one step takes seconds on a CPU.
REAL_CONFIGS = [(0, "-"), (4, "MaskBatch"), (8, "MaskBatch")]


def decode_rates(console: Console, model_dir: Path, label: str, schema: dict, prompt: str,
                 steps: int, repeat: int, configs: list[tuple[int, str]]) -> dict:
    """Decode tokens/s of 8 rows, some of them constrained to `schema` (masks per row,
    or filled together by a MaskBatch, as the engine does), through mlx-lm's
    BatchGenerator; the model must decode every row for all `steps` tokens."""
    model, tok = load(str(model_dir))
    vocab = model.args.vocab_size
    g = grammar.Grammars(tok, vocab).compile(grammar.json_schema(schema))
    ids = tok.encode(prompt, add_special_tokens=False)
    rates: dict[tuple, float] = {c: 0.0 for c in configs}
    for r in range(repeat):  # configurations interleaved, best of each: a busy machine
        for n, mode in configs:  # slows them alike rather than one of them
            batch = grammar.MaskBatch(vocab) if mode == "MaskBatch" else None
            ms_ = [g.matcher(batch) if i < n else None for i in range(8)]
            gen = BatchGenerator(model, stop_tokens=[[t] for t in tok.eos_token_ids],
                                 completion_batch_size=8)
            gen.insert([ids] * 8, max_tokens=[steps + 1] * 8,
                       samplers=[m.sampler() if m is not None and batch else None for m in ms_],
                       logits_processors=[[m] if m is not None else [] for m in ms_])
            t0 = time.perf_counter()
            while not gen.next()[1]:  # prefill, up to the first tokens
                pass
            prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            tokens = sum(len(gen.next()[1]) for _ in range(steps - 1))
            elapsed = time.perf_counter() - t0
            gen.close()
            if tokens != 8 * (steps - 1):
                raise RuntimeError(f"rows ended early: {tokens} tokens in {steps - 1} steps")
            rates[(n, mode)] = max(rates[(n, mode)], tokens / elapsed)
            print(f"  [{label}] pass {r + 1}/{repeat}, {n} constrained ({mode}): "
                  f"{tokens / elapsed:.2f} tokens/s, {elapsed / (steps - 1) * 1e3:.1f} ms a step "
                  f"(prefill {prefill:.1f} s)", flush=True)
    table = Table(title=f"decode, batch of 8, {steps} steps, {label} (mlx {mx.default_device()}, "
                        f"{vocab:,} logits), best of {repeat}")
    for col in ("constrained rows", "masks", "tokens/s", "ms a step", "vs unconstrained"):
        table.add_column(col, justify="right")
    base = rates[(0, "-")]
    for (n, mode), rate in rates.items():
        table.add_row(str(n), mode, f"{rate:.2f}", f"{8e3 / rate:.1f}", f"{rate / base:.2f}x")
    console.print(table)
    return rates


# Next to nothing but the vocabulary projection (and the softmax over it): against its
# short step (~27 ms on the 2-core VM's CPU, a few on a GPU) shows the mask path's fixed
# cost at that vocabulary: a MaskBatch fill, each row's mask applied and sampled alone.
VOCAB_ONLY = {"hidden": 16, "layers": 1, "intermediate": 32, "heads": 1, "kv_heads": 1}


def large_models(cache: Path, vocab: int) -> tuple[Path, Path, Path]:
    """The large tokenizer, a random-weight model of Qwen2.5-0.5B's shape around it
    (bench/models.py, preset 0.5b) and a VOCAB_ONLY one, built once into `cache`."""
    tok_dir = cache / f"tokenizer-{vocab}"
    if not (tok_dir / "tokenizer.json").exists():
        t0 = time.perf_counter()
        big_tokenizer(vocab, tok_dir)
        print(f"trained the {vocab:,}-token tokenizer in {time.perf_counter() - t0:.0f} s", flush=True)
    real_dir, vocab_dir = cache / f"qwen2.5-0.5b-{vocab}", cache / f"vocab-only-{vocab}"
    if not (real_dir / "config.json").exists():
        models.build(real_dir, models.PRESETS["0.5b"], models.DTYPES["0.5b"], tok_dir)
    if not (vocab_dir / "config.json").exists():
        models.build(vocab_dir, VOCAB_ONLY, "float32", tok_dir)
    return tok_dir, real_dir, vocab_dir


# -- through the proxy -------------------------------------------------------------------


@dataclass
class Stream:
    """One streamed chat completion: arrival time of each content chunk, and usage."""

    stamps: list[float]
    completion_tokens: int
    text: str


async def stream_chat(client: openai.AsyncOpenAI, prompt: str, max_tokens: int,
                      schema: dict | None) -> Stream:
    extra = {} if schema is None else {"response_format": {
        "type": "json_schema", "json_schema": {"name": "note", "schema": schema, "strict": True}}}
    stamps, text, usage = [], [], None
    events = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True}, **extra)
    async for event in events:
        if event.usage is not None:
            usage = event.usage
        for choice in event.choices:
            if choice.delta.content:
                stamps.append(time.perf_counter())
                text.append(choice.delta.content)
    return Stream(stamps, usage.completion_tokens if usage else 0, "".join(text))


def full_batch_rate(streams: list[Stream]) -> tuple[float, float]:
    """Tokens/s while every stream is decoding: the chunks that arrive after the last
    stream's first one and up to the first stream's last one, over that time (each
    chunk one token; `serve_rates` checks it). Also that window, in seconds."""
    start = max(s.stamps[0] for s in streams)
    end = min(s.stamps[-1] for s in streams)
    chunks = sum(1 for s in streams for t in s.stamps if start < t <= end)
    return (chunks / (end - start) if end > start else 0.0), end - start


async def serve_round(url: str, n: int, max_tokens: int, schema: dict) -> list[Stream]:
    """8 concurrent streams, the first `n` constrained to `schema`."""
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", timeout=1800,
                                  max_retries=0) as client:
        return await asyncio.gather(*(
            stream_chat(client, f"Note {i}:", max_tokens, schema if i < n else None)
            for i in range(8)))


def checked(streams: list[Stream], max_tokens: int) -> list[Stream]:
    """`streams`, each of which must be `max_tokens` tokens in as many content chunks:
    a stream that ended early would leave a smaller batch, and chunks of several
    tokens would skew `full_batch_rate`."""
    short = [(s.completion_tokens, len(s.stamps)) for s in streams
             if s.completion_tokens != max_tokens or len(s.stamps) != max_tokens]
    if short:
        raise RuntimeError(f"streams not of {max_tokens} tokens in one chunk each ((usage, "
                           f"chunks): {short}); texts: {[s.text[:80] for s in streams]}")
    return streams


def serve_rates(console: Console, model_dir: Path, max_tokens: int, repeat: int,
                workdir: Path) -> dict:
    """`kvroute serve` with the model on one backend (max_batch 8); 8 concurrent streaming
    chat requests, 0, 4 or 8 of them with a json_schema response_format; tokens/s while
    all 8 decode (`full_batch_rate`), configurations interleaved, best of `repeat`."""
    config = {"models": [{"path": str(model_dir), "alias": "m", "max_batch": 8,
                          "cache_bytes": "1GiB", "disk_cache_bytes": 0}]}
    # The backend's own warm-up prefills ~1,700 tokens on a CPU (a quarter of an hour
    # at this size here): the first round below warms what is measured instead.
    serve = ServeProcess(config, workdir, name="bench-grammar-serve", env={"KVROUTE_NO_WARMUP": "1"})
    try:
        t0 = time.perf_counter()
        serve.wait_ready(lambda: any(m["id"] == "m" and m["state"] == "loaded"
                                     for m in get_json(serve.url + "/v1/models")["data"]),
                         900, 0.5, "the model to load")
        print(f"  [serve] ready in {time.perf_counter() - t0:.0f} s", flush=True)
        # A first round (half of it constrained, both paths) compiles the shapes and
        # the grammar, and fills the prompt cache: every measured round prefills alike.
        t0 = time.perf_counter()
        checked(asyncio.run(serve_round(serve.url, 4, 4, TEXT_SCHEMA)), 4)
        print(f"  [serve] warmed up in {time.perf_counter() - t0:.0f} s", flush=True)
        rates: dict[int, float] = {}
        for r in range(repeat):
            for n in (0, 4, 8):
                t0 = time.perf_counter()
                streams = checked(asyncio.run(serve_round(serve.url, n, max_tokens, TEXT_SCHEMA)),
                                  max_tokens)
                rate, window = full_batch_rate(streams)
                rates[n] = max(rates.get(n, 0.0), rate)
                print(f"  [serve] pass {r + 1}/{repeat}, {n} of 8 constrained: {rate:.2f} "
                      f"tokens/s over {window:.1f} s of full batch "
                      f"({time.perf_counter() - t0:.0f} s in all)", flush=True)
    finally:
        serve.stop(60)
    table = Table(title=f"through the proxy: 8 concurrent streaming chat requests, max_tokens "
                        f"{max_tokens}, tokens/s while all 8 decode, best of {repeat}")
    for col in ("constrained requests", "tokens/s", "vs unconstrained"):
        table.add_column(col, justify="right")
    for n, rate in rates.items():
        table.add_row(f"{n} of 8", f"{rate:.2f}", f"{rate / rates[0]:.2f}x")
    console.print(table)
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_grammar", description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default=",".join(PARTS),
                    help=f"which parts to run (of {', '.join(PARTS)})")
    ap.add_argument("--vocab", type=int, default=150_000,
                    help="size of the locally trained large tokenizer (0: skip it and the "
                         "real-size model)")
    ap.add_argument("--repeat", type=int, default=5, help="passes for the steady state")
    ap.add_argument("--steps", type=int, default=200, help="decode steps per demo measurement")
    ap.add_argument("--real-steps", type=int, default=12,
                    help="decode steps per real-size measurement (a few seconds each on a CPU)")
    ap.add_argument("--real-repeat", type=int, default=2, help="passes at real size (real, serve)")
    ap.add_argument("--max-tokens", type=int, default=16, help="max_tokens of each served request")
    ap.add_argument("--cache", type=Path, default=demo_model.default_cache_dir() / "bench-grammar",
                    help="where the large tokenizer and the real-size model are built, once")
    args = ap.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    if unknown := set(parts) - set(PARTS):
        ap.error(f"--parts: unknown {', '.join(sorted(unknown))} (of {', '.join(PARTS)})")
    console = Console()
    print(command_line())
    loadavg = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(machine(f"{os.cpu_count()} cores, load average {loadavg}; {time.strftime('%Y-%m-%d %H:%M %Z')}"),
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = demo_model.ensure("text", cache_dir=Path(tmp))
        if "masks" in parts:
            _, tok = load(str(model_dir))
            mask_table(console, tok, len(tok._tokenizer), args.repeat, "demo tokenizer")
        if "demo" in parts:
            decode_rates(console, model_dir, "demo model", COUNT_SCHEMA, "Count: 1", args.steps,
                         args.repeat, DEMO_CONFIGS)
        if not args.vocab or not {"masks", "vocab", "real", "serve"} & set(parts):
            return
        tok_dir, real_dir, vocab_dir = large_models(args.cache, args.vocab)
        if "masks" in parts:
            big = load_tokenizer(tok_dir)
            # Models pad their logits past the tokenizer (Qwen: 151,936 for 151,665).
            mask_table(console, big, -(-len(big._tokenizer) // 128) * 128, args.repeat,
                       "large tokenizer")
        if "vocab" in parts:
            decode_rates(console, vocab_dir, "the vocabulary projection alone (hidden 16, 1 layer)",
                         TEXT_SCHEMA, "Note:", args.steps // 2, args.repeat, DEMO_CONFIGS)
        if "real" in parts:
            decode_rates(console, real_dir, "Qwen2.5-0.5B shape, random weights, float32",
                         TEXT_SCHEMA, "Note:", args.real_steps, args.real_repeat, REAL_CONFIGS)
        if "serve" in parts:
            serve_rates(console, real_dir, args.max_tokens, args.real_repeat, Path(tmp))


if __name__ == "__main__":
    main()

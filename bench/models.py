"""Random-weight models in mlx-lm's format for the benchmarks (bench_hw.py, bench_grammar.py).

A benchmark machine may have no access to model hubs, so the benchmark builds its own:
a tokenizer (and chat template), by default kvroute's demo model's, and a model with
Qwen2.5-7B's shape (hidden 3584, 28 layers, MLP 18944, 28 heads, 4 KV heads)
whose weights are random. Its text is garbage; its prefill and decode cost what a
7B model's do, except the vocabulary projection: the demo tokenizer has ~1.2k
tokens instead of Qwen's 152k (~1.1B fewer parameters in lm_head/embeddings).
`--tokenizer DIR` takes another tokenizer, e.g. bench_grammar's 150k-token one, for
the vocabulary projection of a real model too. The vocabulary is padded to a multiple
of 128, as real models pad theirs.

lm_head rows of special/added tokens, of tokens that decode to invalid UTF-8 and of
tokens holding `"` or a backslash are zeroed (logit 0, while the other random logits
make the max > 0 with overwhelming probability), so greedy decoding never emits EOS
or a <tool_call>, every generated token produces visible text, and a row constrained
to a JSON string stays inside it.

    python -m bench.models OUT_DIR [--preset 7b|cpu|0.5b] [--tokenizer DIR] [--layers 28 --hidden 3584 ...]

Presets: `7b` is Qwen2.5-7B's shape in bf16 (15 GiB); `cpu` a small float32 shape
(MLX's CPU matmuls are slow in bf16) in which prefill still dominates long prompts;
`0.5b` Qwen2.5-0.5B's shape (hidden 896, 24 layers, MLP 4864, 14 heads, 2 KV heads)
in float32, with an untied lm_head.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import qwen2
from mlx_lm.utils import save_model
from tokenizers import Tokenizer

from kvroute.devtools import demo_model

PRESETS = {
    "7b": {"hidden": 3584, "layers": 28, "intermediate": 18944, "heads": 28, "kv_heads": 4},
    "cpu": {"hidden": 512, "layers": 8, "intermediate": 1536, "heads": 8, "kv_heads": 2},
    "0.5b": {"hidden": 896, "layers": 24, "intermediate": 4864, "heads": 14, "kv_heads": 2},
}
# MLX's CPU matmuls are fast in float32 only
DTYPES = {"7b": "bfloat16", "cpu": "float32", "0.5b": "float32"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")


def masked_rows(tok: Tokenizer, vocab: int) -> list[int]:
    """Token ids greedy decoding must never pick: special and added tokens (EOS, tool-call
    markers), ids past the tokenizer (the padding of the logits), tokens whose text is
    empty or not whole UTF-8 (no visible text), and tokens holding `"` or `\\`, so that
    a row constrained to a JSON string never closes it (nor starts an escape)."""
    added = set(tok.get_added_tokens_decoder())
    masked = []
    for i in range(vocab):
        if i in added or tok.id_to_token(i) is None:
            masked.append(i)
            continue
        text = tok.decode([i], skip_special_tokens=False)
        if not text or "\ufffd" in text or '"' in text or "\\" in text:
            masked.append(i)
    return masked


def build(out: Path, shape: dict, dtype: str = "float32", tokenizer: Path | None = None,
          context: int = 40960, seed: int = 0) -> Path:
    """A random-weight Qwen2 of `shape` (PRESETS' keys) in `out`, with the tokenizer
    (and chat template) in the directory `tokenizer`, default the demo model's. The
    vocabulary is the tokenizer's, padded to a multiple of 128 as real models pad it."""
    t0 = time.perf_counter()
    if out.exists():
        shutil.rmtree(out)
    if tokenizer is None:
        tokenizer = out.parent / (out.name + "-demo")
        demo_model.build(tokenizer)  # tokenizer, chat template and a tiny model (only its files are reused)
    tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    vocab = -(-tok.get_vocab_size(with_added_tokens=True) // 128) * 128
    masked = masked_rows(tok, vocab)
    print(f"tokenizer: {vocab:,} logits, {len(masked):,} masked in lm_head "
          f"({time.perf_counter() - t0:.1f}s)", flush=True)

    margs = qwen2.ModelArgs(
        model_type="qwen2",
        hidden_size=shape["hidden"],
        num_hidden_layers=shape["layers"],
        intermediate_size=shape["intermediate"],
        num_attention_heads=shape["heads"],
        rms_norm_eps=1e-6,
        vocab_size=vocab,
        num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=context,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    )
    mx.random.seed(seed)
    model = qwen2.Model(margs)
    model.set_dtype(getattr(mx, dtype))
    for layer in model.layers:  # one layer at a time: no fp32 copy of the whole model
        mx.eval(layer.parameters())
    keep = mx.ones((vocab, 1), dtype=getattr(mx, dtype))
    if masked:
        keep[mx.array(masked)] = 0
    model.lm_head.weight = model.lm_head.weight * keep
    mx.eval(model.parameters())
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"model: {n_params / 1e9:.2f}B parameters, device {mx.default_device()} "
          f"({time.perf_counter() - t0:.1f}s)", flush=True)

    t1 = time.perf_counter()
    save_model(out, model)
    ids = json.loads((tokenizer / "generation_config.json").read_text())
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        **{k: v for k, v in vars(margs).items() if v is not None},
        "bos_token_id": None,
        "eos_token_id": ids["eos_token_id"],
        "pad_token_id": ids.get("pad_token_id"),
        "torch_dtype": dtype,
        "bench_random_weights": True,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer / name, out / name)
    tok_config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    tok_config["model_max_length"] = context
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"saved {size / 2**30:.1f} GiB to {out} in {time.perf_counter() - t1:.1f}s "
          f"(total {time.perf_counter() - t0:.1f}s)", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.models")
    p.add_argument("out")
    p.add_argument("--preset", choices=sorted(PRESETS), default="7b")
    for name in PRESETS["7b"]:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="a directory with tokenizer.json, tokenizer_config.json, "
                        "special_tokens_map.json and generation_config.json (default: the demo model's)")
    p.add_argument("--context", type=int, default=40960)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    shape = {name: getattr(args, name) or value for name, value in PRESETS[args.preset].items()}
    build(Path(args.out), shape, DTYPES[args.preset], args.tokenizer, args.context, args.seed)


if __name__ == "__main__":
    main()

"""Random-weight models in mlx-lm's format for the hardware benchmark (bench_hw.py).

A benchmark machine may have no access to model hubs, so the benchmark builds its own:
the tokenizer (and chat template) of kvroute's demo model, and a model with
Qwen2.5-7B's shape (hidden 3584, 28 layers, MLP 18944, 28 heads, 4 KV heads)
whose weights are random. Its text is garbage; its prefill and decode cost what a
7B model's do, except the vocabulary projection: the demo tokenizer has ~1.2k
tokens instead of Qwen's 152k (~1.1B fewer parameters in lm_head/embeddings).

lm_head rows of special/added tokens and of tokens that decode to invalid UTF-8
are zeroed (logit 0, while ~900 other random logits make the max > 0 with
overwhelming probability), so greedy decoding never emits EOS or a <tool_call>
and every generated token produces visible text.

    python -m bench.models OUT_DIR [--preset 7b|cpu] [--layers 28 --hidden 3584 ...]

Presets: `7b` is Qwen2.5-7B's shape in bf16 (15 GiB); `cpu` a small float32 shape
(MLX's CPU matmuls are slow in bf16) in which prefill still dominates long prompts.
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
}
DTYPES = {"7b": "bfloat16", "cpu": "float32"}  # MLX's CPU matmuls are fast in float32 only


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.models")
    p.add_argument("out")
    p.add_argument("--preset", choices=sorted(PRESETS), default="7b")
    for name in PRESETS["7b"]:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    p.add_argument("--context", type=int, default=40960)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    for name, value in PRESETS[args.preset].items():
        if getattr(args, name) is None:
            setattr(args, name, value)

    t0 = time.perf_counter()
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    demo = out.parent / (out.name + "-demo")
    demo_model.build(demo)  # tokenizer, chat template and a tiny model (only its files are reused)
    demo_config = json.loads((demo / "config.json").read_text())
    vocab = demo_config["vocab_size"]
    tok = Tokenizer.from_file(str(demo / "tokenizer.json"))
    added = set(tok.get_added_tokens_decoder())
    masked = [i for i in range(vocab)
              if i in added or tok.id_to_token(i) is None
              or "\ufffd" in tok.decode([i], skip_special_tokens=False)
              or not tok.decode([i], skip_special_tokens=False)]
    print(f"tokenizer: {vocab} tokens, {len(masked)} masked in lm_head "
          f"({time.perf_counter() - t0:.1f}s)", flush=True)

    margs = qwen2.ModelArgs(
        model_type="qwen2",
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        intermediate_size=args.intermediate,
        num_attention_heads=args.heads,
        rms_norm_eps=1e-6,
        vocab_size=vocab,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.context,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    )
    mx.random.seed(args.seed)
    model = qwen2.Model(margs)
    dtype = getattr(mx, DTYPES[args.preset])
    model.set_dtype(dtype)
    for layer in model.layers:  # one layer at a time: no fp32 copy of the whole model
        mx.eval(layer.parameters())
    keep = mx.ones((vocab, 1), dtype=dtype)
    if masked:
        keep[mx.array(masked)] = 0
    model.lm_head.weight = model.lm_head.weight * keep
    mx.eval(model.parameters())
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"model: {n_params / 1e9:.2f}B parameters, device {mx.default_device()} "
          f"({time.perf_counter() - t0:.1f}s)", flush=True)

    t1 = time.perf_counter()
    save_model(out, model)
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        **{k: v for k, v in vars(margs).items() if v is not None},
        "bos_token_id": None,
        "eos_token_id": demo_config["eos_token_id"],
        "pad_token_id": demo_config["pad_token_id"],
        "torch_dtype": DTYPES[args.preset],
        "bench_random_weights": True,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("tokenizer.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copy(demo / name, out / name)
    tok_config = json.loads((demo / "tokenizer_config.json").read_text())
    tok_config["model_max_length"] = args.context
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"saved {size / 2**30:.1f} GiB to {out} in {time.perf_counter() - t1:.1f}s "
          f"(total {time.perf_counter() - t0:.1f}s)", flush=True)


if __name__ == "__main__":
    main()

"""Tiny random-weight models of each mlx-lm family, built locally for tests.

kvroute caches prompts for every kind of model: full attention (``KVCache``),
sliding windows (``RotatingKVCache``), linear attention and state-space layers
(``ArraysCache``), and hybrids of them. To exercise each kind without a
download, ``build`` writes a small checkpoint of one mlx-lm architecture with
seeded random weights around the demo model's tokenizer and chat template, so
``mlx_lm.load`` and ``apply_chat_template(..., tools=...)`` work as for any
model.

The weights mean nothing and the output is gibberish, but the builder checks
what kvroute relies on: the logits are finite and vary with the prompt, and a
prompt prefilled in two chunks through one cache gives the same log-probs as
in one call (``prefill_gap``), so a cached prefix can be extended exactly.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import make_prompt_cache
from tokenizers import Tokenizer

from . import demo_model
from .names import ARCHES

# Bump when the files ``build`` writes change, so ``ensure`` rebuilds its cache.
VERSION = 1

SEED = 0
# Small enough that a few hundred tokens rotate every sliding window.
SLIDING_WINDOW = 32
MAX_POSITIONS = demo_model.MAX_POSITIONS  # the tokenizer's model_max_length
HIDDEN_SIZE = 64

# The check ``build`` runs: a prompt of CHECK_TOKENS prefilled whole and in
# two chunks split at CHECK_SPLIT must agree to GAP_TOLERANCE in log-softmax.
CHECK_TOKENS = 200
CHECK_SPLIT = 120
GAP_TOLERANCE = 1e-4

# Attention shapes shared by the families that have attention layers.
_ATTENTION = {
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": MAX_POSITIONS,
}

# config.json of each architecture, less the vocabulary and token ids, which
# come from the tokenizer. Each hybrid has a layer of each cache kind.
CONFIGS: dict[str, dict] = {
    # Two full-attention layers: KVCache, KVCache.
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": HIDDEN_SIZE,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        **_ATTENTION,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": False,
    },
    # Sliding, global, sliding, global: RotatingKVCache and KVCache in turn.
    "gemma3_text": {
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": HIDDEN_SIZE,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        **_ATTENTION,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": 16,
        "sliding_window": SLIDING_WINDOW,
        "sliding_window_pattern": 2,
    },
    # Sliding (with attention sinks), full, sliding, full; a 4-expert MoE.
    "gpt_oss": {
        "architectures": ["GptOssForCausalLM"],
        "hidden_size": HIDDEN_SIZE,
        "num_hidden_layers": 4,
        "intermediate_size": 64,
        **_ATTENTION,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000,
        # Plain RoPE: without a rope_scaling, transformers (which reads this
        # config when loading the tokenizer) assumes gpt-oss's YaRN and warns
        # that the lengths do not match it. The model ignores this length.
        "rope_scaling": {"rope_type": "default"},
        "max_position_embeddings": MAX_POSITIONS,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    },
    # Gated-delta linear attention, full attention, linear: ArraysCache,
    # KVCache, ArraysCache. MoE MLPs with a shared expert: the build check
    # finds top-k routing exact under chunked prefill, so no dense fallback.
    "qwen3_next": {
        "architectures": ["Qwen3NextForCausalLM"],
        "hidden_size": HIDDEN_SIZE,
        "num_hidden_layers": 3,
        "intermediate_size": 128,
        **_ATTENTION,
        "head_dim": 32,
        "partial_rotary_factor": 0.25,
        "full_attention_interval": 2,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10_000_000.0,
        "tie_word_embeddings": False,
    },
    # Short convolution, attention, convolution: ArraysCache, KVCache,
    # ArraysCache. LFM2 always ties its embeddings (see ARCH_SCALES).
    "lfm2": {
        "architectures": ["Lfm2ForCausalLM"],
        "hidden_size": HIDDEN_SIZE,
        "num_hidden_layers": 3,
        "layer_types": ["conv", "full_attention", "conv"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": MAX_POSITIONS,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": HIDDEN_SIZE,
        "block_ff_dim": 128,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": True,
    },
    # Pure state-space model: ArraysCache (conv state, SSM state) per layer.
    "mamba2": {
        "architectures": ["Mamba2ForCausalLM"],
        "hidden_size": HIDDEN_SIZE,
        "num_hidden_layers": 2,
        "num_heads": 8,
        "head_dim": 16,
        "intermediate_size": 128,
        "state_size": 16,
        "n_groups": 1,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "layer_norm_epsilon": 1e-5,
        # Mamba's default upper limit is infinity, which JSON cannot hold.
        "time_step_limit": [0.0, 1000.0],
        "time_step_rank": "auto",
        # The model ignores this; the backend reads its context length here.
        "max_position_embeddings": MAX_POSITIONS,
        "tie_word_embeddings": False,
    },
    # Mamba mixer and attention side by side in every layer:
    # CacheList(ArraysCache, KVCache). The muP multipliers keep their
    # defaults: mlx-lm folds them into Hugging Face weights when it loads
    # those, not into these, and an untied head skips the output one.
    "falcon_h1": {
        "architectures": ["FalconH1ForCausalLM"],
        "hidden_size": HIDDEN_SIZE,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        **_ATTENTION,
        "mamba_d_ssm": 64,
        "mamba_n_heads": 4,
        "mamba_d_head": 16,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_n_groups": 1,
        "mamba_rms_norm": True,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": False,
    },
}
assert tuple(CONFIGS) == ARCHES, "names.ARCHES lists CONFIGS' families"

# 7B-class shapes (``size="7b"``) of the families whose caches differ most, for
# timing on an accelerator: prefill and decode cost what a real model's do, and
# the caches hold real sizes (1,024-token windows, 128x128 recurrent states).
# The vocabulary stays the demo tokenizer's, so lm_head is ~1B parameters
# lighter than a real model's. Weights are random bf16; the build check only
# asks for finite logits, since bf16 cannot meet the tiny models' 1e-4 gap.
LARGE_POSITIONS = 65536
LARGE_CONFIGS: dict[str, dict] = {
    # 32 layers, every sixth global, as in Gemma 3: ~6.4B parameters.
    "gemma3_text": {
        "hidden_size": 3584,
        "num_hidden_layers": 32,
        "intermediate_size": 14336,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "max_position_embeddings": LARGE_POSITIONS,
    },
    # 32 layers, every fourth full attention and the rest gated-delta, as in
    # Qwen3-Next, with dense MLPs instead of its experts: ~6.6B parameters.
    "qwen3_next": {
        "hidden_size": 3584,
        "num_hidden_layers": 32,
        "intermediate_size": 14336,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "full_attention_interval": 4,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "mlp_only_layers": list(range(32)),
        "max_position_embeddings": LARGE_POSITIONS,
    },
}
SIZES = ("tiny", "7b")

# Factors on mlx's default initialization, by parameter-name suffix (the names
# are common to all the families). The defaults keep activations O(1), but
# with them a few random layers wash the current token out of the last hidden
# state and greedy decoding falls into a loop, and the logits are nearly flat.
# So the layers' writes to the residual stream are halved and biases made
# small (keeping the token visible), and the head is sharpened so that
# log-probs have a few nats of entropy like a real model's.
SCALES = {
    "o_proj.weight": 0.5,
    "out_proj.weight": 0.5,
    "down_proj.weight": 0.5,
    "w2.weight": 0.5,
    ".bias": 0.1,
    "lm_head.weight": 5.0,
}
# LFM2 ties its head to the embedding, so a visible token would predict
# itself. There the embedding is small, leaving the layers' token-dependent
# writes to dominate, and the final norm makes up the logits' scale.
# gpt-oss's attention (biased, with sinks) washes the token out faster: at
# half scale greedy decoding loops within a few tokens, at a quarter it varies.
# Gemma's norms scale by 1 + weight, so its final norm (weight 1) already
# doubles the logits: its head gets half the others' factor.
ARCH_SCALES = {
    "lfm2": {"embed_tokens.weight": 0.05, "embedding_norm.weight": 60.0},
    "gpt_oss": {"o_proj.weight": 0.25},
    "gemma3_text": {"lm_head.weight": 2.5},
}


def _check_arch(arch: str) -> None:
    if arch not in CONFIGS:
        raise ValueError(f"Unknown arch {arch!r}, expected one of {ARCHES}")


def _check_size(arch: str, size: str) -> None:
    if size not in SIZES:
        raise ValueError(f"Unknown size {size!r}, expected one of {SIZES}")
    if size != "tiny" and arch not in LARGE_CONFIGS:
        raise ValueError(f"No {size} shape for {arch!r}; have {tuple(LARGE_CONFIGS)}")


def model_config(arch: str, tokenizer: Tokenizer, size: str = "tiny") -> dict:
    """The full config.json of ``arch`` at ``size`` for the demo tokenizer."""
    _check_arch(arch)
    _check_size(arch, size)
    large = size != "tiny"
    return {
        "model_type": arch,
        **CONFIGS[arch],
        **(LARGE_CONFIGS[arch] if large else {}),
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        **demo_model.token_ids(tokenizer),
        "torch_dtype": "bfloat16" if large else "float32",
        "kvroute_arch": {"arch": arch, "version": VERSION, **({"size": size} if large else {})},
    }


def build_model(config: dict) -> nn.Module:
    """Instantiate the mlx-lm model of ``config`` with seeded random weights."""
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(SEED)
    model = module.Model(module.ModelArgs.from_dict(config))
    if config["torch_dtype"] == "bfloat16":
        model.set_dtype(mx.bfloat16)
        # One layer at a time: never a float32 copy of a 7B model in memory.
        for layer in model.layers:
            mx.eval(layer.parameters())
    scales = {**SCALES, **ARCH_SCALES.get(config["model_type"], {})}
    updates = [
        (name, value * scales[suffix])
        for name, value in tree_flatten(model.parameters())
        for suffix in scales
        if name.endswith(suffix)
    ]
    model.update(tree_unflatten(updates))
    mx.eval(model.parameters())
    return model


def prefill_gap(
    model: nn.Module, tokens: list[int], splits: Sequence[int] = (CHECK_SPLIT,)
) -> float:
    """Max |difference| of log-softmax between a whole and a chunked prefill.

    Both runs use a fresh ``make_prompt_cache(model)``; the second feeds the
    chunks of ``tokens`` cut at ``splits`` one after the other through the
    same cache, as kvroute does when it extends a cached prefix. Every
    position's log-probs are compared, not only the last.
    """

    def log_probs(bounds: list[int]) -> mx.array:
        cache = make_prompt_cache(model)
        logits = [
            model(mx.array([tokens[start:end]]), cache=cache)
            for start, end in zip(bounds, bounds[1:])
        ]
        logits = mx.concatenate(logits, axis=1).astype(mx.float32)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    whole = log_probs([0, len(tokens)])
    chunked = log_probs([0, *splits, len(tokens)])
    return mx.abs(whole - chunked).max().item()


def _require(ok: bool, message: str) -> None:
    # Build-time checks that must survive `python -O`, unlike assert.
    if not ok:
        raise RuntimeError(f"Arch model check failed: {message}")


def check_model(model: nn.Module, tokens: list[int]) -> float:
    """Check finite, varied logits and exact split prefill; return the gap."""
    logits = model(mx.array([tokens]))[0]
    _require(mx.isfinite(logits).all().item(), "non-finite logits")
    # A degenerate model predicts the same token after every prefix.
    greedy = set(logits.argmax(axis=-1).tolist())
    _require(len(greedy) >= len(tokens) // 10, f"only {len(greedy)} greedy tokens")
    gap = prefill_gap(model, tokens)
    _require(gap <= GAP_TOLERANCE, f"split prefill differs by {gap:.2e}")
    return gap


def check_tokens(tokenizer: Tokenizer) -> list[int]:
    """The prompt ``check_model`` uses: the start of the tokenizer's corpus."""
    tokens = tokenizer.encode(demo_model.CORPUS).ids[:CHECK_TOKENS]
    _require(len(tokens) == CHECK_TOKENS, "corpus too short for the check")
    return tokens


def build(out_dir: str | Path, arch: str, size: str = "tiny") -> Path:
    """Write the random-weight model of ``arch`` to ``out_dir`` and return it."""
    _check_arch(arch)
    _check_size(arch, size)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = demo_model.train_tokenizer()
    config = model_config(arch, tokenizer, size)
    model = build_model(config)
    if size == "tiny":
        check_model(model, check_tokens(tokenizer))
    else:
        logits = model(mx.array([check_tokens(tokenizer)]))
        _require(mx.isfinite(logits).all().item(), "non-finite logits")
    demo_model.write_checkpoint(out_dir, model, config, tokenizer)
    if size != "tiny":
        # The tokenizer's limit is the tiny models' context; the backend reads
        # the longer of the two as its own.
        tok_path = out_dir / "tokenizer_config.json"
        tok_config = json.loads(tok_path.read_text())
        tok_config["model_max_length"] = LARGE_POSITIONS
        tok_path.write_text(json.dumps(tok_config, indent=2) + "\n")
    return out_dir


def ensure(arch: str, cache_dir: Path | None = None, size: str = "tiny") -> Path:
    """Return the cached model of ``arch`` at ``size``, building it on first use.

    The same cache and contract as ``demo_model.ensure``.
    """
    _check_arch(arch)
    _check_size(arch, size)
    name = f"arch-model-{arch}-v{VERSION}" + ("" if size == "tiny" else f"-{size}")
    return demo_model.cached_build(name, lambda path: build(path, arch, size), cache_dir)

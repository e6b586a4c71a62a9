"""Tiny random-weight vision-language models, built locally for tests and benchmarks.

A Gemma 3 checkpoint as Hugging Face lays it out (`model_type` "gemma3", a
`text_config` and a `vision_config`, weights under `language_model.`,
`vision_tower.` and `multi_modal_projector.`), with the tiny sliding-window text
model of arch_models, a two-layer SigLIP encoder of 64x64 images in 8x8 patches
pooled to 16 image tokens, and the demo tokenizer with Gemma 3's image tokens added.
`mlx_lm.load` reads its language model, kvroute's vision step its encoder
(kvroute/backend/vision.py). The weights mean nothing; different images give
different embeddings, which is all a cache test needs.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from tokenizers import AddedToken

from . import arch_models, demo_model
from .names import VISION_FAMILIES

VERSION = 1
SEED = 0
FAMILIES = VISION_FAMILIES
BOI, IMAGE_TOKEN, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
TOKENS_PER_IMAGE = 16
VISION_CONFIG = {
    "model_type": "siglip_vision_model",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "patch_size": 8,
    "image_size": 64,
    "num_channels": 3,
    "layer_norm_eps": 1e-6,
}
# For benchmarks on a CPU: an encoder with a cost to skip (224x224 images, 256 patches
# through 4 layers, pooled to 64 image tokens).
SMALL = {"tokens_per_image": 64, "vision": {
    "hidden_size": 128, "num_hidden_layers": 4, "intermediate_size": 256,
    "num_attention_heads": 4, "patch_size": 14, "image_size": 224}}
SIZES = ("tiny", "small")


def model_config(tokenizer, size: str = "tiny") -> dict:
    text = arch_models.model_config("gemma3_text", tokenizer)
    for key in ("kvroute_arch", "architectures", "torch_dtype", "bos_token_id"):
        text.pop(key, None)
    ids = {name: tokenizer.token_to_id(t) for name, t in
           (("boi_token_index", BOI), ("image_token_index", IMAGE_TOKEN),
            ("eoi_token_index", EOI))}
    small = size == "small"
    n = SMALL["tokens_per_image"] if small else TOKENS_PER_IMAGE
    return {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": {**text, "mm_tokens_per_image": n},
        "vision_config": {**VISION_CONFIG, **(SMALL["vision"] if small else {})},
        "mm_tokens_per_image": n,
        **ids,
        "vocab_size": text["vocab_size"],
        "eos_token_id": text["eos_token_id"],
        "pad_token_id": text["pad_token_id"],
        "torch_dtype": "float32",
        "kvroute_vlm": {"family": "gemma3", "version": VERSION, "size": size},
    }


def _vision_weights(config: dict) -> dict[str, mx.array]:
    from mlx_vlm.models.gemma3.config import ModelConfig, TextConfig, VisionConfig
    from mlx_vlm.models.gemma3.gemma3 import Gemma3MultiModalProjector
    from mlx_vlm.models.gemma3.vision import VisionModel

    cfg = ModelConfig.from_dict(config)
    cfg.text_config = TextConfig.from_dict(config["text_config"])
    cfg.vision_config = VisionConfig.from_dict(config["vision_config"])
    mx.random.seed(SEED + 1)
    tower, projector = VisionModel(cfg.vision_config), Gemma3MultiModalProjector(cfg)
    v, h = cfg.vision_config.hidden_size, cfg.text_config.hidden_size
    # Image embeddings of about a text embedding's size (mlx's default: N(0, 1/h) rows).
    projector.mm_input_projection_weight = mx.random.normal((v, h)) / (v * h) ** 0.5
    weights = {f"vision_tower.{k}": a for k, a in tree_flatten(tower.parameters())}
    weights.update({f"multi_modal_projector.{k}": a
                    for k, a in tree_flatten(projector.parameters())})
    return weights


def _check(family: str, size: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"Unknown family {family!r}, expected one of {FAMILIES}")
    if size not in SIZES:
        raise ValueError(f"Unknown size {size!r}, expected one of {SIZES}")


def build(out_dir: str | Path, family: str = "gemma3", size: str = "tiny") -> Path:
    """Write the random-weight VLM of `family` at `size` to `out_dir` and return it."""
    _check(family, size)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = demo_model.train_tokenizer()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in (BOI, IMAGE_TOKEN, EOI)])
    config = model_config(tokenizer, size)
    text = arch_models.build_model({**config["text_config"], "model_type": "gemma3_text",
                                    "torch_dtype": "float32"})
    weights = {f"language_model.{k}": a for k, a in tree_flatten(text.parameters())}
    weights.update(_vision_weights(config))
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    side = config["vision_config"]["image_size"]
    (out_dir / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Gemma3ImageProcessor", "image_mean": [0.5] * 3,
         "image_std": [0.5] * 3, "size": {"height": side, "width": side}}, indent=2) + "\n")
    demo_model.write_tokenizer(out_dir, tokenizer)
    return out_dir


def ensure(family: str = "gemma3", cache_dir: Path | None = None, size: str = "tiny") -> Path:
    """The cached VLM of `family` at `size`, built on first use (as demo_model.ensure)."""
    _check(family, size)
    name = f"vision-model-{family}-v{VERSION}" + ("" if size == "tiny" else f"-{size}")
    return demo_model.cached_build(name, lambda path: build(path, family, size), cache_dir)

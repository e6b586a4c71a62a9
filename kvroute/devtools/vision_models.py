"""Tiny random-weight vision-language models, built locally for tests and benchmarks.

Checkpoints as Hugging Face lays them out (a `text_config` and a `vision_config`,
weights under `language_model.`, `vision_tower.` and `multi_modal_projector.`),
around the demo tokenizer with the family's image tokens added:

- gemma3: the tiny sliding-window text model of arch_models, a two-layer SigLIP
  encoder of 64x64 images in 8x8 patches pooled to 16 image tokens;
- mistral3: a tiny two-layer Llama-style (Mistral) text model, a two-layer Pixtral
  encoder of images up to 64 pixels a side in 8x8 patches, merged 2x2 into one token
  per 16-pixel cell, a row break after each row of cells.

`mlx_lm.load` reads its language model, kvroute's vision step its encoder
(kvroute/backend/vision.py). The weights mean nothing; different images give
different embeddings, which is all a cache test needs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from tokenizers import AddedToken

from . import arch_models, demo_model
from .names import VISION_FAMILIES

VERSION = 1
SEED = 0
FAMILIES = VISION_FAMILIES
BOI, IMAGE_TOKEN, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
PIXTRAL_TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")
MISTRAL_TEXT = {  # mlx-lm's mistral3 runs a "mistral" text config as Llama
    "model_type": "mistral", "hidden_size": 64, "num_hidden_layers": 2,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 1_000_000.0,
    "max_position_embeddings": demo_model.MAX_POSITIONS, "tie_word_embeddings": False}
PIXTRAL_VISION = {
    "model_type": "pixtral", "hidden_size": 32, "num_hidden_layers": 2,
    "intermediate_size": 64, "num_attention_heads": 2, "head_dim": 16, "image_size": 64,
    "patch_size": 8, "num_channels": 3, "rope_theta": 10000.0}
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


def mistral3_config(tokenizer) -> dict:
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    ids = demo_model.token_ids(tokenizer)
    return {
        "model_type": "mistral3",
        "architectures": ["Mistral3ForConditionalGeneration"],
        "text_config": {**MISTRAL_TEXT, "vocab_size": vocab},
        "vision_config": dict(PIXTRAL_VISION),
        "image_token_index": tokenizer.token_to_id(PIXTRAL_TOKENS[0]),
        "spatial_merge_size": 2,
        "vision_feature_layer": -1,
        "multimodal_projector_bias": False,
        "vocab_size": vocab,
        "eos_token_id": ids["eos_token_id"],
        "pad_token_id": ids["pad_token_id"],
        "torch_dtype": "float32",
        "kvroute_vlm": {"family": "mistral3", "version": VERSION, "size": "tiny"},
    }


def _mistral3_weights(config: dict) -> dict[str, mx.array]:
    from mlx_vlm.models.mistral3 import config as configs
    from mlx_vlm.models.mistral3.mistral3 import Mistral3MultiModalProjector
    from mlx_vlm.models.pixtral.vision import VisionModel

    cfg = vlm_config(configs, config)
    mx.random.seed(SEED + 1)
    tower, projector = VisionModel(cfg.vision_config), Mistral3MultiModalProjector(cfg)
    text = arch_models.build_model({**config["text_config"], "model_type": "llama",
                                    "torch_dtype": "float32"})
    return {**_named("language_model", text), **_named("vision_tower", tower),
            **_named("multi_modal_projector", projector)}


def _vision_weights(config: dict) -> dict[str, mx.array]:
    from mlx_vlm.models.gemma3 import config as configs
    from mlx_vlm.models.gemma3.gemma3 import Gemma3MultiModalProjector
    from mlx_vlm.models.gemma3.vision import VisionModel

    cfg = vlm_config(configs, config)
    mx.random.seed(SEED + 1)
    tower, projector = VisionModel(cfg.vision_config), Gemma3MultiModalProjector(cfg)
    v, h = cfg.vision_config.hidden_size, cfg.text_config.hidden_size
    # Image embeddings of about a text embedding's size (mlx's default: N(0, 1/h) rows).
    projector.mm_input_projection_weight = mx.random.normal((v, h)) / (v * h) ** 0.5
    return {**_named("vision_tower", tower), **_named("multi_modal_projector", projector)}


def vlm_config(configs: Any, config: dict) -> Any:
    """A checkpoint's config.json as the ModelConfig of mlx-vlm's `configs` module (a
    family's `config`), its text and vision parts parsed too: `from_dict` leaves them
    dicts."""
    cfg = configs.ModelConfig.from_dict(config)
    cfg.text_config = configs.TextConfig.from_dict(config["text_config"])
    cfg.vision_config = configs.VisionConfig.from_dict(config["vision_config"])
    return cfg


def _named(prefix: str, module: Any) -> dict[str, mx.array]:
    """A module's parameters under the names a checkpoint gives them."""
    return {f"{prefix}.{k}": a for k, a in tree_flatten(module.parameters())}


def _check(family: str, size: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"Unknown family {family!r}, expected one of {FAMILIES}")
    if size not in SIZES or (size != "tiny" and family != "gemma3"):
        raise ValueError(f"Unknown size {size!r} for {family}, expected one of "
                         f"{SIZES if family == 'gemma3' else ('tiny',)}")


def build(out_dir: str | Path, family: str = "gemma3", size: str = "tiny") -> Path:
    """Write the random-weight VLM of `family` at `size` to `out_dir` and return it."""
    _check(family, size)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = demo_model.train_tokenizer()
    if family == "mistral3":
        tokenizer.add_special_tokens([AddedToken(t, special=True) for t in PIXTRAL_TOKENS])
        config = mistral3_config(tokenizer)
        weights = _mistral3_weights(config)
        processor = {"image_processor_type": "PixtralImageProcessor",
                     "image_mean": [0.48145466, 0.4578275, 0.40821073],
                     "image_std": [0.26862954, 0.26130258, 0.27577711],
                     "size": {"longest_edge": 64}, "patch_size": 8}
    else:
        tokenizer.add_special_tokens([AddedToken(t, special=True) for t in (BOI, IMAGE_TOKEN, EOI)])
        config = model_config(tokenizer, size)
        text = arch_models.build_model({**config["text_config"], "model_type": "gemma3_text",
                                        "torch_dtype": "float32"})
        weights = {f"language_model.{k}": a for k, a in tree_flatten(text.parameters())}
        weights.update(_vision_weights(config))
        side = config["vision_config"]["image_size"]
        processor = {"image_processor_type": "Gemma3ImageProcessor", "image_mean": [0.5] * 3,
                     "image_std": [0.5] * 3, "size": {"height": side, "width": side}}
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    demo_model.write_tokenizer(out_dir, tokenizer)
    return out_dir


def ensure(family: str = "gemma3", cache_dir: Path | None = None, size: str = "tiny") -> Path:
    """The cached VLM of `family` at `size`, built on first use (as demo_model.ensure)."""
    _check(family, size)
    name = f"vision-model-{family}-v{VERSION}" + ("" if size == "tiny" else f"-{size}")
    return demo_model.cached_build(name, lambda path: build(path, family, size), cache_dir)

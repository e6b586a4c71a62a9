"""The vision step of a vision-language model: images to embeddings, spliced into
the prompt's input embeddings on the engine thread.

mlx-lm loads such a checkpoint's language model (its `gemma3` and `mistral3` classes
read the VLM's files and drop the vision weights); mlx-vlm provides the vision encoder and the
projector, built here from the same files. `VisionModel` wraps the language model
for the engine's `BatchGenerator`: a prefill chunk holding image ids (negative,
image_prompt.py) is embedded by the language model's own embedding for its text and
by the image's encoder output for the image's ids; everything else passes through.
An image is encoded when the first chunk holding it is prefilled, once for all its
ids, and kept while a request holds it: a cache hit past the image never runs the
encoder. Attention over image tokens is causal, like every other token, so a
prompt can be prefilled in chunks and committed at any checkpoint exactly.

Families: Gemma 3 (a fixed square image, 256 tokens) and Mistral 3 (Pixtral: the
image's own aspect ratio, a token per cell and a break per row); both have 1D RoPE.
Models whose text positions depend on the image's shape (Qwen2.5-VL's M-RoPE) are
not served with images.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .image_prompt import ImagePrompt, Pixels, PixtralPrompt, image_ids
from .mlx_patches import in_prefill, mark_prefill

log = logging.getLogger("kvroute.backend.vision")

FEATURES_KEPT = 16  # encoded images kept beyond those requests hold (LRU)
FAMILIES = ("gemma3", "mistral3")


class Vision:
    """One model's vision encoder and the images the requests in flight hold."""

    def __init__(self, prompt: ImagePrompt, encode: Any, embed: Any):
        self.prompt = prompt
        self._encode = encode  # (1, H, W, C) pixels -> (tokens_per_image, hidden) embeddings
        self.embed = embed  # the language model's token embedding
        self._lock = threading.Lock()
        self._held: dict[bytes, tuple[Pixels, int]] = {}  # sha -> pixels, holders
        self._ids: dict[int, tuple[bytes, int]] = {}  # image id -> sha, row
        self._features: OrderedDict[bytes, mx.array] = OrderedDict()
        self.encoded = 0  # images run through the encoder (tests: a hit skips it)

    # -- the event loop's side: a request holds its images while it runs ------------

    def hold(self, images: list[Pixels]) -> None:
        with self._lock:
            for p in images:
                pixels, n = self._held.get(p.sha256, (p, 0))
                self._held[p.sha256] = (pixels, n + 1)
                for row, i in enumerate(image_ids(p.sha256, p.tokens)):
                    self._ids[i] = (p.sha256, row)

    def release(self, images: list[Pixels]) -> None:
        with self._lock:
            for p in images:
                pixels, n = self._held.get(p.sha256, (p, 1))
                if n > 1:
                    self._held[p.sha256] = (pixels, n - 1)
                    continue
                self._held.pop(p.sha256, None)
                for i in image_ids(p.sha256, p.tokens):
                    self._ids.pop(i, None)

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def snapshot(self) -> dict:
        return {"encoded": self.encoded, "held": len(self._held)}

    # -- the engine thread's side ----------------------------------------------------

    def embeddings(self, ids: np.ndarray) -> mx.array:
        """Input embeddings of a (batch, length) chunk holding image ids."""
        image = ids < 0
        h = self.embed(mx.array(np.where(image, 0, ids)))
        rows, table, index = [], {}, np.zeros(ids.shape, dtype=np.int32)
        with self._lock:
            found = [self._ids.get(int(i)) for i in ids[image]]
        if any(f is None for f in found):
            raise RuntimeError("a prompt holds an image id of no image in flight")
        offset = 0
        for (sha, row) in found:
            if sha not in table:
                table[sha] = offset
                rows.append(self._features_of(sha))
                offset += rows[-1].shape[0]
        index[image] = [table[sha] + row for sha, row in found]
        features = mx.concatenate(rows, axis=0).astype(h.dtype)
        return mx.where(mx.array(image)[..., None], features[mx.array(index)], h)

    def _features_of(self, sha: bytes) -> mx.array:
        if sha in self._features:
            self._features.move_to_end(sha)
            return self._features[sha]
        with self._lock:
            pixels = self._held[sha][0]
        features = self._encode(mx.array(pixels.values))
        if features.shape[0] != pixels.tokens:  # the layout and the encoder disagree
            raise RuntimeError(f"the encoder gave {features.shape[0]} rows for an image of "
                               f"{pixels.tokens} tokens")
        mx.eval(features)
        self.encoded += 1
        self._features[sha] = features
        while len(self._features) > FEATURES_KEPT:
            self._features.popitem(last=False)
        return features


class VisionModel:
    """The language model as the engine's `BatchGenerator` calls it, embedding image
    ids on the way in; every other attribute is the language model's."""

    def __init__(self, model: Any, vision: Vision):
        self._model = model
        self._vision = vision
        mark_prefill()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        # Decode steps feed sampled tokens, never an image id, and reading them back
        # would wait for the device every step: only prefill chunks (mlx_patches), whose
        # ids came from a list, are looked at, however narrow.
        if self._vision.holding and in_prefill() and inputs.ndim == 2:
            ids = np.array(inputs)
            if (ids < 0).any():
                return self._model(mx.array(np.maximum(ids, 0)), cache=cache,
                                   input_embeddings=self._vision.embeddings(ids))
        return self._model(inputs, cache=cache, **kwargs)


# -- loading ------------------------------------------------------------------------


def load_vision(path: str, model_config: dict, model: Any, tokenizer: Any) -> Vision | None:
    """The vision step of the checkpoint at `path`, None for a text-only model (or a
    family kvroute does not serve images for, with a warning)."""
    if "vision_config" not in model_config:
        return None
    kind = model_config.get("model_type")
    if kind not in FAMILIES:
        log.warning("%s models are served without images (kvroute's vision families: %s)",
                    kind, ", ".join(FAMILIES))
        return None
    try:
        load = _gemma3 if kind == "gemma3" else _mistral3
        return load(Path(path), model_config, model, tokenizer)
    except ImportError as exc:
        log.warning("serving %s without images: %s (install kvroute's `vision` extra, "
                    "scripts/install.sh does)", path, exc)
        return None


def _vision_weights(path: Path, prefix: str) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for file in sorted(path.glob("*.safetensors")):
        for k, v in mx.load(str(file)).items():
            if k.startswith(prefix):
                out[k[len(prefix):]] = v
    return out


def _load_module(module: nn.Module, weights: dict[str, mx.array], config: dict) -> None:
    quant = config.get("quantization") or {}
    if any(k.endswith(".scales") for k in weights):
        nn.quantize(module, group_size=quant.get("group_size", 64), bits=quant.get("bits", 4),
                    class_predicate=lambda p, _m: f"{p}.scales" in weights)
    module.load_weights(list(weights.items()))
    # Every array, those of helper objects too (Pixtral's rotary frequencies): one left
    # lazy on this loading thread fails on the engine thread, where MLX finds no stream.
    values = [v for _, m in module.named_modules() for v in [*m.values(), *vars(m).values()]]
    values += [a for v in values if hasattr(v, "__dict__") and not isinstance(v, nn.Module)
               for a in vars(v).values()]
    mx.eval([v for v in values if isinstance(v, mx.array)])
    mx.eval(module.parameters())


def _gemma3(path: Path, config: dict, model: Any, tokenizer: Any) -> Vision:
    from mlx_vlm.models.gemma3 import config as configs
    from mlx_vlm.models.gemma3.gemma3 import Gemma3MultiModalProjector
    from mlx_vlm.models.gemma3.vision import VisionModel as Tower

    from kvroute.devtools.vision_models import vlm_config

    cfg = vlm_config(configs, config)
    # Hugging Face's config says it at the top, mlx-vlm's projector reads the text's.
    cfg.text_config.mm_tokens_per_image = int(config.get("mm_tokens_per_image") or config[
        "text_config"].get("mm_tokens_per_image", 256))
    tower, projector = Tower(cfg.vision_config), Gemma3MultiModalProjector(cfg)
    _load_module(tower, tower.sanitize(_vision_weights(path, "vision_tower.")), config)
    _load_module(projector, _vision_weights(path, "multi_modal_projector."), config)
    hidden = cfg.text_config.hidden_size
    image_token = config.get("image_token_index", 262144)
    vocab = tokenizer._tokenizer if hasattr(tokenizer, "_tokenizer") else tokenizer
    token = vocab.convert_ids_to_tokens(image_token)
    boi = vocab.convert_ids_to_tokens(config.get("boi_token_index", 255999))
    eoi = vocab.convert_ids_to_tokens(config.get("eoi_token_index", 256000))
    processor = _processor_config(path)

    def encode(pixels: mx.array) -> mx.array:
        hidden_state, _, _ = tower(pixels.astype(projector.mm_input_projection_weight.dtype),
                                   output_hidden_states=True)
        # As mlx-vlm's Gemma 3: the language model scales every input embedding by
        # sqrt(hidden), so image features enter divided by it.
        return projector(hidden_state)[0] / (hidden ** 0.5)

    prompt = ImagePrompt(
        # Gemma 3's processor writes each image as "\n\n<boi>" + 256 soft tokens +
        # "<eoi>\n\n" where the template put <boi>.
        image_text=f"\n\n{boi}{token * cfg.text_config.mm_tokens_per_image}{eoi}\n\n",
        image_token_id=image_token,
        tokens_per_image=cfg.text_config.mm_tokens_per_image,
        image_size=cfg.vision_config.image_size,
        mean=tuple(processor.get("image_mean", (0.5, 0.5, 0.5))),
        std=tuple(processor.get("image_std", (0.5, 0.5, 0.5))),
    )
    embed = model.language_model.model.embed_tokens
    log.info("vision: gemma3, %d tokens per image, %dx%d pixels", prompt.tokens_per_image,
             prompt.image_size, prompt.image_size)
    return Vision(prompt, encode, embed)


def _mistral3(path: Path, config: dict, model: Any, tokenizer: Any) -> Vision:
    from mlx_vlm.models.mistral3 import config as configs
    from mlx_vlm.models.mistral3.mistral3 import Mistral3MultiModalProjector
    from mlx_vlm.models.pixtral.vision import VisionModel as Tower

    from kvroute.devtools.vision_models import vlm_config

    cfg = vlm_config(configs, config)
    tower, projector = Tower(cfg.vision_config), Mistral3MultiModalProjector(cfg)
    _load_module(tower, tower.sanitize(_vision_weights(path, "vision_tower.")), config)
    _load_module(projector, _vision_weights(path, "multi_modal_projector."), config)
    vocab = tokenizer._tokenizer if hasattr(tokenizer, "_tokenizer") else tokenizer
    image_token = cfg.image_token_index if cfg.image_token_index is not None else 10
    processor = _processor_config(path)
    patch = processor.get("patch_size", cfg.vision_config.patch_size)
    patch = patch.get("height", cfg.vision_config.patch_size) if isinstance(patch, dict) else patch
    longest = (processor.get("size") or {}).get("longest_edge", cfg.vision_config.image_size)

    def encode(pixels: mx.array) -> mx.array:
        sizes = [tuple(pixels.shape[1:3])]
        _, states = tower(pixels, output_hidden_states=True, image_sizes=sizes)
        features = states[cfg.vision_feature_layer][0]
        return projector(features, sizes)

    prompt = PixtralPrompt(
        image_text="", image_token_id=image_token, tokens_per_image=0, image_size=longest,
        mean=tuple(processor.get("image_mean", (0.48145466, 0.4578275, 0.40821073))),
        std=tuple(processor.get("image_std", (0.26862954, 0.26130258, 0.27577711))),
        cell=patch * cfg.spatial_merge_size,
        image_token=vocab.convert_ids_to_tokens(image_token),  # [IMG]; [IMG_BREAK], [IMG_END]
    )
    embed = model.language_model.model.embed_tokens
    log.info("vision: mistral3 (Pixtral), images up to %d pixels a side in %d-pixel cells",
             longest, prompt.cell)
    return Vision(prompt, encode, embed)


def _processor_config(path: Path) -> dict:
    file = path / "preprocessor_config.json"
    try:
        return json.loads(file.read_text()) if file.is_file() else {}
    except (OSError, ValueError):
        return {}

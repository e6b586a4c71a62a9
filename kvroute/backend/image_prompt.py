"""Images in a prompt: where the template puts them, the tokens that stand for them,
and their pixels.

A chat message's image parts become a sentinel in its text (requests.py), which the
chat template renders where the image goes; `ImagePrompt.render` replaces each
sentinel with the model's own image text (Gemma 3: a begin marker, its image tokens,
an end marker, as its processor writes it) and says which image came where. After
tokenizing, each image's run of image tokens becomes the image's ids (`substitute`,
length for length, so checkpoint positions hold): negative ids
derived from the SHA-256 of the image's bytes and the position in the run. The
store, the checkpoints and every prefix match see those ids, so the same image at
the same place is the same prefix (a cache hit that skips the vision encoder too)
and another image never is. The engine's model (vision.py) embeds them.

mlx-free: pixels are numpy arrays, made off the event loop with Pillow.
"""

from __future__ import annotations

import io
import re
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from kvroute.core.images import DecodedImage, ImageError, decode_data_url

_SENTINEL = "\ue000kvroute-image-{}\ue000"  # a private-use character: no template writes it
_SENTINEL_RE = re.compile("\ue000kvroute-image-([0-9]+)\ue000")
# Images larger than this many pixels are refused before they are decoded (a small
# PNG can unpack to gigabytes).
MAX_PIXELS = 50_000_000
_ID_SPACE = (1 << 31) - 2  # image ids are -1 .. -(2**31 - 1): int32, never a vocabulary id


def sentinel(k: int) -> str:
    """What the k-th image of a request is written as in its message's text."""
    return _SENTINEL.format(k)


def image_ids(sha256: bytes, n: int) -> list[int]:
    """The `n` token ids standing for an image: each a 31-bit hash of the image's
    SHA-256 and its place in the run, negative so no vocabulary has it. Two images
    share a cached prefix only if their first ids collide (2**-31) and every other."""
    return [-1 - xxhash.xxh3_64_intdigest(sha256 + struct.pack("<I", i)) % _ID_SPACE
            for i in range(n)]


@dataclass(frozen=True)
class Pixels:
    """An image decoded and preprocessed for the vision encoder."""

    sha256: bytes
    values: np.ndarray  # (1, height, width, channels) float32, normalized


@dataclass(frozen=True)
class ImagePrompt:
    """What one model family writes for an image and how its encoder takes pixels."""

    image_text: str  # what the template's image becomes: `tokens_per_image` image tokens
    image_token_id: int
    tokens_per_image: int
    image_size: int
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    max_bytes: int | None = None

    def render(self, text: str) -> tuple[str, list[int]]:
        """`text` with each sentinel replaced by the image text, and the request's
        image indices in the order they now appear."""
        order: list[int] = []

        def one(m: re.Match) -> str:
            order.append(int(m.group(1)))
            return self.image_text

        return _SENTINEL_RE.sub(one, text), order

    def substitute(self, tokens: list[int], shas: list[bytes]) -> list[int]:
        """`tokens` with the k-th run of image tokens replaced by the ids of the k-th
        image (same length: checkpoint positions stay). ImageError when the text holds
        other image tokens (a client who typed the model's image token)."""
        n = self.tokens_per_image
        at = [i for i, t in enumerate(tokens) if t == self.image_token_id]
        runs = [at[k:k + n] for k in range(0, len(at), n)]
        if len(at) != n * len(shas) or any(r[-1] - r[0] != n - 1 for r in runs):
            raise ImageError(f"the prompt has {len(at)} image tokens for {len(shas)} images; "
                             "the text may not contain the model's image token")
        if at and at[-1] == len(tokens) - 1:
            raise ImageError("a prompt may not end with an image")
        out = list(tokens)
        for run, sha in zip(runs, shas):
            out[run[0]:run[0] + n] = image_ids(sha, n)
        return out

    def pixels(self, url: Any) -> Pixels:
        """An image part's URL decoded, checked and preprocessed (ImageError: a 400)."""
        image = decode_data_url(url, **({"max_bytes": self.max_bytes} if self.max_bytes else {}))
        return Pixels(image.sha256, self._preprocess(image))

    def _preprocess(self, image: DecodedImage) -> np.ndarray:
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(io.BytesIO(image.data)) as im:
                if im.width * im.height > MAX_PIXELS:
                    raise ImageError(f"the image is {im.width}x{im.height} pixels, over "
                                     f"{MAX_PIXELS}")
                # As the model's image processor: RGB, resized to the encoder's square
                # (bilinear), scaled to [0, 1], normalized.
                rgb = im.convert("RGB").resize((self.image_size, self.image_size),
                                               Image.Resampling.BILINEAR)
                values = np.asarray(rgb, dtype=np.float32) / 255.0
        except (UnidentifiedImageError, Image.DecompressionBombError, OSError, SyntaxError,
                ValueError) as exc:
            if isinstance(exc, ImageError):
                raise
            raise ImageError(f"the image could not be decoded ({type(exc).__name__})") from None
        values = (values - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
        return values[None]

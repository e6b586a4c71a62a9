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
    """An image decoded and preprocessed for the vision encoder, and what the prompt
    holds for it."""

    sha256: bytes
    values: np.ndarray  # (1, height, width, channels) float32, normalized
    text: str  # the model's image text for it (its image tokens and markers)
    tokens: int  # image tokens in `text`: the rows the encoder gives for it


@dataclass(frozen=True)
class ImagePrompt:
    """What one model family writes for an image and how its encoder takes pixels:
    here a fixed square and a fixed text (Gemma 3); `PixtralPrompt` sizes both by the
    image."""

    image_text: str  # what the template's image becomes: `tokens_per_image` image tokens
    image_token_id: int
    tokens_per_image: int
    image_size: int
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    max_bytes: int | None = None

    def layout(self, width: int, height: int) -> tuple[tuple[int, int], str, int]:
        """(width, height) to resize an image to, its text and its image tokens."""
        return (self.image_size, self.image_size), self.image_text, self.tokens_per_image

    def render(self, text: str, texts: list[str]) -> tuple[str, list[int]]:
        """`text` with sentinel k replaced by `texts[k]` (the request's k-th image), as
        a model's processor replaces the template's image marker; and the request's
        image indices in the order they now appear. ImageError for a sentinel of no
        image (a client who typed it)."""
        order: list[int] = []

        def one(m: re.Match) -> str:
            k = int(m.group(1))
            if k >= len(texts):
                raise ImageError("the text holds kvroute's image marker")
            order.append(k)
            return texts[k]

        return _SENTINEL_RE.sub(one, text), order

    def substitute(self, tokens: list[int], images: list[Pixels]) -> list[int]:
        """`tokens` with the image tokens of each image, in order, replaced by its ids
        (same length: checkpoint positions stay). ImageError when the text holds other
        image tokens (a client who typed the model's image token)."""
        at = [i for i, t in enumerate(tokens) if t == self.image_token_id]
        if len(at) != sum(p.tokens for p in images):
            raise ImageError(f"the prompt has {len(at)} image tokens for {len(images)} images; "
                             "the text may not contain the model's image token")
        if at and at[-1] == len(tokens) - 1:
            raise ImageError("a prompt may not end with an image")
        out, i = list(tokens), 0
        for p in images:
            for position, token in zip(at[i:i + p.tokens], image_ids(p.sha256, p.tokens)):
                out[position] = token
            i += p.tokens
        return out

    def pixels(self, url: Any, decode: bool = True) -> Pixels:
        """An image part's URL decoded, checked and preprocessed (ImageError: a 400);
        without `decode`, only its header is read: its text and tokens, no pixels."""
        image = decode_data_url(url, **({"max_bytes": self.max_bytes} if self.max_bytes else {}))
        values, text, tokens = self._preprocess(image, decode)
        return Pixels(image.sha256, values, text, tokens)

    def _preprocess(self, image: DecodedImage, decode: bool = True) -> tuple[np.ndarray, str, int]:
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(io.BytesIO(image.data)) as im:
                if im.width * im.height > MAX_PIXELS:
                    raise ImageError(f"the image is {im.width}x{im.height} pixels, over "
                                     f"{MAX_PIXELS}")
                size, text, tokens = self.layout(im.width, im.height)
                if not decode:
                    return np.zeros((0,), np.float32), text, tokens
                # As the model's image processor: RGB, resized (bilinear), scaled to
                # [0, 1], normalized.
                rgb = im.convert("RGB").resize(size, Image.Resampling.BILINEAR)
                values = np.asarray(rgb, dtype=np.float32) / 255.0
        except (UnidentifiedImageError, Image.DecompressionBombError, OSError, SyntaxError,
                ValueError) as exc:
            if isinstance(exc, ImageError):
                raise
            raise ImageError(f"the image could not be decoded ({type(exc).__name__})") from None
        values = (values - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
        return values[None], text, tokens


@dataclass(frozen=True)
class PixtralPrompt(ImagePrompt):
    """Pixtral's layout (Mistral 3): the image keeps its aspect ratio within
    `image_size` on its longer side, in whole cells of `cell` pixels (a patch times
    the spatial merge); each row of cells is that many image tokens and a row break,
    the last row ending with the image end instead."""

    cell: int = 28
    row_break: str = "[IMG_BREAK]"
    image_end: str = "[IMG_END]"
    image_token: str = "[IMG]"

    def layout(self, width: int, height: int) -> tuple[tuple[int, int], str, int]:
        ratio = max(width / self.image_size, height / self.image_size)
        if ratio > 1:
            width, height = int(width / ratio), int(height / ratio)
        cols, rows = (width - 1) // self.cell + 1, (height - 1) // self.cell + 1
        text = (self.image_token * cols + self.row_break) * rows
        text = text[:-len(self.row_break)] + self.image_end
        return (cols * self.cell, rows * self.cell), text, cols * rows

"""An image in a request: a `data:` URL decoded to its bytes, checked and named.

Proxy and backend both read images from request bodies: the proxy to put each
image's content hash into the prefix chain (core/prefix.py), the backend to hand
the bytes to the model's vision encoder (backend/vision.py). Both take them
through `decode_data_url`, so both refuse the same images with the same message.
Only `data:` URLs are taken here: a proxy whose operator enabled fetching has already
turned http(s) URLs into them (kvroute/proxy/image_fetch.py); a backend never fetches.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass
from typing import Any, Iterator

# Decoded bytes of one image: a 4k screenshot as PNG is a few MB.
MAX_IMAGE_BYTES = 20 * 1024 * 1024
# The image types taken, by media type, with the bytes each format starts with:
# the declared type must match what the bytes are.
FORMATS = {
    "image/png": b"\x89PNG\r\n\x1a\n",
    "image/jpeg": b"\xff\xd8\xff",
    "image/jpg": b"\xff\xd8\xff",
}


class ImageError(ValueError):
    """An image the request cannot have: the message says why (a 400)."""


@dataclass(frozen=True)
class DecodedImage:
    media_type: str
    data: bytes
    sha256: bytes  # of `data`: names the image in prefix keys and in the model's tokens


def decode_data_url(url: Any, max_bytes: int = MAX_IMAGE_BYTES) -> DecodedImage:
    """`data:image/png;base64,...` as its bytes; ImageError for anything else."""
    if not isinstance(url, str):
        raise ImageError("image_url.url must be a string")
    if not url.startswith("data:"):
        kind = url.split(":", 1)[0][:10] if ":" in url else "no scheme"
        raise ImageError(f"only data: URLs are supported for images (got {kind!r}); "
                         "send the image inline as data:image/png;base64,...")
    head, sep, payload = url[5:].partition(",")
    parts = head.split(";")
    media_type = parts[0].strip().lower()
    if not sep or "base64" not in parts[1:]:
        raise ImageError("an image data URL must be base64: data:<type>;base64,<data>")
    if media_type not in FORMATS:
        raise ImageError(f"image type {media_type or 'none'!r} is not supported; "
                         "send image/png or image/jpeg")
    # A base64 text 4/3 the size of the limit is refused before decoding it.
    if len(payload) > (max_bytes + 2) // 3 * 4 + 4:
        raise ImageError(f"the image is over {max_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the image's base64 data is not valid") from None
    if len(data) > max_bytes:
        raise ImageError(f"the image is over {max_bytes} bytes")
    if not data.startswith(FORMATS[media_type]):
        raise ImageError(f"the image data is not {media_type}")
    return DecodedImage(media_type, data, hashlib.sha256(data).digest())


def image_url_of(part: Any) -> Any:
    """The URL of an OpenAI chat `image_url` content part (the object or a bare
    string, as some clients send it), None when the part has none."""
    ref = part.get("image_url") if isinstance(part, dict) else None
    return ref.get("url") if isinstance(ref, dict) else ref


def is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


def image_parts(messages: Any) -> Iterator[dict]:
    """Every image part of chat `messages`, in order."""
    if not isinstance(messages, list):
        return
    for msg in messages:
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, list):
            yield from (p for p in content if is_image_part(p))
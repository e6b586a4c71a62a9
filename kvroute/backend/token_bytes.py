"""A token's own bytes, for the `bytes` of a logprob entry.

Decoded alone, a token that holds part of a multi-byte character (byte-level BPE
splits an emoji into four) is U+FFFD, whose UTF-8 is three bytes none of which the
model wrote. OpenAI's `bytes` are the token's real bytes, so that a client can join
them back into the text. Byte-level BPE vocabularies (Qwen, Llama 3, gpt-oss) spell
each byte as one character, and SentencePiece ones write a raw byte as `<0xNN>` and
a space as `▁`; any other token is its decoded text.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from mlx_lm import tokenizer_utils
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

_SPM_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenBytes:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        self.pieces = getattr(hf, "convert_ids_to_tokens", None)
        kind = type(getattr(tokenizer, "detokenizer", None))
        self.kind = ("bpe" if issubclass(kind, BPEStreamingDetokenizer)
                     else "spm" if issubclass(kind, SPMStreamingDetokenizer) else "")
        self.special = set(getattr(hf, "all_special_ids", []) or [])
        try:  # GPT-2's byte <-> character map, as mlx-lm's detokenizer reads it
            self.decoder: dict[str, int] = tokenizer_utils._byte_decoder()
        except AttributeError:  # not in this mlx-lm: decoded text, as for other tokens
            self.decoder, self.kind = {}, "" if self.kind == "bpe" else self.kind

    @functools.lru_cache(maxsize=65536)
    def __call__(self, token_id: int) -> list[int]:
        piece = self.pieces(token_id) if self.pieces and token_id not in self.special else None
        if isinstance(piece, str) and self.kind == "bpe" and all(c in self.decoder for c in piece):
            return [self.decoder[c] for c in piece]
        if isinstance(piece, str) and self.kind == "spm":
            if m := _SPM_BYTE.fullmatch(piece):
                return [int(m.group(1), 16)]
            return list(piece.replace("\u2581", " ").encode())
        return list(self.tokenizer.decode([token_id]).encode())

    @functools.lru_cache(maxsize=65536)
    def text(self, token_id: int) -> str:
        """The `token` of a logprob entry. A SentencePiece word piece decoded alone loses
        its leading space (`▁world` -> "world"), so its text is its bytes' (" world"), as
        OpenAI's tokens read; a byte-level BPE token decodes to its text alone."""
        if self.kind == "spm":
            return bytes(self(token_id)).decode("utf-8", errors="replace")
        return self.tokenizer.decode([token_id])

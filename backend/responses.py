"""OpenAI response bodies: chat.completion(.chunk) and text_completion objects."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from .engine import Delta, Finish


def _usage(f: Finish) -> dict:
    return {
        "prompt_tokens": f.prompt_tokens,
        "completion_tokens": f.completion_tokens,
        "total_tokens": f.prompt_tokens + f.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": f.cached_tokens},
    }


def _token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8"))


def chat_logprobs(entries: list[dict]) -> dict:
    return {
        "content": [
            {
                "token": e["token"],
                "logprob": e["logprob"],
                "bytes": _token_bytes(e["token"]),
                "top_logprobs": [
                    {"token": t, "logprob": v, "bytes": _token_bytes(t)} for t, v in e["top"]
                ],
            }
            for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(entries: list[dict], offset: int) -> dict:
    tokens, token_logprobs, top, offsets = [], [], [], []
    for e in entries:
        tokens.append(e["token"])
        token_logprobs.append(e["logprob"])
        top.append(dict(e["top"]))
        offsets.append(offset)
        offset += len(e["token"])
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


@dataclass
class ChatBuilder:
    """Builds one chat completion, streamed or whole, with a single id."""

    model: str
    logprobs: bool = False
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    text: list[str] = field(default_factory=list)
    tool_calls: list[dict] = field(default_factory=list)
    logprob_entries: list[dict] = field(default_factory=list)

    def _chunk(self, choices: list[dict], usage: dict | None = None, with_usage: bool = False) -> dict:
        out = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }
        if with_usage:
            out["usage"] = usage
        return out

    def first_chunk(self, with_usage: bool) -> dict:
        delta = {"role": "assistant", "content": ""}
        return self._chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}],
                           with_usage=with_usage)

    def delta_chunk(self, d: Delta, with_usage: bool) -> dict:
        delta: dict = {}
        if d.text:
            delta["content"] = d.text
        if d.tool_calls:
            delta["tool_calls"] = [
                {"index": len(self.tool_calls) + i, **call} for i, call in enumerate(d.tool_calls)
            ]
            self.tool_calls += d.tool_calls
        logprobs = chat_logprobs(d.logprobs) if self.logprobs and d.logprobs else None
        return self._chunk(
            [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": None}],
            with_usage=with_usage,
        )

    def finish_chunk(self, f: Finish, with_usage: bool) -> dict:
        return self._chunk(
            [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": f.reason}],
            with_usage=with_usage,
        )

    def usage_chunk(self, f: Finish) -> dict:
        return self._chunk([], _usage(f), with_usage=True)

    def add(self, d: Delta) -> None:
        self.text.append(d.text)
        self.tool_calls += d.tool_calls
        self.logprob_entries += d.logprobs

    def whole(self, f: Finish) -> dict:
        text = "".join(self.text)
        message: dict = {"role": "assistant", "content": text if text or not self.tool_calls else None}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        message["refusal"] = None
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": chat_logprobs(self.logprob_entries) if self.logprobs else None,
                    "finish_reason": f.reason,
                }
            ],
            "usage": _usage(f),
        }


@dataclass
class CompletionBuilder:
    model: str
    logprobs: bool = False
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    text: list[str] = field(default_factory=list)
    logprob_entries: list[dict] = field(default_factory=list)
    offset: int = 0

    def _chunk(self, choices: list[dict], usage: dict | None = None, with_usage: bool = False) -> dict:
        out = {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }
        if with_usage:
            out["usage"] = usage
        return out

    def first_chunk(self, with_usage: bool) -> dict | None:
        return None  # completions streams have no role preamble

    def delta_chunk(self, d: Delta, with_usage: bool) -> dict:
        text = d.text
        logprobs = completion_logprobs(d.logprobs, self.offset) if self.logprobs else None
        self.offset += len(text)
        return self._chunk(
            [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": None}],
            with_usage=with_usage,
        )

    def finish_chunk(self, f: Finish, with_usage: bool) -> dict:
        return self._chunk(
            [{"index": 0, "text": "", "logprobs": None, "finish_reason": f.reason}],
            with_usage=with_usage,
        )

    def usage_chunk(self, f: Finish) -> dict:
        return self._chunk([], _usage(f), with_usage=True)

    def add(self, d: Delta) -> None:
        self.text.append(d.text)
        self.logprob_entries += d.logprobs

    def whole(self, f: Finish) -> dict:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [
                {
                    "index": 0,
                    "text": "".join(self.text),
                    "logprobs": completion_logprobs(self.logprob_entries, 0) if self.logprobs else None,
                    "finish_reason": f.reason,
                }
            ],
            "usage": _usage(f),
        }

"""OpenAI response bodies: chat.completion(.chunk) and text_completion objects."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from .jobs import Delta, Finish


def _usage(f: Finish) -> dict:
    return {
        "prompt_tokens": f.prompt_tokens,
        "completion_tokens": f.completion_tokens,
        "total_tokens": f.prompt_tokens + f.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": f.cached_tokens},
    }


def _stop_reason(f: Finish) -> dict:
    # finish_reason "stop" does not say whether EOS or a stop string ended the reply; the
    # proxy's Messages API must (stop_reason "stop_sequence" and which one). vLLM's name
    # for the field; absent otherwise, so plain chat answers keep their usual shape.
    return {"stop_reason": f.stop} if f.stop is not None else {}


def chat_logprobs(entries: list[dict]) -> dict:
    return {
        "content": [
            {
                "token": e["token"],
                "logprob": e["logprob"],
                "bytes": e["bytes"],  # the token's own (engine.py, `_named_logprobs`)
                "top_logprobs": [
                    {"token": t, "logprob": v, "bytes": b}
                    for (t, v), b in zip(e["top"], e["top_bytes"])
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
class _Builder:
    """What chat and text completions share: one id per response, the envelope."""

    model: str
    logprobs: bool = False
    index: int = 0  # the choice (n > 1: one builder per choice, sharing id and created)
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    text: list[str] = field(default_factory=list)
    logprob_entries: list[dict] = field(default_factory=list)

    CHUNK_OBJECT = WHOLE_OBJECT = ID_PREFIX = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"{self.ID_PREFIX}{uuid.uuid4().hex}"

    def _envelope(self, obj: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices, **extra}

    def _chunk(self, choice: dict | None, with_usage: bool) -> dict:
        # With include_usage, every chunk carries "usage": null but the last.
        extra = {"usage": None} if with_usage else {}
        return self._envelope(self.CHUNK_OBJECT, [choice] if choice else [], **extra)

    def usage_chunk(self, f: Finish) -> dict:
        return self._envelope(self.CHUNK_OBJECT, [], usage=_usage(f))

    def _whole(self, choice: dict, f: Finish) -> dict:
        return self._envelope(self.WHOLE_OBJECT, [choice], usage=_usage(f))


@dataclass
class ChatBuilder(_Builder):
    """Builds one chat completion, streamed or whole."""

    tool_calls: list[dict] = field(default_factory=list)

    CHUNK_OBJECT, WHOLE_OBJECT, ID_PREFIX = "chat.completion.chunk", "chat.completion", "chatcmpl-"

    def first_chunk(self, with_usage: bool) -> dict:
        delta = {"role": "assistant", "content": ""}
        return self._chunk({"index": self.index, "delta": delta, "logprobs": None,
                            "finish_reason": None}, with_usage)

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
        return self._chunk({"index": self.index, "delta": delta, "logprobs": logprobs,
                            "finish_reason": None}, with_usage)

    def finish_chunk(self, f: Finish, with_usage: bool) -> dict:
        return self._chunk({"index": self.index, "delta": {}, "logprobs": None,
                            "finish_reason": f.reason, **_stop_reason(f)}, with_usage)

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
        logprobs = chat_logprobs(self.logprob_entries) if self.logprobs else None
        return self._whole({"index": self.index, "message": message, "logprobs": logprobs,
                            "finish_reason": f.reason, **_stop_reason(f)}, f)


@dataclass
class CompletionBuilder(_Builder):
    """Builds one text completion, streamed or whole."""

    offset: int = 0  # characters streamed so far, for logprobs' text_offset

    CHUNK_OBJECT = WHOLE_OBJECT = "text_completion"
    ID_PREFIX = "cmpl-"

    def first_chunk(self, with_usage: bool) -> None:
        return None  # completions streams have no role preamble

    def delta_chunk(self, d: Delta, with_usage: bool) -> dict:
        logprobs = completion_logprobs(d.logprobs, self.offset) if self.logprobs else None
        self.offset += len(d.text)
        return self._chunk({"index": self.index, "text": d.text, "logprobs": logprobs,
                            "finish_reason": None}, with_usage)

    def finish_chunk(self, f: Finish, with_usage: bool) -> dict:
        return self._chunk({"index": self.index, "text": "", "logprobs": None,
                            "finish_reason": f.reason}, with_usage)

    def add(self, d: Delta) -> None:
        self.text.append(d.text)
        self.logprob_entries += d.logprobs

    def whole(self, f: Finish) -> dict:
        logprobs = completion_logprobs(self.logprob_entries, 0) if self.logprobs else None
        return self._whole({"index": self.index, "text": "".join(self.text), "logprobs": logprobs,
                            "finish_reason": f.reason}, f)

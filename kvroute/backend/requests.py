"""A chat or completion request as the backend takes it: the body validated by its
model (kvroute/api/chat.py) and turned into what the chat template and the engine take
(messages normalised for the template, the sampling parameters)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from kvroute.api.chat import (ChatCompletionBody, CompletionBody, Content, GenerationBody,
                              ImageURLPart)
from kvroute.api.validation import validate

from .image_prompt import sentinel


@dataclass
class SamplingParams:
    """What the sampler and the logits processors take (kvroute/backend/sampling.py)."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    stop: list[str] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)


@dataclass
class ChatRequest:
    model: str
    messages: list[dict]  # normalised for the chat template
    tools: list[dict] | None
    stream: bool
    include_usage: bool
    params: SamplingParams
    fault: str | None = None
    # The data URLs of the messages' images; message k's text holds sentinel(k) where
    # its image goes (image_prompt.py).
    images: list[str] = field(default_factory=list)
    image_texts: list[str] = field(default_factory=list)  # the model's text for each image


@dataclass
class CompletionRequest:
    model: str
    prompt: str
    stream: bool
    include_usage: bool
    params: SamplingParams
    fault: str | None = None


def parse_chat(body: dict) -> ChatRequest:
    req = validate(ChatCompletionBody, body)
    params = _sampling(req)
    # max_completion_tokens, the newer name, wins over max_tokens.
    params.max_tokens = req.max_completion_tokens or req.max_tokens
    params.logprobs = bool(req.logprobs)
    params.top_logprobs = req.top_logprobs or 0
    tools = body["tools"] if req.tools and req.tool_choice != "none" else None  # as sent
    images: list[str] = []
    return ChatRequest(model=req.model, messages=[_message(m, images) for m in req.messages],
                       tools=tools, stream=bool(req.stream), include_usage=_include_usage(req),
                       params=params, fault=_fault(body), images=images)


def parse_completion(body: dict) -> CompletionRequest:
    req = validate(CompletionBody, body)
    params = _sampling(req)
    params.max_tokens = req.max_tokens
    if req.logprobs is not None:
        params.logprobs, params.top_logprobs = True, req.logprobs
    prompt = req.prompt if isinstance(req.prompt, str) else req.prompt[0]
    return CompletionRequest(model=req.model, prompt=prompt, stream=bool(req.stream),
                             include_usage=_include_usage(req), params=params,
                             fault=_fault(body))


def _sampling(req: GenerationBody) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else req.stop or []
    return SamplingParams(
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        seed=None if req.seed is None else req.seed % (1 << 64),
        stop=[s for s in stop if s],
        presence_penalty=float(req.presence_penalty or 0.0),
        frequency_penalty=float(req.frequency_penalty or 0.0),
        logit_bias={int(k): float(v) for k, v in (req.logit_bias or {}).items()},
    )


def _include_usage(req: GenerationBody) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _fault(body: dict) -> str | None:
    """The testing-only fault a backend started with --enable-faults honours."""
    fault = body.get("kvroute_fault")
    return fault if isinstance(fault, str) else None


def _text(content: Content | None, images: list[str]) -> str:
    """The content as text; each image becomes a sentinel, its URL appended to `images`."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = []
    for p in content:
        if isinstance(p, ImageURLPart):
            out.append(sentinel(len(images)))
            images.append(p.image_url.url)
        else:
            out.append(p.text)
    return "".join(out)


def _arguments(raw: str | dict) -> Any:
    # Templates render arguments with `tojson`; a JSON string would be encoded twice.
    if isinstance(raw, dict):
        return raw
    try:
        return orjson.loads(raw) if raw.strip() else {}
    except orjson.JSONDecodeError:
        return raw


def _message(msg: Any, images: list[str]) -> dict:
    out: dict = {"role": msg.role, "content": _text(msg.content, images)}
    if msg.name is not None:
        out["name"] = msg.name
    if msg.role == "assistant" and msg.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
            for c in msg.tool_calls]
    if msg.role == "tool":
        out["tool_call_id"] = msg.tool_call_id
    return out

"""A chat or completion request as the backend takes it: the body validated by its
model (kvroute/api/chat.py) and turned into what the chat template and the engine take
(messages normalised for the template, the sampling parameters)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from kvroute.api.chat import (AssistantContent, ChatCompletionBody, CompletionBody,
                              GenerationBody, ImageURLPart, RefusalPart)
from kvroute.api.errors import bad_request
from kvroute.api.validation import validate

from . import grammar
from .grammar import GrammarError, GrammarSpec
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
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int = 20


@dataclass
class ChatRequest:
    model: str
    messages: list[dict]  # normalised for the chat template
    tools: list[dict] | None
    stream: bool
    include_usage: bool
    params: SamplingParams
    fault: str | None = None
    n: int = 1  # choices
    grammar: GrammarSpec | None = None  # what the answer must be (response_format, tool_choice)
    # The data URLs of the messages' images; message k's text holds sentinel(k) where
    # its image goes (image_prompt.py).
    images: list[str] = field(default_factory=list)
    image_texts: list[str] = field(default_factory=list)  # the model's text for each image


@dataclass
class CompletionRequest:
    model: str
    prompt: str | list[int]  # its text, or its token ids as the client gave them
    stream: bool
    include_usage: bool
    params: SamplingParams
    fault: str | None = None
    n: int = 1  # choices


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
                       params=params, fault=_fault(body), n=req.n or 1, images=images,
                       grammar=_grammar(req, tools))


def _grammar(req: ChatCompletionBody, tools: list[dict] | None) -> GrammarSpec | None:
    """The grammar a forced tool choice or a JSON response_format asks for."""
    try:
        return _spec(req, tools)
    except GrammarError as e:
        raise bad_request(str(e), e.param, "invalid_value") from None


def _spec(req: ChatCompletionBody, tools: list[dict] | None) -> GrammarSpec | None:
    choice, fmt = req.tool_choice, req.response_format
    if tools and choice == "required":
        # OpenAI's default allows several calls; one when parallel_tool_calls is false.
        return grammar.tool_call(tools, parallel=req.parallel_tool_calls is not False)
    if tools and choice is not None and not isinstance(choice, str):
        return grammar.tool_call(tools, name=choice.function.name)
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return grammar.json_object()
    return grammar.json_schema(fmt.json_schema.schema_)


def parse_completion(body: dict) -> CompletionRequest:
    req = validate(CompletionBody, body)
    params = _sampling(req)
    params.max_tokens = req.max_tokens
    if req.logprobs is not None:
        params.logprobs, params.top_logprobs = True, req.logprobs
    prompt = req.prompt
    if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):  # a list of one
        prompt = prompt[0]
    return CompletionRequest(model=req.model, prompt=prompt, stream=bool(req.stream),
                             include_usage=_include_usage(req), params=params,
                             fault=_fault(body), n=req.n or 1)


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
        top_k=req.top_k or 0,
        min_p=float(req.min_p or 0.0),
        repetition_penalty=1.0 if req.repetition_penalty is None else float(req.repetition_penalty),
        repetition_context_size=req.repetition_context_size or 20,
    )


def _include_usage(req: GenerationBody) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _fault(body: dict) -> str | None:
    """The testing-only fault a backend started with --enable-faults honours."""
    fault = body.get("kvroute_fault")
    return fault if isinstance(fault, str) else None


def _text(content: AssistantContent | None, images: list[str]) -> str:
    """The content as text; each image becomes a sentinel, its URL appended to `images`;
    a refusal is the text the model wrote."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = []
    for p in content:
        if isinstance(p, ImageURLPart):
            out.append(sentinel(len(images)))
            images.append(p.image_url.url)
        elif isinstance(p, RefusalPart):
            out.append(p.refusal)
        else:
            out.append(p.text)
    return "".join(out)


def _arguments(raw: str) -> Any:
    # Templates render arguments with `tojson`; a JSON string would be encoded twice.
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

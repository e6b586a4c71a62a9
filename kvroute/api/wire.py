"""OpenAI request types: the chat and completion bodies, validated into dataclasses.

`ChatCompletionBody` and `CompletionBody` are the one definition of what a client may
send (kvroute/openapi.py describes them from these models); `parse_chat` and
`parse_completion` validate a body with them and turn it into what the engine and the
chat template take. Parameters kvroute does not implement are refused with a 400
rather than silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union

import orjson
from pydantic import Field, StringConstraints, WithJsonSchema, model_validator

from .errors import bad_request
from .validation import Body, invalid, only, refusing, validate

MAX_STOP = 4
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
# The routes, spelled once: the servers add them, /openapi.json describes them.
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
MODELS_PATH = "/v1/models"
RESPONSES_PATH = "/v1/responses"  # the proxy's only, as are the two below
MESSAGES_PATH = "/v1/messages"
MESSAGES_COUNT_PATH = "/v1/messages/count_tokens"
HEALTH_PATH = "/health"
# The backend's internal token count of a chat body (under /v1, so it takes the internal
# token like the rest): the proxy's Anthropic count_tokens asks it, having no tokenizer.
COUNT_TOKENS_PATH = "/v1/kvroute/count_tokens"
# Headers of every SSE answer, the backend's and the proxy's.
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}

NonEmpty = Annotated[str, StringConstraints(min_length=1)]
Stop = Union[str, Annotated[list[str], Field(max_length=MAX_STOP)]]


# -- what a client sends -----------------------------------------------------------------


class TextPart(Body):
    type: Annotated[Literal["text"], refusing(
        "Content part type {value} is not supported; only 'text' is.", "unsupported_content")]
    text: str


Content = Union[str, list[TextPart]]


class ToolCallFunction(Body):
    name: NonEmpty
    # Templates render arguments with `tojson`: a JSON string is decoded (parse_chat).
    arguments: Union[str, dict[str, Any]] = "{}"


class ToolCall(Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class _Message(Body):
    name: str | None = None
    # Checked on every role (they are part of the prefix keys); rendered for assistants.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class SystemMessage(_Message):
    role: Literal["system"]
    content: Content


class DeveloperMessage(_Message):
    role: Literal["developer"]
    content: Content


class UserMessage(_Message):
    role: Literal["user"]
    content: Content


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: Content | None = None


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: NonEmpty


Message = Annotated[
    Union[SystemMessage, DeveloperMessage, UserMessage, AssistantMessage, ToolMessage],
    Field(discriminator="role"),
]


class FunctionDef(Body):
    name: NonEmpty
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=dict)


class Tool(Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class StreamOptions(Body):
    include_usage: bool | None = None


class ResponseFormat(Body):
    type: Literal["text"]


# Decimal token ids only (int() would also take "+5", " 5", "1_0", other scripts' digits);
# the backend also bounds them by its vocabulary.
TOKEN_ID = r"^[0-9]{1,18}$"
LogitBias = Annotated[
    dict[Annotated[str, StringConstraints(pattern=TOKEN_ID)],
         Annotated[float, Field(ge=-100, le=100)]],
    # pydantic would describe the key pattern as patternProperties, which lets other
    # keys through: JSON Schema needs propertyNames to refuse them as validation does.
    WithJsonSchema({"type": "object", "propertyNames": {"pattern": TOKEN_ID},
                    "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}),
    refusing("logit_bias maps token ids (decimal strings) to numbers in [-100, 100].",
             "invalid_value"),
]


def _requires(name: str, present: dict, then: dict) -> dict:
    """JSON Schema: when `name` is present and matches `present`, `then` applies."""
    return {"if": {"required": [name], "properties": {name: present}}, "then": then}


_STREAM_OPTIONS_NEED_STREAM = _requires(
    "stream_options", {"type": "object"},
    {"required": ["stream"], "properties": {"stream": {"const": True}}})


class _Generation(Body):
    """What chat and completion bodies share."""

    model: NonEmpty
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    # OpenAI's seeds are signed 64-bit; the sampler's PRNG key takes an unsigned one.
    seed: Annotated[int, Field(ge=-(1 << 63), le=(1 << 64) - 1)] | None = None
    stop: Stop | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    logit_bias: LogitBias | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and unused, but typed as in OpenAI's API
    n: Annotated[only(1), refusing("Only n=1 is supported.")] | None = None
    best_of: Annotated[only(1), refusing("Only best_of=1 is supported.")] | None = None
    echo: Annotated[only(False), refusing("'echo' is not supported.")] | None = None
    suffix: Annotated[Literal[""], refusing("'suffix' is not supported.")] | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "_Generation":
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options",
                          "'stream_options' is only allowed when 'stream' is true.")
        return self


class ChatCompletionBody(_Generation):
    model_config = {"json_schema_extra": {"allOf": [
        _STREAM_OPTIONS_NEED_STREAM,
        _requires("top_logprobs", {"type": "integer"},
                  {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}),
    ]}}

    messages: Annotated[list[Message], Field(min_length=1)]
    tools: list[Tool] | None = None
    tool_choice: Annotated[Literal["auto", "none"], refusing(
        "Only tool_choice 'auto' and 'none' are supported.")] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    response_format: Annotated[ResponseFormat, refusing(
        "Only response_format {{'type': 'text'}} is supported.")] | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> "ChatCompletionBody":
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs", "'top_logprobs' requires 'logprobs' to be true.")
        return self


class CompletionBody(_Generation):
    model_config = {"json_schema_extra": {"allOf": [_STREAM_OPTIONS_NEED_STREAM]}}

    prompt: Annotated[Union[
        NonEmpty,
        Annotated[list[NonEmpty], Field(min_length=1, max_length=1)],
    ], refusing("'prompt' must be one non-empty string (or a list of exactly one).",
                "invalid_value")]
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None


# -- what the engine and the chat template take ----------------------------------------------


@dataclass
class SamplingParams:
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


@dataclass
class CompletionRequest:
    model: str
    prompt: str
    stream: bool
    include_usage: bool
    params: SamplingParams
    fault: str | None = None


def parse_json(raw: bytes) -> dict:
    if not raw:
        raise bad_request("The request body is empty; expected a JSON object.")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}.", code="invalid_json")
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    return body


def parse_chat(body: dict) -> ChatRequest:
    req = validate(ChatCompletionBody, body)
    params = _sampling(req)
    # max_completion_tokens, the newer name, wins over max_tokens.
    params.max_tokens = req.max_completion_tokens or req.max_tokens
    params.logprobs = bool(req.logprobs)
    params.top_logprobs = req.top_logprobs or 0
    tools = body["tools"] if req.tools and req.tool_choice != "none" else None  # as sent
    return ChatRequest(model=req.model, messages=[_message(m) for m in req.messages],
                       tools=tools, stream=bool(req.stream), include_usage=_include_usage(req),
                       params=params, fault=_fault(body))


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


def _sampling(req: _Generation) -> SamplingParams:
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


def _include_usage(req: _Generation) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _fault(body: dict) -> str | None:
    """The testing-only fault a backend started with --enable-faults honours."""
    fault = body.get("kvroute_fault")
    return fault if isinstance(fault, str) else None


def _text(content: Content | None) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(p.text for p in content)


def _arguments(raw: str | dict) -> Any:
    # Templates render arguments with `tojson`; a JSON string would be encoded twice.
    if isinstance(raw, dict):
        return raw
    try:
        return orjson.loads(raw) if raw.strip() else {}
    except orjson.JSONDecodeError:
        return raw


def _message(msg: Any) -> dict:
    out: dict = {"role": msg.role, "content": _text(msg.content)}
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

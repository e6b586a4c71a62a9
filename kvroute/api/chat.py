"""OpenAI chat and completion request bodies, as models.

`ChatCompletionBody` and `CompletionBody` are the one definition of what a client may
send to /v1/chat/completions and /v1/completions (kvroute/api/openapi.py describes them
from these models; the backend validates with them, kvroute/backend/requests.py).
Parameters kvroute does not implement are refused with a 400 rather than silently
ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import (AfterValidator, Field, StringConstraints, Tag, ValidationError,
                      WithJsonSchema, WrapValidator, model_validator)
from pydantic_core import PydanticCustomError

from .validation import (Body, NonEmpty, Stop, TokenIds, ToolName, invalid, only, refusing,
                         repeated, tagged_by)

MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
MAX_CHOICES = 16
# OpenAI's limits on `metadata`.
MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512

# A schema name as OpenAI takes it: ^[a-zA-Z0-9_-]{1,64}$.
Name = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]


class TextPart(Body):
    type: Literal["text"]
    text: str


class ImageURL(Body):
    # data: URLs (checked with the image itself: kvroute/core/images.py); http(s) ones
    # only through a proxy that fetches them (kvroute/proxy/image_fetch.py).
    url: NonEmpty
    detail: Literal["auto", "low", "high"] | None = None


class ImageURLPart(Body):
    """An image, for models that take images (the backend refuses it otherwise)."""

    type: Literal["image_url"]
    image_url: ImageURL


class RefusalPart(Body):
    """A refusal the model wrote, in a replayed assistant message (OpenAI's answers
    carry them): the template gets its text."""

    type: Literal["refusal"]
    refusal: str


def _part_type(part: Any) -> str | None:
    return part.get("type") if isinstance(part, dict) else None


def _no_refusal(part: Any, handler: Any) -> Any:
    # Only the model refuses: said plainly rather than as an unknown part type.
    if _part_type(part) == "refusal":
        raise PydanticCustomError("invalid_value:type", "Content parts of type 'refusal' are "
                                  "only allowed in assistant messages.")
    return handler(part)


Part = Annotated[
    Union[Annotated[TextPart, Tag("text")], Annotated[ImageURLPart, Tag("image_url")]],
    tagged_by("type", _part_type, "Content part type not supported; only 'text' and "
              "'image_url' are.", "unsupported_content"),
    WrapValidator(_no_refusal),
]
Content = Union[str, list[Part]]
AssistantPart = Annotated[
    Union[Annotated[TextPart, Tag("text")], Annotated[ImageURLPart, Tag("image_url")],
          Annotated[RefusalPart, Tag("refusal")]],
    tagged_by("type", _part_type, "Content part type not supported; only 'text', "
              "'image_url' and 'refusal' are.", "unsupported_content"),
]
AssistantContent = Union[str, list[AssistantPart]]


class ToolCallFunction(Body):
    name: NonEmpty
    # A JSON string, as OpenAI requires (its answers carry them so). Templates render
    # arguments with `tojson`: the string is decoded (parse_chat).
    arguments: str = "{}"


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
    content: AssistantContent | None = None


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: NonEmpty


Message = Annotated[
    Union[SystemMessage, DeveloperMessage, UserMessage, AssistantMessage, ToolMessage],
    Field(discriminator="role"),
]


def _object_schema(schema: dict[str, Any]) -> dict[str, Any]:
    # A function's arguments are one JSON object: a schema of another type describes
    # arguments no call could have (OpenAI refuses it too).
    if "type" in schema and schema["type"] != "object":
        raise PydanticCustomError("invalid_value", "{message}", {
            "message": "A function's parameters must be a JSON Schema of type 'object'."})
    return schema


Parameters = Annotated[
    dict[str, Any], AfterValidator(_object_schema),
    WithJsonSchema({"type": "object", "properties": {"type": {"const": "object"}}}),
]


class FunctionDef(Body):
    name: ToolName
    description: str = ""
    parameters: Parameters = Field(default_factory=dict)


class Tool(Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class StreamOptions(Body):
    include_usage: bool | None = None


class TextFormat(Body):
    type: Literal["text"]


class JSONObjectFormat(Body):
    type: Literal["json_object"]


class JSONSchema(Body):
    name: Name
    description: str | None = None
    # Any JSON schema; the backend compiles it and refuses what it cannot enforce.
    schema_: Annotated[dict[str, Any], Field(alias="schema")] = Field(default_factory=dict)
    # Accepted either way: every schema kvroute takes is enforced.
    strict: bool | None = None


class JSONSchemaFormat(Body):
    type: Literal["json_schema"]
    json_schema: JSONSchema


def _format_type(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else None
    return kind if kind in ("text", "json_object", "json_schema") else None


ResponseFormat = Annotated[
    Union[Annotated[TextFormat, Tag("text")], Annotated[JSONObjectFormat, Tag("json_object")],
          Annotated[JSONSchemaFormat, Tag("json_schema")]],
    tagged_by("type", _format_type,
              "response_format.type must be 'text', 'json_object' or 'json_schema'.",
              "invalid_value"),
]


class NamedFunction(Body):
    name: NonEmpty


class NamedToolChoice(Body):
    type: Literal["function"]
    function: NamedFunction


_TOOL_CHOICES = ("tool_choice is 'auto', 'none', 'required' or {'type': 'function', "
                 "'function': {'name': ...}}.")


def _tool_choice(value: Any, handler: Any) -> Any:
    """One error for a value of no known form (another mode, `allowed_tools`): not one
    per union member, which would blame a `function` field it never meant to send."""
    try:
        return handler(value)
    except ValidationError:
        if isinstance(value, dict) and value.get("type", "function") == "function":
            raise  # a named function's own errors name its field (tool_choice.function.name)
        raise PydanticCustomError("unsupported_parameter", "{message}",
                                  {"message": _TOOL_CHOICES}) from None


ToolChoice = Annotated[
    Union[Literal["auto", "none", "required"], NamedToolChoice],
    WrapValidator(_tool_choice),
]


Metadata = Annotated[
    dict[Annotated[str, StringConstraints(max_length=MAX_METADATA_KEY)],
         Annotated[str, StringConstraints(max_length=MAX_METADATA_VALUE)]],
    Field(max_length=MAX_METADATA_KEYS),
    refusing(f"metadata is an object of up to {MAX_METADATA_KEYS} strings, keys up to "
             f"{MAX_METADATA_KEY} characters long, values up to {MAX_METADATA_VALUE}.",
             "invalid_value"),
]


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


class GenerationBody(Body):
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
    # Extensions (mlx_lm.server's, vLLM's): sampling filters and the repetition penalty.
    top_k: Annotated[int, Field(ge=0)] | None = None  # 0: off
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None  # 0: off
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None  # 1: off
    repetition_context_size: Annotated[int, Field(ge=1, le=4096)] | None = None
    # Choices decoded side by side after one prefill of the prompt (the first choice's).
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
    best_of: Annotated[only(1), refusing(
        "best_of is not supported: kvroute does not score and rank candidate answers. "
        "Omit it (or send 1).")] | None = None
    echo: Annotated[only(False), refusing("'echo' is not supported.")] | None = None
    suffix: Annotated[Literal[""], refusing("'suffix' is not supported.")] | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "GenerationBody":
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options",
                          "'stream_options' is only allowed when 'stream' is true.")
        return self


class ChatCompletionBody(GenerationBody):
    model_config = {"json_schema_extra": {"allOf": [
        _STREAM_OPTIONS_NEED_STREAM,
        _requires("top_logprobs", {"type": "integer"},
                  {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}),
        _requires("tool_choice", {"anyOf": [{"const": "required"}, {"type": "object"}]},
                  {"required": ["tools"], "properties": {"tools": {"type": "array",
                                                                   "minItems": 1}}}),
    ]}}

    messages: Annotated[list[Message], Field(min_length=1)]
    # Unique function names: JSON Schema cannot say it (the description says it in words).
    tools: Annotated[list[Tool], Field(description="Function names must be unique.")] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    metadata: Metadata | None = None  # accepted and unused, checked as OpenAI does

    @model_validator(mode="after")
    def _tool_names_are_unique(self) -> "ChatCompletionBody":
        # A call names its function: two of one name would make it ambiguous.
        if found := repeated(t.function.name for t in self.tools or []):
            name = self.tools[found[0]].function.name
            raise invalid(f"tools[{found[0]}].function.name", f"Tool names must be unique: "
                          f"'{name}' is given twice.")
        return self

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> "ChatCompletionBody":
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs", "'top_logprobs' requires 'logprobs' to be true.")
        return self

    @model_validator(mode="after")
    def _forced_tool_needs_tools(self) -> "ChatCompletionBody":
        if self.tool_choice not in (None, "auto", "none") and not self.tools:
            raise invalid("tool_choice", "A forced tool_choice ('required' or a named "
                          "function) needs 'tools'.", "missing_required_parameter")
        return self


class CompletionBody(GenerationBody):
    model_config = {"json_schema_extra": {"allOf": [_STREAM_OPTIONS_NEED_STREAM]}}

    prompt: Annotated[Union[
        NonEmpty,
        Annotated[list[NonEmpty], Field(min_length=1, max_length=1)],
        TokenIds,
        Annotated[list[TokenIds], Field(min_length=1, max_length=1)],
    ], refusing("'prompt' must be one non-empty string or one non-empty list of token ids "
                "(or a list of exactly one of either).", "invalid_value")]
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None

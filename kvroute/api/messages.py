"""Anthropic Messages API request bodies (POST /v1/messages and
/v1/messages/count_tokens on the proxy), as models.

The one definition of what the proxy accepts there: proxy/agents/messages.py validates
with `MessagesBody` / `CountTokensBody` and translates the result into a chat body;
kvroute/openapi.py describes them. A user turn holds text and tool results, an
assistant turn text, tool uses and (ignored) thinking, a system message text: each
role's model says which. Fields Claude Code sends that change nothing for a text model
(`thinking`, `context_management`, `output_config.effort`, `metadata`, `service_tier`,
`cache_control` on any block or tool) are accepted; unknown fields are ignored, as
everywhere (`Body`). The refusals' wording is Anthropic's: proxy/agents/messages.py words them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, Tag, WrapValidator, model_validator
from pydantic_core import PydanticCustomError

from .validation import (MAX_STOP, Body, NonEmpty, ToolName, invalid, refusing, repeated,
                         tagged_by)


# The one `code` of a refused content block (an image, a server tool's result, ...):
# proxy/agents/messages.py words the refusal after the block type that was sent.
UNSUPPORTED_BLOCK = "unsupported_content"
PREFILL = "prefill_unsupported"
# Anthropic's refusals of empty content, in its words.
EMPTY_TURN = ("all messages must have non-empty content except for the optional final "
              "assistant message")
EMPTY_TEXT = "text content blocks must be non-empty"
# The described form of a rule a body validator enforces in Anthropic's words (a
# constraint pydantic enforced itself would refuse in its own words first).
_AT_LEAST_ONE = {"string": {"minLength": 1}, "list": {"minItems": 1}}


def _blocks(*members: tuple[type, str]) -> Any:
    """A content block of one of these (model, type) kinds, told apart by `type`."""

    def kind(block: Any) -> str | None:
        return block.get("type") if isinstance(block, dict) else None

    allowed = ", ".join(tag for _, tag in members)
    return Annotated[
        Union[tuple(Annotated[model, Tag(tag)] for model, tag in members)],
        tagged_by("type", kind, f"Content block type not supported here (allowed: {allowed}).",
                  UNSUPPORTED_BLOCK),
    ]


class TextBlock(Body):
    type: Literal["text"]
    text: str


class TurnTextBlock(TextBlock):
    """A text block of a user or assistant turn: not empty (`_content_is_non_empty`)."""

    text: Annotated[str, Field(json_schema_extra=_AT_LEAST_ONE["string"])]


class Base64Source(Body):
    type: Literal["base64"]
    media_type: NonEmpty
    data: NonEmpty


class URLSource(Body):
    """An image by URL: the proxy fetches it when its operator enabled fetching
    (proxy/image_fetch.py), else refuses it."""

    type: Literal["url"]
    url: NonEmpty


def _known_source(value: Any, handler: Any) -> Any:
    # Said before the fields another source type lacks.
    kind = value.get("type") if isinstance(value, dict) else None
    if kind is not None and kind not in ("base64", "url"):
        raise PydanticCustomError("unsupported_content", "{message}", {"message": (
            f"Image source type {str(kind)[:40]!r} is not supported; send the image inline "
            "as a base64 source, or as a url source to a proxy that fetches image URLs.")})
    return handler(value)


class ImageBlock(Body):
    """An image, for models that take images (the backend refuses it otherwise)."""

    type: Literal["image"]
    source: Annotated[Union[Base64Source, URLSource], Field(discriminator="type"),
                      WrapValidator(_known_source)]


class ToolUseBlock(Body):
    type: Literal["tool_use"]
    id: NonEmpty
    name: NonEmpty
    input: dict[str, Any]


class ToolResultBlock(Body):
    type: Literal["tool_result"]
    tool_use_id: NonEmpty
    # Text only: an image or a tool reference inside a result is refused like any block.
    content: Union[str, list[_blocks((TextBlock, "text"))]] | None = None
    is_error: bool | None = None


class ThinkingBlock(Body):
    """Ignored: Anthropic ignores earlier turns' thinking too; kvroute's models send none."""

    type: Literal["thinking", "redacted_thinking"]


UserBlock = _blocks((TurnTextBlock, "text"), (ImageBlock, "image"),
                    (ToolResultBlock, "tool_result"))
AssistantBlock = _blocks((TurnTextBlock, "text"), (ToolUseBlock, "tool_use"),
                         (ThinkingBlock, "thinking"), (ThinkingBlock, "redacted_thinking"))
SystemBlock = _blocks((TextBlock, "text"))


def _non_empty(kind: Any) -> Any:
    """A turn's content, described as not empty (`_content_is_non_empty` enforces it)."""
    return Union[Annotated[str, Field(json_schema_extra=_AT_LEAST_ONE["string"])],
                 Annotated[list[kind], Field(json_schema_extra=_AT_LEAST_ONE["list"])]]


class UserTurn(Body):
    role: Literal["user"]
    content: _non_empty(UserBlock)


class AssistantTurn(Body):
    role: Literal["assistant"]
    content: _non_empty(AssistantBlock)


class SystemTurn(Body):
    """A system message inside the conversation (Anthropic's mid-conversation system
    messages; Claude Code puts its environment section there, after the first user
    turn): it stays where it stands, a chat system message at that position."""

    role: Literal["system"]
    content: Union[str, list[SystemBlock]]


def _role(message: Any) -> str | None:
    return message.get("role") if isinstance(message, dict) else None


Message = Annotated[
    Union[Annotated[UserTurn, Tag("user")], Annotated[AssistantTurn, Tag("assistant")],
          Annotated[SystemTurn, Tag("system")]],
    tagged_by("role", _role, "Input should be 'user', 'assistant' or 'system'", "invalid_value"),
]


class ClientTool(Body):
    """A client tool; Anthropic's server tools (web search ...) have other types. Extra
    fields Claude Code sets (`cache_control`, `strict`, `input_examples`,
    `eager_input_streaming`) are accepted without effect."""

    type: Annotated[Literal["custom"], refusing(
        "Tool type {value} is not supported; only client tools (name, description, "
        "input_schema) are: kvroute runs no server tools.")] | None = None
    name: ToolName
    description: str | None = None
    input_schema: dict[str, Any]
    # A deferred tool is not shown to the model until a tool search loads it (Anthropic's
    # tool search, which kvroute has not): it is left out of the prompt, as there.
    defer_loading: bool | None = None


class ToolChoice(Body):
    model_config = {"json_schema_extra": {"allOf": [
        {"if": {"properties": {"type": {"const": "tool"}}},
         "then": {"required": ["name"], "properties": {"name": {"type": "string"}}}}]}}

    type: Annotated[Literal["auto", "none", "any", "tool"], refusing(
        "tool_choice.type is 'auto', 'none', 'any' or 'tool'.")]
    name: NonEmpty | None = None  # the tool, for type 'tool'
    # With 'any' or 'tool': one call rather than several.
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _tool_is_named(self) -> "ToolChoice":
        if self.type == "tool" and self.name is None:
            raise invalid("tool_choice.name", "tool_choice of type 'tool' names the tool in "
                          "'name'.", "missing_required_parameter")
        return self


class JSONSchemaFormat(Body):
    """Structured outputs: the answer is JSON valid against `schema`."""

    type: Annotated[Literal["json_schema"], refusing(
        "The output format's type is 'json_schema'.", "invalid_value")]
    schema_: Annotated[dict[str, Any], Field(alias="schema")]


class Metadata(Body):
    user_id: str | None = None


class Thinking(Body):
    """Accepted, without effect: kvroute's models do not think. Every type the
    anthropic SDK sends is known; their other fields (`budget_tokens`, `display`) are
    not checked."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]


class OutputConfig(Body):
    effort: str | None = None  # accepted, without effect: kvroute's models do not reason
    format: JSONSchemaFormat | None = None


class CountTokensBody(Body):
    model_config = {"json_schema_extra": {"allOf": [
        {"if": {"required": ["tool_choice"],
                "properties": {"tool_choice": {"type": "object", "required": ["type"],
                                               "properties": {"type": {"enum": ["any", "tool"]}}}}},
         "then": {"required": ["tools"], "properties": {"tools": {"type": "array",
                                                                  "minItems": 1}}}}]}}

    model: NonEmpty
    messages: Annotated[list[Message], Field(min_length=1)]
    system: Union[str, list[SystemBlock]] | None = None
    tools: list[ClientTool] | None = None
    tool_choice: ToolChoice | None = None
    # Accepted, without effect: no thinking blocks are produced (so no thinking is ever
    # cleared either), metadata is not kept, every request is served alike.
    thinking: Thinking | None = None
    context_management: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    metadata: Metadata | None = None
    service_tier: str | None = None
    output_format: JSONSchemaFormat | None = None  # the beta's name of output_config.format
    mcp_servers: Annotated[None, refusing(
        "The MCP connector is not supported: kvroute runs no server tools; give the tools "
        "as client tools.")] = None

    @model_validator(mode="after")
    def _forced_tool_needs_tools(self) -> "CountTokensBody":
        if self.tool_choice is not None and self.tool_choice.type in ("any", "tool") \
                and not self.tools:
            raise invalid("tool_choice", "A forced tool_choice ('any' or 'tool') needs "
                          "'tools'.")
        return self

    @model_validator(mode="after")
    def _tool_names_are_unique(self) -> "CountTokensBody":
        if found := repeated(t.name for t in self.tools or []):
            i, first = found
            raise invalid(f"tools[{i}].name", f"Tool names must be unique: "
                          f"'{self.tools[i].name}' is also the name of tools.{first}.")
        return self

    @model_validator(mode="after")
    def _ends_with_the_user(self) -> "CountTokensBody":
        # A chat template closes every assistant turn and opens a new one: continuing a
        # partial reply (prefill) cannot be expressed. (JSON Schema cannot say "the last
        # item": the description allows it, validation refuses it.)
        if self.messages[-1].role == "assistant":
            raise invalid(f"messages[{len(self.messages) - 1}]",
                          "Prefilling assistant messages is not supported for this model.",
                          PREFILL)
        return self

    @model_validator(mode="after")
    def _content_is_non_empty(self) -> "CountTokensBody":
        # After the prefill check: a final assistant turn is refused for that. (A system
        # message may be empty: Anthropic's directive-only form.)
        for i, msg in enumerate(self.messages):
            if msg.role == "system":
                continue
            if not msg.content:
                raise invalid(f"messages[{i}]", EMPTY_TURN)
            for j, block in enumerate(msg.content if isinstance(msg.content, list) else ()):
                if isinstance(block, TextBlock) and not block.text:
                    raise invalid(f"messages[{i}].content[{j}].text", EMPTY_TEXT)
        return self


class MessagesBody(CountTokensBody):
    # 0: prefill the prompt into the cache and generate nothing (Anthropic's "populate
    # the prompt cache without generating a response").
    max_tokens: Annotated[int, Field(ge=0)]
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    stream: bool | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None

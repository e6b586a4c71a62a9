"""Anthropic Messages API request bodies (POST /v1/messages and
/v1/messages/count_tokens on the proxy), as models.

The one definition of what the proxy accepts there: proxy/messages_api.py validates
with `MessagesBody` / `CountTokensBody` and translates the result into a chat body;
kvroute/openapi.py describes them. A user turn holds text and tool results, an
assistant turn text, tool uses and (ignored) thinking: each role's model says which.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, Tag, model_validator

from .validation import Body, invalid, refusing, tagged_by
from .wire import MAX_STOP, NonEmpty

def _blocks(*members: tuple[type, str]) -> Any:
    """A content block of one of these (model, type) kinds, told apart by `type`."""

    def kind(block: Any) -> str | None:
        return block.get("type") if isinstance(block, dict) else None

    allowed = ", ".join(tag for _, tag in members)
    return Annotated[
        Union[tuple(Annotated[model, Tag(tag)] for model, tag in members)],
        tagged_by("type", kind, "Content block type not supported here; kvroute serves text "
                  f"models (blocks allowed: {allowed}).", "unsupported_content"),
    ]


class TextBlock(Body):
    type: Literal["text"]
    text: str


class ToolUseBlock(Body):
    type: Literal["tool_use"]
    id: NonEmpty
    name: NonEmpty
    input: dict[str, Any]


class ToolResultBlock(Body):
    type: Literal["tool_result"]
    tool_use_id: NonEmpty
    content: Union[str, list[TextBlock]] | None = None
    is_error: bool | None = None


class ThinkingBlock(Body):
    """Ignored: Anthropic ignores earlier turns' thinking too; kvroute's models send none."""

    type: Literal["thinking", "redacted_thinking"]


UserBlock = _blocks((TextBlock, "text"), (ToolResultBlock, "tool_result"))
AssistantBlock = _blocks((TextBlock, "text"), (ToolUseBlock, "tool_use"),
                         (ThinkingBlock, "thinking"), (ThinkingBlock, "redacted_thinking"))


class UserTurn(Body):
    role: Literal["user"]
    content: Union[str, list[UserBlock]]


class AssistantTurn(Body):
    role: Literal["assistant"]
    content: Union[str, list[AssistantBlock]]


def _role(message: Any) -> str | None:
    return message.get("role") if isinstance(message, dict) else None


Message = Annotated[
    Union[Annotated[UserTurn, Tag("user")], Annotated[AssistantTurn, Tag("assistant")]],
    tagged_by("role", _role, "Invalid role; expected 'user' or 'assistant' (the system prompt "
              "goes in 'system').", "invalid_value"),
]


class ClientTool(Body):
    """A client tool; Anthropic's server tools (web search ...) have other types."""

    type: Annotated[Literal["custom"], refusing(
        "Tool type {value} is not supported; only client tools (name, description, "
        "input_schema) are.")] | None = None
    name: NonEmpty
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(Body):
    type: Annotated[Literal["auto", "none"], refusing(
        "Only tool_choice 'auto' and 'none' are supported.")]
    disable_parallel_tool_use: bool | None = None


class Metadata(Body):
    user_id: str | None = None


class CountTokensBody(Body):
    model: NonEmpty
    messages: Annotated[list[Message], Field(min_length=1)]
    system: Union[str, list[TextBlock]] | None = None
    tools: list[ClientTool] | None = None
    tool_choice: ToolChoice | None = None
    # Accepted, without effect: no thinking blocks are produced, metadata is not kept.
    thinking: dict[str, Any] | None = None
    metadata: Metadata | None = None

    @model_validator(mode="after")
    def _ends_with_the_user(self) -> "CountTokensBody":
        # A chat template closes every assistant turn and opens a new one: continuing a
        # partial reply (prefill) cannot be expressed. (JSON Schema cannot say "the last
        # item": the description allows it, validation refuses it.)
        if self.messages[-1].role == "assistant":
            raise invalid(f"messages[{len(self.messages) - 1}]",
                          "The last message must be a user message: continuing an assistant "
                          "message (prefill) is not supported.", "unsupported_parameter")
        return self


class MessagesBody(CountTokensBody):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    stream: bool | None = None
    top_k: Annotated[None, refusing(
        "'top_k' is not supported; use temperature or top_p.")] = None

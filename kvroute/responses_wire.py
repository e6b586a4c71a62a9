"""OpenAI Responses API request bodies (POST /v1/responses on the proxy), as models.

The one definition of what the proxy accepts there: proxy/responses_api.py validates
with `ResponsesBody` and translates the result into a chat body; kvroute/openapi.py
describes it. Fields kvroute accepts without effect are typed all the same, so a
wrong type is a 400 here rather than a surprise later.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, Tag

from .validation import Body, only, refusing, tagged_by
from .wire import NonEmpty, Stop

TEXT_PARTS = ("input_text", "output_text", "text")


class InputTextPart(Body):
    type: Annotated[Literal["input_text", "output_text", "text"], refusing(
        "Content part type {value} is not supported; only text parts (input_text, "
        "output_text, text) are.", "unsupported_content")]
    text: str


Text = Union[str, list[InputTextPart]]


class MessageItem(Body):
    type: Literal["message"] | None = None
    role: Annotated[Literal["user", "assistant", "system", "developer"], refusing(
        "Invalid role {value}; expected one of user, assistant, system, developer.",
        "invalid_value")]
    content: Text


class FunctionCallItem(Body):
    type: Literal["function_call"]
    call_id: NonEmpty
    name: NonEmpty
    arguments: str  # JSON, as the model wrote it


class FunctionCallOutputItem(Body):
    type: Literal["function_call_output"]
    call_id: NonEmpty
    output: Text


class ReasoningItem(Body):
    """Accepted and dropped: kvroute's models give none, and one from another provider
    holds nothing a chat template can render (summaries, encrypted content)."""

    type: Literal["reasoning"]


def _item_kind(item: Any) -> str | None:
    if isinstance(item, dict):
        kind = item.get("type")
        return "message" if kind is None else kind if isinstance(kind, str) else None
    return None


Item = Annotated[
    Union[Annotated[MessageItem, Tag("message")],
          Annotated[FunctionCallItem, Tag("function_call")],
          Annotated[FunctionCallOutputItem, Tag("function_call_output")],
          Annotated[ReasoningItem, Tag("reasoning")]],
    tagged_by("type", _item_kind, "Input item type not supported; use message, function_call "
              "or function_call_output.", "unsupported_parameter"),
]


class FunctionTool(Body):
    type: Annotated[Literal["function"], refusing(
        "Tool type {value} is not supported; only function tools are.")]
    name: NonEmpty
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(Body):
    type: Literal["text"]


class TextConfig(Body):
    format: Annotated[TextFormat, refusing(
        "Only text.format {{'type': 'text'}} is supported.")] | None = None


_USE_INPUT = "'{name}' is not supported; send 'input' (and 'previous_response_id' to continue " \
             "a stored response)."


class ResponsesBody(Body):
    model: NonEmpty
    input: Union[str, list[Item]]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Annotated[Literal["auto", "none"], refusing(
        "Only tool_choice 'auto' and 'none' are supported.")] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    stop: Stop | None = None  # not in OpenAI's API: kvroute's, as in chat
    stream: bool | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    background: Annotated[only(False), refusing(
        "'background' responses are not supported.")] | None = None
    text: TextConfig | None = None
    top_logprobs: Annotated[only(0), refusing(
        "'top_logprobs' is not supported on /v1/responses.")] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    # Accepted, and without effect: kvroute's models do not reason, caching is automatic.
    reasoning: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    conversation: Annotated[None, refusing(_USE_INPUT.format(name="conversation"))] = None
    prompt: Annotated[None, refusing(_USE_INPUT.format(name="prompt"))] = None

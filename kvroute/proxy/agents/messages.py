"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, carried
by the chat path.

A request becomes the canonical chat body: `system` a system message, each message's
text blocks its content (blocks joined by a blank line), a system message inside
`messages` a chat system message at the same place, an assistant's `tool_use` blocks
its tool calls (ids kept, so the next turn's body is the one the backend advertised),
a user's `tool_result` blocks tool messages; tools take OpenAI's function format (a
deferred tool, `defer_loading`, is left out, as Anthropic leaves it out of the prompt).
Consecutive user (or assistant) messages are first combined into one turn, as
Anthropic's API combines them. It is routed like any chat completion
(`Gateway.route_chat`), so a chat completion and a Messages request with the same
history share one cache, and the backend's chat answer, always streamed, comes back as
Anthropic's event stream or as a message whose blocks keep the stream's order.
`max_tokens: 0` fills the prompt cache and answers nothing (`chat_body`).

Claude Code's billing line (a system text block `x-anthropic-billing-header: ...`) is
dropped: it is a header for Anthropic's billing, not prompt, and its hash changes from
conversation to conversation (in some versions from request to request), which would
end every shared prefix at the first block.

`cache_control` is accepted anywhere and ignored: every prompt is cached. Usage reports
the cached part as `cache_read_input_tokens` and the rest as `input_tokens` (Anthropic
counts them apart); nothing is billed as a cache write, so `cache_creation_input_tokens`
is 0. Errors take Anthropic's envelope (`error_envelope_middleware`) and, where
Anthropic's API refuses the same thing, Anthropic's wording (`messages.1.role: Input
should be ...`, `prompt is too long: N tokens > M maximum`, `model: <name>`), so a
client's own handling of those errors (Claude Code's, the SDKs') works here too.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field, replace
from typing import Any

import orjson
from aiohttp import web

from kvroute.api import messages as mw
from kvroute.api.errors import APIError
from kvroute.api.http import json_response, off_loop_if_large, read_json
from kvroute.api.validation import validate
from kvroute.api.routes import COUNT_TOKENS_PATH, MESSAGES_COUNT_PATH, MESSAGES_PATH

from .gateway import GATEWAY, Relay, SSEWriter, carry_fault, sse_event
from .reply import ChatReply, Usage, chat_chunks, new_id, tool_call_parts, upstream_error

PATH, COUNT_PATH = MESSAGES_PATH, MESSAGES_COUNT_PATH
# Several text blocks of one turn (Claude Code sends a few) read as paragraphs.
BLOCK_SEPARATOR = "\n\n"
# Claude Code's billing attribution, sent as the first system text block.
BILLING_HEADER = "x-anthropic-billing-header:"


@dataclass
class MessagesRequest:
    model: str
    messages: list[dict]  # chat messages, `system` first when there is one
    max_tokens: int | None = None  # None for count_tokens only
    tools: list[dict] | None = None  # chat format
    tool_choice: str | dict = "auto"  # chat's
    parallel_tool_calls: bool = True
    response_format: dict | None = None  # chat's, from output_config.format (output_format)
    top_k: int | None = None
    stop_sequences: list[str] = field(default_factory=list)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    # The index in `messages` of the first system message after the conversation began
    # (one a chat template may refuse there), or None.
    mid_system: int | None = None


# -- request -------------------------------------------------------------------------


def _joined(content: str | list[mw.TextBlock]) -> str:
    return content if isinstance(content, str) else BLOCK_SEPARATOR.join(b.text for b in content)


def _system_text(content: str | list[mw.TextBlock]) -> str | None:
    """A system prompt's text without Claude Code's billing line; None when that line
    was all of it."""
    if isinstance(content, str):
        if not content.startswith(BILLING_HEADER):
            return content
        return content.partition("\n")[2] or None
    kept = [b.text for b in content if not b.text.startswith(BILLING_HEADER)]
    return BLOCK_SEPARATOR.join(kept) if kept or not content else None


def _tool_result_text(block: mw.ToolResultBlock) -> str:
    text = _joined(block.content) if block.content is not None else ""
    # Chat has no error flag on a tool message: say it in the text the model reads.
    return "Error: " + text if block.is_error else text


def _user(content: str | list) -> list[dict]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out: list[dict] = []
    blocks: list = []  # text and image blocks of one user message

    def flush() -> None:
        if blocks:
            out.append({"role": "user", "content": _user_content(blocks)})
            blocks.clear()

    for block in content:
        if isinstance(block, (mw.TextBlock, mw.ImageBlock)):
            blocks.append(block)
        else:
            flush()
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": _tool_result_text(block)})
    flush()
    return out or [{"role": "user", "content": ""}]


def _user_content(blocks: list) -> str | list[dict]:
    """Text blocks joined; with images, chat content parts with the images where they
    stand (a data URL each) and the same separators between blocks."""
    if all(isinstance(b, mw.TextBlock) for b in blocks):
        return BLOCK_SEPARATOR.join(b.text for b in blocks)
    parts: list[dict] = []
    for i, b in enumerate(blocks):
        if i:
            parts.append({"type": "text", "text": BLOCK_SEPARATOR})
        if isinstance(b, mw.TextBlock):
            parts.append({"type": "text", "text": b.text})
        else:  # a url source stays a URL: the routing fetches it (proxy/image_fetch.py)
            url = (b.source.url if isinstance(b.source, mw.URLSource)
                   else f"data:{b.source.media_type};base64,{b.source.data}")
            parts.append({"type": "image_url", "image_url": {"url": url}})
    return parts


def _assistant(content: str | list) -> dict:
    if isinstance(content, str):
        content = [mw.TextBlock(type="text", text=content)]
    texts = [b.text for b in content if isinstance(b, mw.TextBlock)]
    # Thinking blocks are dropped: Anthropic ignores earlier turns' thinking too.
    calls = [{"id": b.id, "type": "function",
              "function": {"name": b.name, "arguments": orjson.dumps(b.input).decode()}}
             for b in content if isinstance(b, mw.ToolUseBlock)]
    # As the backend advertises a reply: content null when empty, calls after the text.
    msg: dict = {"role": "assistant", "content": BLOCK_SEPARATOR.join(texts) or None}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _turns(messages: list) -> list[tuple[int, str, Any]]:
    """(index, role, content) of each turn: consecutive user (or assistant) messages
    are one turn, their blocks in order, as Anthropic's API combines them. So the chat
    template sees one message whichever way a client split the turn, and two user
    messages count and cache as one with both blocks."""
    turns: list[tuple[int, str, Any]] = []
    for i, msg in enumerate(messages):
        if turns and msg.role != "system" and turns[-1][1] == msg.role:
            index, role, content = turns[-1]
            turns[-1] = (index, role, _blocks_of(content) + _blocks_of(msg.content))
        else:
            turns.append((i, msg.role, msg.content))
    return turns


def _blocks_of(content: str | list) -> list:
    return [mw.TextBlock(type="text", text=content)] if isinstance(content, str) else content


def _messages(req: mw.CountTokensBody) -> tuple[list[dict], int | None]:
    """The chat messages, and the index in `req.messages` of the first system message
    inside the conversation (after a user or assistant turn), or None."""
    out: list[dict] = []
    system = _system_text(req.system) if req.system is not None else None
    if system is not None:
        out.append({"role": "system", "content": system})
    mid_system, begun = None, False
    for i, role, content in _turns(req.messages):
        if role == "system":
            # One without text (Anthropic's directive-only form) says nothing to a template.
            text = _system_text(content)
            if text:
                if begun and mid_system is None:
                    mid_system = i
                out.append({"role": "system", "content": text})
            continue
        out += _user(content) if role == "user" else [_assistant(content)]
        begun = True
    return out, mid_system


def _tools(req: mw.CountTokensBody) -> list[dict] | None:
    if not req.tools:
        return None
    out = []
    for tool in req.tools:
        if tool.defer_loading:
            continue
        fn: dict = {"name": tool.name}
        if tool.description is not None:
            fn["description"] = tool.description
        fn["parameters"] = tool.input_schema
        out.append({"type": "function", "function": fn})
    return out or None


def parse(body: dict, count_only: bool = False) -> MessagesRequest:
    try:
        req = validate(mw.CountTokensBody if count_only else mw.MessagesBody, body)
    except APIError as err:
        raise refusal(err, body) from None
    messages, mid_system = _messages(req)
    out = MessagesRequest(model=req.model, messages=messages, tools=_tools(req),
                          tool_choice=_tool_choice(req.tool_choice), mid_system=mid_system)
    if req.tool_choice is not None and req.tool_choice.disable_parallel_tool_use:
        out.parallel_tool_calls = False
    fmt = req.output_config.format if req.output_config else None
    if (fmt := fmt or req.output_format) is not None:
        out.response_format = {"type": "json_schema",
                               "json_schema": {"name": "output", "schema": fmt.schema_}}
    if isinstance(req, mw.MessagesBody):
        out.top_k = req.top_k
        out.max_tokens = req.max_tokens
        out.stop_sequences = req.stop_sequences or []
        out.temperature, out.top_p, out.stream = req.temperature, req.top_p, bool(req.stream)
    return out


def _tool_choice(choice: mw.ToolChoice | None) -> str | dict:
    """Anthropic's tool_choice as chat's: 'any' is 'required', 'tool' a named function."""
    if choice is None:
        return "auto"
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return "required" if choice.type == "any" else choice.type


def chat_body(req: MessagesRequest) -> dict:
    """The canonical chat-completions body of a Messages request.

    Always streamed from the backend, even for a client that asked for a whole message:
    only a stream says in which order the model wrote its text and its tool calls (a
    whole chat answer has the text in one field, the calls in another), and a message
    lists its content blocks in that order, as Anthropic's stream does.

    max_tokens 0 (fill the prompt cache, generate nothing) asks the backend for one
    token: the chat API has no "prefill only", and a backend commits a prompt's cache
    when its reply ends. The relay drops that token from the answer."""
    body: dict = {"model": req.model, "messages": req.messages,
                  "max_tokens": max(req.max_tokens or 0, 1), "stream": True,
                  "stream_options": {"include_usage": True}}
    if req.tools:
        body["tools"] = req.tools
        body["tool_choice"] = req.tool_choice
        if not req.parallel_tool_calls:
            body["parallel_tool_calls"] = False
    if req.response_format is not None:
        body["response_format"] = req.response_format
    if req.stop_sequences:
        body["stop"] = req.stop_sequences
    for name, value in (("temperature", req.temperature), ("top_p", req.top_p),
                        ("top_k", req.top_k)):
        if value is not None:
            body[name] = value
    return body


# -- response --------------------------------------------------------------------------


def _usage(u: Usage, prefill_only: bool = False) -> dict:
    return {"input_tokens": max(0, u.prompt_tokens - u.cached_tokens),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": u.cached_tokens,
            "output_tokens": 0 if prefill_only else u.completion_tokens}


def _stop_reason(reply: ChatReply, prefill_only: bool) -> str:
    # A reply cut by max_tokens says so even when it holds tool calls (the backend
    # reports "length" then): the last one may be cut short, and a client (Claude
    # Code) must know its answer is incomplete. max_tokens 0 answers nothing, as cut.
    if prefill_only or reply.finish_reason == "length":
        return "max_tokens"
    if reply.finish_reason == "tool_calls" or reply.tool_calls:
        return "tool_use"
    return "stop_sequence" if reply.stop is not None else "end_turn"


def _tool_use(call: dict) -> dict:
    call_id, name, args = tool_call_parts(call)
    try:
        tool_input = orjson.loads(args)
    except orjson.JSONDecodeError:
        tool_input = None
    if not isinstance(tool_input, dict):
        # `input` must be an object; keep what the model wrote rather than lose it.
        tool_input = {"arguments": args}
    return {"type": "tool_use", "id": call_id, "name": name, "input": tool_input}


class _Content:
    """A message's content blocks in the order the model wrote them: a text block per
    run of text, a tool_use block per call."""

    def __init__(self) -> None:
        self.blocks: list[dict] = []

    def add(self, text: str, calls: list[dict]) -> None:
        if text and self.blocks and self.blocks[-1]["type"] == "text":
            self.blocks[-1]["text"] += text
        elif text:
            self.blocks.append({"type": "text", "text": text})
        self.blocks += [_tool_use(call) for call in calls]


class _MessagesRelay(Relay):
    def __init__(self, req: MessagesRequest):
        self.req = req
        self.id = new_id("msg_")
        # max_tokens 0: the backend generated one token (chat_body); the answer has none.
        self.prefill_only = req.max_tokens == 0

    @property
    def client_stream(self) -> bool:
        return self.req.stream

    def message(self, content: list[dict], reply: ChatReply | None, usage: Usage) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.req.model,
                "content": [] if self.prefill_only else content,
                "stop_reason": _stop_reason(reply, self.prefill_only) if reply else None,
                "stop_sequence": reply.stop if reply and not self.prefill_only else None,
                "usage": _usage(usage, self.prefill_only)}

    def held_error(self, err: APIError) -> bytes:
        return sse_event("error", {"type": "error", **error_fields(err)})

    def refusal(self, err: APIError) -> APIError:
        return backend_refusal(err, self.req)

    async def answer(self, reply: ChatReply) -> dict:
        # A whole chat answer, from a backend that did not stream though asked to: its
        # text and calls no longer say their order; text first, as chat lists them.
        content = _Content()
        content.add(reply.text, reply.tool_calls)
        return self.message(content.blocks, reply, reply.usage)

    async def stream(self, request: web.Request, upstream: Any, headers: dict,
                     bid: str) -> web.StreamResponse:
        if self.req.stream:
            return await super().stream(request, upstream, headers, bid)
        # A whole message, read from the backend's stream (chat_body): the blocks in
        # the order they came. A failure raises UpstreamFailed: nothing has reached the
        # client, so the proxy may try the request elsewhere (forward.py).
        reply, content = ChatReply(usage=Usage.from_headers(headers)), _Content()
        try:
            async for chunk in chat_chunks(upstream, bid):
                content.add(*reply.add(chunk))
        finally:
            self.completion_tokens = reply.usage.completion_tokens
        return json_response(self.message(content.blocks, reply, reply.usage),
                             self.headers(headers))

    def events(self, sse: SSEWriter, reply: ChatReply) -> "_MessagesEvents":
        return _MessagesEvents(self, sse, reply)


class _MessagesEvents:
    """Anthropic's stream of one reply: message_start and a ping; a content block per
    text run and per tool call (its input in one delta: the backend sends each call
    whole); message_delta with the stop reason and usage, message_stop."""

    def __init__(self, relay: _MessagesRelay, sse: SSEWriter, reply: ChatReply):
        self.relay, self.sse, self.reply = relay, sse, reply
        self.blocks = 0  # content blocks started so far
        self.text_open = False

    async def send(self, kind: str, **fields) -> bool:
        return await self.sse.send(kind, {"type": kind, **fields})

    async def begin(self) -> None:
        await self.send("message_start", message=self.relay.message([], None, self.reply.usage))
        await self.send("ping")

    async def text(self, text: str) -> None:
        if self.relay.prefill_only:
            return
        if not self.text_open:
            await self.send("content_block_start", index=self.blocks,
                            content_block={"type": "text", "text": ""})
            self.blocks, self.text_open = self.blocks + 1, True
        await self.send("content_block_delta", index=self.blocks - 1,
                        delta={"type": "text_delta", "text": text})

    async def tool_call(self, call: dict) -> None:
        if self.relay.prefill_only:
            return
        await self._close_text()
        block, index = _tool_use(call), self.blocks
        await self.send("content_block_start", index=index, content_block={**block, "input": {}})
        partial = orjson.dumps(block["input"]).decode()
        await self.send("content_block_delta", index=index,
                        delta={"type": "input_json_delta", "partial_json": partial})
        await self.send("content_block_stop", index=index)
        self.blocks += 1

    async def end(self) -> None:
        await self._close_text()
        reply = self.reply
        prefill_only = self.relay.prefill_only
        await self.send("message_delta", delta={
            "stop_reason": _stop_reason(reply, prefill_only),
            "stop_sequence": None if prefill_only else reply.stop},
            usage=_usage(reply.usage, prefill_only))
        await self.send("message_stop")

    async def fail(self, error: APIError) -> None:
        await self.send("error", **error_fields(error))

    async def _close_text(self) -> None:
        if self.text_open:
            await self.send("content_block_stop", index=self.blocks - 1)
            self.text_open = False


async def _read(request: web.Request) -> tuple[bytes, dict]:
    """The body, as read_json reads it; a refusal naming a field in Anthropic's words."""
    try:
        return await read_json(request)
    except APIError as err:
        raise refusal(err, {}) from None


async def create(request: web.Request) -> web.StreamResponse:
    t_start = time.perf_counter()
    raw, body = await _read(request)
    req = await off_loop_if_large(len(raw), parse, body)
    try:
        return await request.app[GATEWAY].route_chat(
            request, carry_fault(body, chat_body(req)), _MessagesRelay(req), t_start)
    except APIError as err:
        raise unknown_model(err, req.model) from None


async def count_tokens(request: web.Request) -> web.Response:
    """Asks a backend serving the model to render the chat body with its chat template:
    the count equals what messages.create reports as input (uncached + cached) tokens."""
    raw, body = await _read(request)
    req = await off_loop_if_large(len(raw), parse, body, True)
    chat: dict = {"model": req.model, "messages": req.messages}
    if req.tools:
        chat["tools"], chat["tool_choice"] = req.tools, req.tool_choice
    try:
        status, data = await request.app[GATEWAY].ask_backend(request, req.model,
                                                              COUNT_TOKENS_PATH, chat)
    except APIError as err:
        raise unknown_model(err, req.model) from None
    if status >= 400:
        raise backend_refusal(upstream_error(status, data), req)
    try:
        count = int(orjson.loads(data)["prompt_tokens"])
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        raise APIError(502, "The backend's token count could not be read.", "server_error", None,
                       "backend_failed") from None
    return json_response({"input_tokens": count}, {})


# -- errors ------------------------------------------------------------------------------
#
# Anthropic's API words a refused body as `<path>: <reason>`, the path dotted
# (`messages.1.content.0.type`) and the reason pydantic's (`Field required`, `Input
# should be ...`); a few refusals clients act on have fixed texts (a prompt too long,
# max_tokens past the context, a role a model does not take). The refusals below keep
# the status, type and param of kvroute's own; only the message takes Anthropic's words.

# Block types that are media kvroute's text models cannot read.
_MEDIA = {"image", "document", "search_result", "container_upload"}
# Block types of Anthropic's server tools and tool search, which kvroute does not run.
_SERVER = {"server_tool_use", "web_search_tool_result", "web_fetch_tool_result",
           "code_execution_tool_result", "bash_code_execution_tool_result",
           "text_editor_code_execution_tool_result", "tool_search_tool_result",
           "mcp_tool_use", "mcp_tool_result", "tool_reference"}
_VALID = {"a string": "a valid string", "an integer": "a valid integer",
          "a number": "a valid number", "a boolean": "a valid boolean",
          "a list": "a valid list", "an object": "a valid dictionary"}
_INDEX = re.compile(r"\[(\d+)\]")
_WRONG_TYPE = re.compile(r"expected (an? \w+), got")
# The backend's context refusals (backend/app.py `_budget`), for their numbers.
_PROMPT_LIMIT = re.compile(r"maximum prompt length is (\d+) tokens; your prompt has (\d+) "
                           r"tokens")
_CONTEXT_LIMIT = re.compile(r"maximum context length is (\d+) tokens; you requested \d+ "
                            r"\((\d+) in the prompt, (\d+) for the completion\)")
_TEMPLATE_REFUSAL = "The messages could not be rendered by the chat template"


def _dotted(param: str) -> str:
    return _INDEX.sub(r".\1", param)


def _at(body: Any, param: str) -> Any:
    """The value at an OpenAI-style parameter path (`messages[1].content[0].type`)."""
    for name, index in re.findall(r"(\w+)|\[(\d+)\]", param):
        try:
            body = body[int(index)] if index else body[name]
        except (KeyError, IndexError, TypeError):
            return None
    return body


def _block_refusal(err: APIError, body: dict) -> str:
    block = _dotted(err.param.removesuffix(".type"))
    kind = _at(body, err.param)
    if not isinstance(kind, str):  # a number, an object: nothing to name it by
        return f"{block}: {err.message}"
    if kind in _MEDIA:
        return (f"{block}: {kind} content is not supported on this model: kvroute serves "
                "text models; send text instead.")
    if kind in _SERVER:
        return (f"{block}: '{kind}' blocks are not supported: kvroute runs no server tools "
                "(web search, web fetch, code execution, MCP, tool search); client tools "
                "answer with tool_use and tool_result blocks.")
    return f"{block}: Input tag {kind[:40]!r} found using 'type': {err.message}"


def refusal(err: APIError, body: dict) -> APIError:
    """A validation refusal of a Messages body, in Anthropic's words."""
    if not err.param:
        return err
    if err.code == mw.UNSUPPORTED_BLOCK and err.param.endswith(".type"):
        return replace(err, message=_block_refusal(err, body))
    if err.code == mw.PREFILL:
        return err  # Anthropic's sentence, which names no path
    reason = err.message
    if err.code == "missing_required_parameter":
        reason = "Field required"
    elif err.code == "invalid_type" and (m := _WRONG_TYPE.search(reason)):
        reason = f"Input should be {_VALID.get(m.group(1), m.group(1))}"
    elif reason.startswith(prefix := f"Invalid '{err.param}': "):
        reason = reason.removeprefix(prefix).removesuffix(".")  # pydantic's own reason
    return replace(err, message=f"{_dotted(err.param)}: {reason}")


def backend_refusal(err: APIError, req: MessagesRequest) -> APIError:
    """A backend's refusal of the translated chat body, in Anthropic's words where its
    API refuses the same: Claude Code compacts on `prompt is too long`, lowers max_tokens
    on `input length and max_tokens exceed context limit`, and resends its mid-
    conversation system messages as user text on `role 'system' is not supported`."""
    if err.code == "context_length_exceeded":
        if m := _PROMPT_LIMIT.search(err.message):
            return replace(err, message=f"prompt is too long: {m[2]} tokens > {m[1]} maximum")
        if m := _CONTEXT_LIMIT.search(err.message):
            return replace(err, message=(
                f"input length and `max_tokens` exceed context limit: {m[2]} + {m[3]} > "
                f"{m[1]}, decrease input length or `max_tokens` and try again"))
    if (err.status == 400 and req.mid_system is not None
            and err.message.startswith(_TEMPLATE_REFUSAL)):
        return replace(err, message=(
            f"messages.{req.mid_system}: role 'system' is not supported on this model (its chat "
            f"template refused the conversation: {err.message})"))
    if err.param == "response_format":  # the schema this API takes in output_config.format
        return replace(err, param="output_config.format")
    return err


def unknown_model(err: APIError, model: str) -> APIError:
    # Anthropic's not_found_error names the model and nothing else.
    return replace(err, message=f"model: {model}") if err.code == "model_not_found" else err


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                529: "overloaded_error"}


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_fields(err: APIError) -> dict:
    """The fields of an `error` event that ends a stream after its 200."""
    return {"error": {"type": error_type(err.status), "message": err.message}}


def _is_messages(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")


@web.middleware
async def error_envelope_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Under /v1/messages every error takes Anthropic's envelope, whoever produced it
    (validation, authentication, routing, the backend, aiohttp's 404/405/413): it wraps
    the server's error middleware and rewrites the OpenAI envelopes that one writes."""
    response = await handler(request)
    if (response.status < 400 or not _is_messages(request.path)
            or not isinstance(response, web.Response) or not isinstance(response.body, bytes)):
        return response
    try:
        message = orjson.loads(response.body)["error"]["message"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return response
    body = {"type": "error", "error": {"type": error_type(response.status), "message": message}}
    headers = {k: v for k, v in response.headers.items()
               if k.lower() not in ("content-type", "content-length")}
    return web.Response(body=orjson.dumps(body), status=response.status, headers=headers,
                        content_type="application/json")


def add_routes(app: web.Application) -> None:
    app.router.add_post(PATH, create)
    app.router.add_post(COUNT_PATH, count_tokens)

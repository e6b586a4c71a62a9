"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, carried
by the chat path.

A request becomes the canonical chat body: `system` a system message, each message's
text blocks its content (blocks joined by a blank line), an assistant's `tool_use`
blocks its tool calls (ids kept, so the next turn's body is the one the backend
advertised), a user's `tool_result` blocks tool messages; tools take OpenAI's function
format. It is routed like any chat completion (`Gateway.route_chat`), so a chat
completion and a Messages request with the same history share one cache, and the
backend's chat answer comes back as a message, or as Anthropic's event stream.

`cache_control` is accepted anywhere and ignored: every prompt is cached. Usage reports
the cached part as `cache_read_input_tokens` and the rest as `input_tokens` (Anthropic
counts them apart); nothing is billed as a cache write, so `cache_creation_input_tokens`
is 0. Errors take Anthropic's envelope (`error_envelope_middleware`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from kvroute.errors import APIError, bad_request
from kvroute.wire import COUNT_TOKENS_PATH

from .translate import (GATEWAY, ChatReply, Relay, SSEWriter, UpstreamFailed, Usage, carry_fault,
                        chat_chunks, chunk_parts, json_response, new_id, nonempty_str, number,
                        off_loop_if_large, opt, positive_int, read_json, required, string_list,
                        tool_call_parts, type_error, unsupported, upstream_error)

PATH = "/v1/messages"
COUNT_PATH = "/v1/messages/count_tokens"
# Several text blocks of one turn (Claude Code sends a few) read as paragraphs.
BLOCK_SEPARATOR = "\n\n"
MAX_STOP_SEQUENCES = 4  # the backend's limit on stop strings
UNSUPPORTED_BLOCKS = ("image", "document", "search_result", "container_upload",
                      "server_tool_use", "web_search_tool_result")


@dataclass
class MessagesRequest:
    model: str
    messages: list[dict]  # chat messages, system first when there is one
    max_tokens: int | None = None  # None for count_tokens only
    tools: list[dict] | None = None  # chat format
    tool_choice: str = "auto"
    stop_sequences: list[str] = field(default_factory=list)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False


# -- request -------------------------------------------------------------------------


def _blocks(content: Any, param: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise type_error(param, "a string or a list of content blocks", content)
    for i, block in enumerate(content):
        if not isinstance(block, dict):
            raise type_error(f"{param}[{i}]", "an object", block)
    return content


def _text_block(block: dict, p: str) -> str:
    return required(block, "text", (str,), "a string", f"{p}.text")


def _unsupported_block(kind: Any, p: str) -> APIError:
    if kind in UNSUPPORTED_BLOCKS:
        return bad_request(f"Content block type {kind!r} is not supported; kvroute serves text "
                           "models (text, tool_use and tool_result blocks).", param=f"{p}.type",
                           code="unsupported_content")
    return bad_request(f"Unknown content block type {kind!r}.", param=f"{p}.type",
                       code="invalid_value")


def _system(body: dict) -> str | None:
    system = body.get("system")
    if system is None:
        return None
    texts = []
    for i, block in enumerate(_blocks(system, "system")):
        if block.get("type") != "text":
            raise bad_request("'system' blocks must be text blocks.", param=f"system[{i}].type",
                              code="invalid_value")
        texts.append(_text_block(block, f"system[{i}]"))
    return BLOCK_SEPARATOR.join(texts)


def _tool_result_text(block: dict, p: str) -> str:
    is_error = opt(block, "is_error", (bool,), "a boolean", f"{p}.is_error")
    content = block.get("content")
    texts = []
    for i, part in enumerate(_blocks(content, f"{p}.content") if content is not None else []):
        if part.get("type") != "text":
            raise _unsupported_block(part.get("type"), f"{p}.content[{i}]")
        texts.append(_text_block(part, f"{p}.content[{i}]"))
    text = BLOCK_SEPARATOR.join(texts)
    # Chat has no error flag on a tool message: say it in the text the model reads.
    return "Error: " + text if is_error else text


def _user(content: list[dict], param: str) -> list[dict]:
    out: list[dict] = []
    texts: list[str] = []

    def flush() -> None:
        if texts:
            out.append({"role": "user", "content": BLOCK_SEPARATOR.join(texts)})
            texts.clear()

    for j, block in enumerate(content):
        p = f"{param}[{j}]"
        kind = block.get("type")
        if kind == "text":
            texts.append(_text_block(block, p))
        elif kind == "tool_result":
            flush()
            out.append({"role": "tool",
                        "tool_call_id": nonempty_str(block, "tool_use_id", f"{p}.tool_use_id"),
                        "content": _tool_result_text(block, p)})
        else:
            raise _unsupported_block(kind, p)
    flush()
    return out or [{"role": "user", "content": ""}]


def _assistant(content: list[dict], param: str) -> dict:
    texts: list[str] = []
    calls: list[dict] = []
    for j, block in enumerate(content):
        p = f"{param}[{j}]"
        kind = block.get("type")
        if kind == "text":
            texts.append(_text_block(block, p))
        elif kind == "tool_use":
            tool_input = required(block, "input", (dict,), "an object", f"{p}.input")
            calls.append({"id": nonempty_str(block, "id", f"{p}.id"), "type": "function",
                          "function": {"name": nonempty_str(block, "name", f"{p}.name"),
                                       "arguments": orjson.dumps(tool_input).decode()}})
        elif kind in ("thinking", "redacted_thinking"):
            # Anthropic ignores earlier turns' thinking too; kvroute's models send none.
            continue
        else:
            raise _unsupported_block(kind, p)
    # As the backend advertises a reply: content null when empty, calls after the text.
    msg: dict = {"role": "assistant", "content": BLOCK_SEPARATOR.join(texts) or None}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _messages(body: dict) -> list[dict]:
    messages = required(body, "messages", (list,), "a list of messages")
    if not messages:
        raise bad_request("'messages' must not be empty.", param="messages", code="invalid_value")
    out: list[dict] = []
    for i, msg in enumerate(messages):
        p = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise type_error(p, "an object", msg)
        role = msg.get("role")
        if role not in ("user", "assistant"):
            raise bad_request(f"Invalid role {role!r} in {p}; expected 'user' or 'assistant' "
                              "(the system prompt goes in 'system').", param=f"{p}.role",
                              code="invalid_value")
        if "content" not in msg:
            raise bad_request(f"'{p}.content' is required.", param=f"{p}.content",
                              code="missing_required_parameter")
        blocks = _blocks(msg["content"], f"{p}.content")
        if role == "user":
            out += _user(blocks, f"{p}.content")
        else:
            out.append(_assistant(blocks, f"{p}.content"))
    if messages[-1].get("role") == "assistant":
        # A chat template closes every assistant turn and opens a new one: continuing a
        # partial reply (prefill) cannot be expressed.
        raise bad_request("The last message must be a user message: continuing an assistant "
                          "message (prefill) is not supported.",
                          param=f"messages[{len(messages) - 1}]", code="unsupported_parameter")
    return out


def _tools(body: dict) -> list[dict] | None:
    tools = opt(body, "tools", (list,), "a list of tools")
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise type_error(p, "an object", tool)
        if tool.get("type") not in (None, "custom"):
            raise bad_request(f"Tool type {tool.get('type')!r} is not supported; only client "
                              "tools (name, description, input_schema) are.", param=f"{p}.type",
                              code="unsupported_parameter")
        fn: dict = {"name": nonempty_str(tool, "name", f"{p}.name")}
        description = opt(tool, "description", (str,), "a string", f"{p}.description")
        if description is not None:
            fn["description"] = description
        fn["parameters"] = required(tool, "input_schema", (dict,), "an object",
                                    f"{p}.input_schema")
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(body: dict) -> str:
    choice = opt(body, "tool_choice", (dict,), "an object")
    if choice is None:
        return "auto"
    opt(choice, "disable_parallel_tool_use", (bool,), "a boolean",
        "tool_choice.disable_parallel_tool_use")
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind in ("any", "tool"):
        raise unsupported("tool_choice", "Only tool_choice 'auto' and 'none' are supported.")
    raise bad_request("'tool_choice.type' must be 'auto', 'any', 'tool' or 'none'.",
                      param="tool_choice.type", code="invalid_value")


def parse(body: dict, count_only: bool = False) -> MessagesRequest:
    model = nonempty_str(body, "model")
    system = _system(body)
    messages = ([{"role": "system", "content": system}] if system is not None else []) + \
        _messages(body)
    tools = _tools(body)
    tool_choice = _tool_choice(body)
    # Accepted, without effect: no thinking blocks are produced, metadata is not kept.
    opt(body, "thinking", (dict,), "an object")
    metadata = opt(body, "metadata", (dict,), "an object")
    opt(metadata or {}, "user_id", (str,), "a string", "metadata.user_id")
    if count_only:
        return MessagesRequest(model=model, messages=messages, tools=tools, tool_choice=tool_choice)
    if opt(body, "top_k", (int,), "an integer") is not None:
        raise unsupported("top_k", "'top_k' is not supported; use temperature or top_p.")
    stops = string_list(body, "stop_sequences") or []
    if len(stops) > MAX_STOP_SEQUENCES:
        raise bad_request(f"'stop_sequences' accepts at most {MAX_STOP_SEQUENCES} sequences here, "
                          f"got {len(stops)}.", param="stop_sequences", code="invalid_value")
    return MessagesRequest(
        model=model, messages=messages,
        max_tokens=positive_int(body, "max_tokens", required_=True),
        tools=tools, tool_choice=tool_choice, stop_sequences=stops,
        temperature=number(body, "temperature", 0, 1), top_p=number(body, "top_p", 0, 1),
        stream=opt(body, "stream", (bool,), "a boolean", default=False),
    )


def chat_body(req: MessagesRequest) -> dict:
    """The canonical chat-completions body of a Messages request."""
    body: dict = {"model": req.model, "messages": req.messages, "max_tokens": req.max_tokens,
                  "stream": req.stream}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if req.tools:
        body["tools"] = req.tools
        body["tool_choice"] = req.tool_choice
    if req.stop_sequences:
        body["stop"] = req.stop_sequences
    for name, value in (("temperature", req.temperature), ("top_p", req.top_p)):
        if value is not None:
            body[name] = value
    return body


# -- response --------------------------------------------------------------------------


def _usage(u: Usage) -> dict:
    return {"input_tokens": max(0, u.prompt_tokens - u.cached_tokens),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": u.cached_tokens,
            "output_tokens": u.completion_tokens}


def _stop_reason(reply: ChatReply) -> str:
    if reply.finish_reason == "tool_calls" or reply.tool_calls:
        return "tool_use"
    if reply.finish_reason == "length":
        return "max_tokens"
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


class _MessagesRelay(Relay):
    def __init__(self, req: MessagesRequest):
        self.req = req
        self.id = new_id("msg_")

    def _message(self, content: list[dict], reply: ChatReply | None, usage: Usage) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.req.model,
                "content": content,
                "stop_reason": _stop_reason(reply) if reply else None,
                "stop_sequence": reply.stop if reply else None, "usage": _usage(usage)}

    async def whole(self, status: int, data: bytes, headers: dict) -> web.StreamResponse:
        if status >= 400:
            raise upstream_error(status, data)
        reply = ChatReply.from_completion(data)
        content = [{"type": "text", "text": reply.text}] if reply.text else []
        content += [_tool_use(call) for call in reply.tool_calls]
        return json_response(self._message(content, reply, reply.usage), headers)

    async def stream(self, request: web.Request, upstream: Any, headers: dict,
                     bid: str) -> web.StreamResponse:
        w = SSEWriter(headers)
        if not await w.start(request):
            return w.resp

        async def send(kind: str, **fields) -> bool:
            return await w.send(kind, {"type": kind, **fields})

        reply = ChatReply(usage=Usage.from_headers(headers))
        blocks = 0  # content blocks started so far
        text_open = False

        async def close_text() -> None:
            nonlocal text_open
            if text_open:
                await send("content_block_stop", index=blocks - 1)
                text_open = False

        await send("message_start", message=self._message([], None, reply.usage))
        await send("ping")
        try:
            async for chunk in chat_chunks(upstream, bid):
                if chunk.get("usage"):
                    reply.usage = Usage.from_chat(chunk["usage"])
                text, calls, finish, stop = chunk_parts(chunk)
                if text:
                    if not text_open:
                        await send("content_block_start", index=blocks,
                                   content_block={"type": "text", "text": ""})
                        blocks, text_open = blocks + 1, True
                    reply.text += text
                    await send("content_block_delta", index=blocks - 1,
                               delta={"type": "text_delta", "text": text})
                for call in calls:
                    await close_text()
                    reply.tool_calls.append(call)
                    block = _tool_use(call)
                    await send("content_block_start", index=blocks,
                               content_block={**block, "input": {}})
                    # The backend sends each call whole: one delta carries all of its input.
                    partial = orjson.dumps(block["input"]).decode()
                    await send("content_block_delta", index=blocks,
                               delta={"type": "input_json_delta", "partial_json": partial})
                    await send("content_block_stop", index=blocks)
                    blocks += 1
                if finish:
                    reply.finish_reason, reply.stop = finish, stop
                if not w.open:
                    # The client left: stop reading, so the server's forward closes upstream
                    # and the backend stops decoding (its prompt stays cached).
                    return w.resp
            await close_text()
            await send("message_delta", delta={"stop_reason": _stop_reason(reply),
                                               "stop_sequence": reply.stop},
                       usage=_usage(reply.usage))
            await send("message_stop")
        except UpstreamFailed as exc:
            await send("error", error={"type": error_type(exc.error.status),
                                       "message": exc.error.message})
        return await w.end()


async def create(request: web.Request) -> web.StreamResponse:
    t_start = time.perf_counter()
    raw, body = await read_json(request)
    req = await off_loop_if_large(len(raw), parse, body)
    return await request.app[GATEWAY].route_chat(request, carry_fault(body, chat_body(req)),
                                                 _MessagesRelay(req), t_start)


async def count_tokens(request: web.Request) -> web.Response:
    """Asks a backend serving the model to render the chat body with its chat template:
    the count equals what messages.create reports as input (uncached + cached) tokens."""
    raw, body = await read_json(request)
    req = await off_loop_if_large(len(raw), parse, body, True)
    chat: dict = {"model": req.model, "messages": req.messages}
    if req.tools:
        chat["tools"], chat["tool_choice"] = req.tools, req.tool_choice
    status, data = await request.app[GATEWAY].ask_backend(request, req.model, COUNT_TOKENS_PATH,
                                                          chat)
    if status >= 400:
        raise upstream_error(status, data)
    try:
        count = int(orjson.loads(data)["prompt_tokens"])
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        raise APIError(502, "The backend's token count could not be read.", "server_error", None,
                       "backend_failed") from None
    return json_response({"input_tokens": count}, {})


# -- errors ------------------------------------------------------------------------------

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                529: "overloaded_error"}


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


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

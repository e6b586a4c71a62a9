"""POST /v1/responses: OpenAI's Responses API, carried by the chat path.

A request becomes the canonical chat body: `instructions` a system message, then the
stored conversation of `previous_response_id` (if any), then the `input` items
(messages with text parts; a `function_call` joins the assistant message before it as
a tool call, exactly how the backend advertises a reply with tool calls; a
`function_call_output` is a tool message). Function tools take the chat format. The
body is routed like any chat completion (`Gateway.route_chat`), and the backend's chat
answer comes back as a response object, or as the documented event stream
(`response.created` ... `response.completed`, each with a `sequence_number`).

With `store` (OpenAI's default) the response's conversation is kept in Redis for the
proxy's `--response-ttl` (see response_store.py), scoped by the API key.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvroute.errors import bad_request, not_found

from .translate import (GATEWAY, ChatReply, Relay, SSEWriter, UpstreamFailed, Usage, carry_fault,
                        chat_chunks, chunk_parts, json_response, new_id, nonempty_str, number,
                        off_loop_if_large, opt, positive_int, read_json, required,
                        tool_call_parts, type_error, unsupported, upstream_error)

PATH = "/v1/responses"
ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass
class ResponsesRequest:
    model: str
    input: list[dict]  # this request's input items as chat messages
    instructions: str | None = None
    tools: list[dict] | None = None  # chat format
    tools_echo: list[dict] = field(default_factory=list)  # as sent, for the response object
    tool_choice: str = "auto"
    parallel_tool_calls: bool = True
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None  # not in OpenAI's API: kvroute's, as in chat
    metadata: dict = field(default_factory=dict)
    user: str | None = None


# -- request -------------------------------------------------------------------------


def _text(content: Any, param: str) -> str:
    """A string, or the text parts of a list joined as chat joins its content parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise type_error(param, "a string or a list of content parts", content)
    texts = []
    for i, part in enumerate(content):
        p = f"{param}[{i}]"
        if not isinstance(part, dict):
            raise type_error(p, "an object", part)
        kind = part.get("type")
        if kind not in TEXT_PARTS:
            raise bad_request(f"Content part type {kind!r} is not supported; only text parts "
                              f"({', '.join(TEXT_PARTS)}) are.", param=f"{p}.type",
                              code="unsupported_content")
        texts.append(required(part, "text", (str,), "a string", f"{p}.text"))
    return "".join(texts)


def _function_call(item: dict, p: str) -> dict:
    args = required(item, "arguments", (str,), "a JSON string", f"{p}.arguments")
    return {"id": nonempty_str(item, "call_id", f"{p}.call_id"), "type": "function",
            "function": {"name": nonempty_str(item, "name", f"{p}.name"), "arguments": args}}


def _input_messages(value: Any) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise type_error("input", "a string or a list of input items", value)
    out: list[dict] = []
    for i, item in enumerate(value):
        p = f"input[{i}]"
        if not isinstance(item, dict):
            raise type_error(p, "an object", item)
        kind = opt(item, "type", (str,), "a string", f"{p}.type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad_request(f"Invalid role {role!r} in {p}; expected one of "
                                  f"{', '.join(ROLES)}.", param=f"{p}.role", code="invalid_value")
            if "content" not in item:
                raise bad_request(f"'{p}.content' is required.", param=f"{p}.content",
                                  code="missing_required_parameter")
            out.append({"role": role, "content": _text(item["content"], f"{p}.content")})
        elif kind == "function_call":
            call = _function_call(item, p)
            prev = out[-1] if out else None
            if prev is not None and prev["role"] == "assistant":
                # The calls of one reply follow its text: together they are the one
                # assistant message the backend answered (and advertised) as that reply.
                prev.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if "output" not in item:
                raise bad_request(f"'{p}.output' is required.", param=f"{p}.output",
                                  code="missing_required_parameter")
            call_id = nonempty_str(item, "call_id", f"{p}.call_id")
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": _text(item["output"], f"{p}.output")})
        elif kind == "reasoning":
            # kvroute's models give no reasoning items; one from another provider holds
            # nothing a chat template can render (summaries, encrypted content).
            continue
        else:
            raise bad_request(f"Input item type {kind!r} is not supported; use message, "
                              "function_call or function_call_output.", param=f"{p}.type",
                              code="unsupported_parameter")
    return out


def _tools(body: dict) -> tuple[list[dict] | None, list[dict]]:
    tools = opt(body, "tools", (list,), "a list of tools")
    if not tools:
        return None, []
    out = []
    for i, tool in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise type_error(p, "an object", tool)
        if tool.get("type") != "function":
            raise bad_request(f"Tool type {tool.get('type')!r} is not supported; only function "
                              "tools are.", param=f"{p}.type", code="unsupported_parameter")
        fn: dict = {"name": nonempty_str(tool, "name", f"{p}.name")}
        description = opt(tool, "description", (str,), "a string", f"{p}.description")
        if description is not None:
            fn["description"] = description
        parameters = opt(tool, "parameters", (dict,), "an object", f"{p}.parameters")
        if parameters is not None:
            fn["parameters"] = parameters
        opt(tool, "strict", (bool,), "a boolean", f"{p}.strict")
        out.append({"type": "function", "function": fn})
    return out, tools


def _tool_choice(body: dict) -> str:
    choice = body.get("tool_choice")
    if choice is None or choice == "auto":
        return "auto"
    if choice == "none":
        return "none"
    if choice == "required" or isinstance(choice, dict):
        raise unsupported("tool_choice", "Only tool_choice 'auto' and 'none' are supported.")
    raise bad_request("'tool_choice' must be 'auto' or 'none'.", param="tool_choice",
                      code="invalid_value")


def _refuse_unsupported(body: dict) -> None:
    if opt(body, "background", (bool,), "a boolean"):
        raise unsupported("background", "'background' responses are not supported.")
    for name in ("conversation", "prompt"):
        if body.get(name) is not None:
            raise unsupported(name, f"'{name}' is not supported; send 'input' (and "
                              "'previous_response_id' to continue a stored response).")
    text = opt(body, "text", (dict,), "an object")
    fmt = opt(text or {}, "format", (dict,), "an object", "text.format")
    if fmt is not None and fmt.get("type") != "text":
        raise unsupported("text.format", "Only text.format {'type': 'text'} is supported.")
    if opt(body, "top_logprobs", (int,), "an integer"):
        raise unsupported("top_logprobs", "'top_logprobs' is not supported on /v1/responses.")
    truncation = opt(body, "truncation", (str,), "a string")
    if truncation not in (None, "auto", "disabled"):
        raise bad_request("'truncation' must be 'auto' or 'disabled'.", param="truncation",
                          code="invalid_value")
    include = opt(body, "include", (list,), "a list of strings")
    if include is not None and not all(isinstance(v, str) for v in include):
        raise type_error("include", "a list of strings", include)
    # Accepted, and without effect: kvroute's models do not reason, caching is automatic.
    opt(body, "reasoning", (dict,), "an object")
    opt(body, "prompt_cache_key", (str,), "a string")
    opt(body, "service_tier", (str,), "a string")


def _stop(body: dict) -> str | list[str] | None:
    stop = body.get("stop")
    if stop is None or isinstance(stop, str):
        return stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise type_error("stop", "a string or a list of strings", stop)
    return stop  # its length is checked by the backend, as for chat


def parse(body: dict) -> ResponsesRequest:
    model = nonempty_str(body, "model")
    _refuse_unsupported(body)
    if "input" not in body or body["input"] is None:
        raise bad_request("'input' is required.", param="input", code="missing_required_parameter")
    items = _input_messages(body["input"])
    tools, echo = _tools(body)
    previous = opt(body, "previous_response_id", (str,), "a string")
    metadata = opt(body, "metadata", (dict,), "an object", default={})
    return ResponsesRequest(
        model=model, input=items,
        instructions=opt(body, "instructions", (str,), "a string"),
        tools=tools, tools_echo=echo, tool_choice=_tool_choice(body),
        parallel_tool_calls=opt(body, "parallel_tool_calls", (bool,), "a boolean", default=True),
        stream=opt(body, "stream", (bool,), "a boolean", default=False),
        store=opt(body, "store", (bool,), "a boolean", default=True),
        previous_response_id=previous,
        max_output_tokens=positive_int(body, "max_output_tokens"),
        temperature=number(body, "temperature", 0, 2),
        top_p=number(body, "top_p", 0, 1),
        stop=_stop(body),
        metadata=metadata,
        user=opt(body, "user", (str,), "a string"),
    )


def chat_body(req: ResponsesRequest, history: list[dict]) -> dict:
    """The canonical chat-completions body of a Responses request."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages = system + history + req.input
    if not messages:
        raise bad_request("'input' must not be empty.", param="input", code="invalid_value")
    body: dict = {"model": req.model, "messages": messages, "stream": req.stream}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if req.tools:
        body["tools"] = req.tools
        body["tool_choice"] = req.tool_choice
    for name, value in (("max_tokens", req.max_output_tokens), ("temperature", req.temperature),
                        ("top_p", req.top_p), ("stop", req.stop)):
        if value is not None:
            body[name] = value
    return body


# -- response --------------------------------------------------------------------------

_CHAT_PARAMS = {"max_tokens": "max_output_tokens", "messages": "input"}


def _usage(u: Usage) -> dict:
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [_text_part(text)] if status == "completed" else []}


def _call_item(item_id: str, call: dict, status: str) -> dict:
    call_id, name, args = tool_call_parts(call)
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id,
            "name": name, "arguments": args if status == "completed" else ""}


class _ResponsesRelay(Relay):
    def __init__(self, request: web.Request, req: ResponsesRequest, history: list[dict]):
        self.gateway = request.app[GATEWAY]
        self.scope = request.get("scope")
        self.req = req
        self.history = history
        self.id = new_id("resp_")
        self.created = int(time.time())

    def _object(self, status: str, output: list[dict], usage: Usage | None,
                error: dict | None = None) -> dict:
        r = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "background": False, "error": error,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "model": r.model, "output": output, "parallel_tool_calls": r.parallel_tool_calls,
            "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": r.store,
            "temperature": 1.0 if r.temperature is None else r.temperature,
            "text": {"format": {"type": "text"}}, "tool_choice": r.tool_choice,
            "tools": r.tools_echo, "top_p": 1.0 if r.top_p is None else r.top_p,
            "truncation": "disabled", "usage": _usage(usage) if usage else None,
            "user": r.user, "metadata": r.metadata,
        }

    async def _finish(self, reply: ChatReply, output: list[dict]) -> dict:
        status = "incomplete" if reply.finish_reason == "length" else "completed"
        if self.req.store:
            messages = self.history + self.req.input + [reply.message()]
            await self.gateway.responses.put(self.scope, self.id, {"v": 1, "messages": messages})
        return self._object(status, output, reply.usage)

    async def whole(self, status: int, data: bytes, headers: dict) -> web.StreamResponse:
        if status >= 400:
            err = upstream_error(status, data)
            # The backend names chat parameters; say which of this request's it means.
            err.param = _CHAT_PARAMS.get(err.param or "", err.param)
            raise err
        reply = ChatReply.from_completion(data)
        output = []
        if reply.text or not reply.tool_calls:
            output.append(_message_item(new_id("msg_"), reply.text, "completed"))
        output += [_call_item(new_id("fc_"), call, "completed") for call in reply.tool_calls]
        return json_response(await self._finish(reply, output), headers)

    async def stream(self, request: web.Request, upstream: Any, headers: dict,
                     bid: str) -> web.StreamResponse:
        w = SSEWriter(headers)
        if not await w.start(request):
            return w.resp
        seq = itertools.count()

        async def send(kind: str, **fields) -> bool:
            return await w.send(kind, {"type": kind, "sequence_number": next(seq), **fields})

        output: list[dict] = []  # finished items, in output_index order
        reply = ChatReply(usage=Usage.from_headers(headers))
        message: dict | None = None  # the open message item, while its text streams

        async def close_message() -> None:
            nonlocal message
            if message is None:
                return
            item, index = message, len(output)
            text = item["text"]
            ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
            await send("response.output_text.done", **ids, text=text, logprobs=[])
            await send("response.content_part.done", **ids, part=_text_part(text))
            done = _message_item(item["id"], text, "completed")
            await send("response.output_item.done", output_index=index, item=done)
            output.append(done)
            message = None

        initial = self._object("in_progress", [], None)
        await send("response.created", response=initial)
        await send("response.in_progress", response=initial)
        try:
            async for chunk in chat_chunks(upstream, bid):
                if chunk.get("usage"):
                    reply.usage = Usage.from_chat(chunk["usage"])
                text, calls, finish, stop = chunk_parts(chunk)
                if text:
                    if message is None:
                        message = {"id": new_id("msg_"), "text": ""}
                        index = len(output)
                        await send("response.output_item.added", output_index=index,
                                   item=_message_item(message["id"], "", "in_progress"))
                        await send("response.content_part.added", item_id=message["id"],
                                   output_index=index, content_index=0, part=_text_part(""))
                    message["text"] += text
                    reply.text += text
                    await send("response.output_text.delta", item_id=message["id"],
                               output_index=len(output), content_index=0, delta=text, logprobs=[])
                for call in calls:
                    await close_message()
                    reply.tool_calls.append(call)
                    item_id, index = new_id("fc_"), len(output)
                    done = _call_item(item_id, call, "completed")
                    await send("response.output_item.added", output_index=index,
                               item=_call_item(item_id, call, "in_progress"))
                    # The backend sends each call whole: one delta carries all arguments.
                    await send("response.function_call_arguments.delta", item_id=item_id,
                               output_index=index, delta=done["arguments"])
                    await send("response.function_call_arguments.done", item_id=item_id,
                               output_index=index, name=done["name"], arguments=done["arguments"])
                    await send("response.output_item.done", output_index=index, item=done)
                    output.append(done)
                if finish:
                    reply.finish_reason, reply.stop = finish, stop
                if not w.open:
                    # The client left: stop reading, so the server's forward closes upstream
                    # and the backend stops decoding (its prompt stays cached).
                    return w.resp
            if not output and message is None:  # an empty reply is still one message
                message = {"id": new_id("msg_"), "text": ""}
                await send("response.output_item.added", output_index=0,
                           item=_message_item(message["id"], "", "in_progress"))
                await send("response.content_part.added", item_id=message["id"], output_index=0,
                           content_index=0, part=_text_part(""))
            await close_message()
            final = await self._finish(reply, output)
            incomplete = final["status"] == "incomplete"
            await send("response.incomplete" if incomplete else "response.completed",
                       response=final)
        except UpstreamFailed as exc:
            err = exc.error
            await send("error", code=err.code or err.type, message=err.message, param=err.param)
            await send("response.failed", response=self._object(
                "failed", output, None, error={"code": err.code or "server_error",
                                               "message": err.message}))
        return await w.end()


async def create(request: web.Request) -> web.StreamResponse:
    t_start = time.perf_counter()
    gateway = request.app[GATEWAY]
    raw, body = await read_json(request)
    req = await off_loop_if_large(len(raw), parse, body)
    history: list[dict] = []
    if req.previous_response_id is not None:
        record = await gateway.responses.get(request.get("scope"), req.previous_response_id)
        if record is None or not isinstance(record.get("messages"), list):
            raise not_found(f"Previous response with id '{req.previous_response_id[:100]}' not "
                            "found.", param="previous_response_id",
                            code="previous_response_not_found")
        history = record["messages"]
    chat = carry_fault(body, chat_body(req, history))
    return await gateway.route_chat(request, chat, _ResponsesRelay(request, req, history), t_start)


def add_routes(app: web.Application) -> None:
    app.router.add_post(PATH, create)


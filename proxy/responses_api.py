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

from kvroute import responses_wire as rw
from kvroute.errors import bad_request, not_found
from kvroute.validation import validate

from .translate import (GATEWAY, ChatReply, Relay, SSEWriter, UpstreamFailed, Usage, carry_fault,
                        chat_chunks, chunk_parts, json_response, new_id, off_loop_if_large,
                        read_json, tool_call_parts, upstream_error)

PATH = "/v1/responses"


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


def _text(content: rw.Text) -> str:
    """A string, or the text parts of a list joined as chat joins its content parts."""
    return content if isinstance(content, str) else "".join(p.text for p in content)


def _input_messages(value: str | list) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict] = []
    for item in value:
        if isinstance(item, rw.MessageItem):
            out.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, rw.FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            prev = out[-1] if out else None
            if prev is not None and prev["role"] == "assistant":
                # The calls of one reply follow its text: together they are the one
                # assistant message the backend answered (and advertised) as that reply.
                prev.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, rw.FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": _text(item.output)})
        # A reasoning item holds nothing a chat template can render: dropped.
    return out


def _chat_tool(tool: rw.FunctionTool) -> dict:
    fn: dict = {"name": tool.name}
    if tool.description is not None:
        fn["description"] = tool.description
    if tool.parameters is not None:
        fn["parameters"] = tool.parameters
    return {"type": "function", "function": fn}


def parse(body: dict) -> ResponsesRequest:
    req = validate(rw.ResponsesBody, body)
    return ResponsesRequest(
        model=req.model, input=_input_messages(req.input), instructions=req.instructions,
        tools=[_chat_tool(t) for t in req.tools] if req.tools else None,
        tools_echo=body["tools"] if req.tools else [],  # as sent
        tool_choice=req.tool_choice or "auto",
        parallel_tool_calls=req.parallel_tool_calls is not False,
        stream=bool(req.stream), store=req.store is not False,
        previous_response_id=req.previous_response_id,
        max_output_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p,
        stop=req.stop, metadata=req.metadata or {}, user=req.user,
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


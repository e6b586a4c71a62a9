"""/v1/responses: OpenAI's Responses API, carried by the chat path.

A request becomes the canonical chat body: `instructions` a system message, then the
stored conversation of `previous_response_id` (if any), then the `input` items
(messages with text parts; a tool call joins the assistant message before it as a
chat tool call, exactly how the backend advertises a reply with tool calls; a tool
call's output is a tool message). The body is routed like any chat completion
(`Gateway.route_chat`), and the backend's chat answer comes back as a response
object, or as the documented event stream (`response.created` ...
`response.completed`, each with a `sequence_number`).

Tools become chat function tools, each under the name the model sees:

- a function tool: its own name;
- a function of a `namespace` tool: Codex's flat name for it, `namespace__name`
  (codex-rs `ToolName::canonical_flat_name`: the namespace's trailing and the name's
  leading underscores trimmed; Codex's default namespace `functions` adds nothing).
  Its call comes back as Codex reads it: `name` the function's own, `namespace` set;
- a freeform `custom` tool (apply_patch): a function of one string, `input`, whose
  description carries the tool's grammar; its call comes back as a
  `custom_tool_call` with that string as `input`;
- `local_shell`: a function `local_shell` taking `command` (an argv array),
  `working_directory` and `timeout_ms`; its call comes back as a `local_shell_call`;
- a tool OpenAI's servers run (web search, file search, ...): not offered, and named
  in the answer's `x-kvroute-ignored-tools` header.

A call input item of any kind translates back to the chat tool call the backend
answered with, so the next turn's prefix keys continue the last one's.

With `store` (OpenAI's default) the response (its conversation, the response object
for `GET /v1/responses/{id}` and its input items for `GET .../input_items`) is kept in
Redis for the proxy's `--response-ttl` (see store.py), scoped by the API key.
"""

from __future__ import annotations

import itertools
import re
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from kvroute.api import responses as rw
from kvroute.api.errors import APIError, bad_request, not_found
from kvroute.api.http import json_response, off_loop_if_large, read_json
from kvroute.api.validation import TOOL_NAME, validate
from kvroute.api.routes import RESPONSES_PATH

from .gateway import GATEWAY, Relay, SSEWriter, carry_fault, sse_event
from .reply import ChatReply, Usage, new_id, tool_call_parts

PATH = RESPONSES_PATH
IGNORED_TOOLS_HEADER = "x-kvroute-ignored-tools"
DEFAULT_NAMESPACE = "functions"  # Codex's namespace of top-level tools
LOCAL_SHELL = "local_shell"
# A freeform tool's one parameter, as Codex itself offers freeform tools to providers
# that only have function tools.
CUSTOM_INPUT = "input"
_LOCAL_SHELL_PARAMETERS = {
    "type": "object",
    "properties": {
        "command": {"type": "array", "items": {"type": "string"},
                    "description": "The program and its arguments, one string each."},
        "working_directory": {"type": "string"},
        "timeout_ms": {"type": "integer"},
    },
    "required": ["command"],
}


@dataclass(frozen=True)
class ToolRoute:
    """The client's tool behind a name the model sees (other than a plain function's)."""

    kind: str  # "function" (in a namespace), "custom" or "local_shell"
    name: str  # the tool's own name
    namespace: str | None = None


@dataclass
class ResponsesRequest:
    model: str
    input: list[dict]  # this request's input items as chat messages
    instructions: str | None = None
    tools: list[dict] | None = None  # chat format
    tools_echo: list[dict] = field(default_factory=list)  # as sent, for the response object
    routes: dict[str, ToolRoute] = field(default_factory=dict)  # by the name the model sees
    ignored_tools: list[str] = field(default_factory=list)  # hosted tool types, in order
    tool_choice: str | dict = "auto"
    parallel_tool_calls: bool = True
    text_format: dict | None = None  # text.format as sent (json_schema, json_object), for the echo
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None  # not in OpenAI's API: kvroute's, as in chat
    metadata: dict = field(default_factory=dict)
    user: str | None = None
    verbosity: str | None = None
    prompt_cache_key: str | None = None
    logprobs: bool = False  # `include` names rw.INCLUDE_LOGPROBS
    top_logprobs: int | None = None
    # The input items as GET .../input_items lists them (each with an id); only when stored.
    input_items: list[dict] = field(default_factory=list)


# -- request: tools --------------------------------------------------------------------


def flat_name(namespace: str | None, name: str) -> str:
    """The name the model sees for `name` in `namespace` (Codex's canonical flat name)."""
    if not namespace or namespace == DEFAULT_NAMESPACE:
        return name
    return f"{namespace.rstrip('_')}__{name.lstrip('_')}"


# Every name the model sees, namespace and all, meets the chat API's rule.
_TOOL_NAME = re.compile(TOOL_NAME)


def _function(name: str, description: str | None, parameters: dict | None) -> dict:
    fn: dict = {"name": name}
    if description is not None:
        fn["description"] = description
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


def _custom_function(name: str, tool: rw.CustomTool) -> dict:
    # A freeform tool's input is text the model writes; a chat model writes function
    # arguments, so it gets one string argument, and the grammar the text must follow
    # (Codex's apply_patch has a Lark one) goes into the description.
    about = tool.description or ""
    fmt = tool.format
    if fmt is not None and fmt.type == "grammar" and fmt.definition:
        about += (f"\n\nThe '{CUSTOM_INPUT}' argument is text in this "
                  f"{fmt.syntax or 'grammar'} grammar:\n{fmt.definition}")
    parameters = {"type": "object", "properties": {CUSTOM_INPUT: {"type": "string"}},
                  "required": [CUSTOM_INPUT]}
    return _function(name, about.strip() or None, parameters)


def _chat_tools(tools: list) -> tuple[list[dict], dict[str, ToolRoute], list[str]]:
    """(chat tools, routes by the names the model sees, ignored hosted tool types)."""
    chat: list[dict] = []
    routes: dict[str, ToolRoute] = {}
    plain: set[str] = set()
    ignored: list[str] = []

    def add(tool: rw.FunctionTool | rw.CustomTool, namespace: str | None, param: str) -> None:
        name = flat_name(namespace, tool.name)
        if not _TOOL_NAME.fullmatch(name):
            # Refused here, naming this body's field: the chat body would name its own.
            raise bad_request(
                f"Invalid tool name {name[:140]!r}"
                + (f" (namespace {namespace[:60]!r} and name {tool.name[:60]!r})" if namespace else "")
                + ": a tool's name, namespace and all, is 1-128 letters, digits, '_' or '-'.",
                param=param, code="invalid_value")
        if isinstance(tool, rw.CustomTool):
            chat.append(_custom_function(name, tool))
            routes.setdefault(name, ToolRoute("custom", tool.name, namespace))
        else:
            chat.append(_function(name, tool.description, tool.parameters))
            if namespace is None:
                plain.add(name)
            else:
                routes.setdefault(name, ToolRoute("function", tool.name, namespace))

    for i, tool in enumerate(tools):
        if isinstance(tool, rw.NamespaceTool):
            for j, member in enumerate(tool.tools):
                add(member, tool.name, f"tools[{i}].tools[{j}].name")
        elif isinstance(tool, rw.LocalShellTool):
            if LOCAL_SHELL in routes:
                continue
            chat.append(_function(LOCAL_SHELL, "Runs a command on the user's machine.",
                                  _LOCAL_SHELL_PARAMETERS))
            routes.setdefault(LOCAL_SHELL, ToolRoute("local_shell", LOCAL_SHELL))
        elif isinstance(tool, rw.HostedTool):
            if tool.type not in ignored:
                ignored.append(tool.type)
        else:
            add(tool, None, f"tools[{i}].name")
    # A plain function answers to its own name, whatever else flattens to the same.
    return chat, {n: r for n, r in routes.items() if n not in plain}, ignored


# -- request: input items ----------------------------------------------------------------


def _part_text(part: rw.InputTextPart | rw.RefusalPart) -> str:
    # An assistant's refusal was its answer: the model sees it as that turn's text.
    return part.refusal if isinstance(part, rw.RefusalPart) else part.text


def _text(content: rw.Text | rw.Content) -> str:
    """A string, or the text parts of a list joined as chat joins its content parts."""
    return content if isinstance(content, str) else "".join(_part_text(p) for p in content)


def _content(content: rw.Content) -> str | list[dict]:
    """A message's content as chat takes it: its text, or with images, chat content
    parts with each image where it stands."""
    if isinstance(content, str) or not any(isinstance(p, rw.InputImagePart) for p in content):
        return _text(content)
    return [{"type": "image_url", "image_url": {"url": p.image_url}}
            if isinstance(p, rw.InputImagePart) else {"type": "text", "text": _part_text(p)}
            for p in content]


def _json(value: Any) -> str:
    return orjson.dumps(value).decode()


def _shell_arguments(action: rw.LocalShellAction) -> str:
    args: dict = {"command": action.command}
    if action.working_directory is not None:
        args["working_directory"] = action.working_directory
    if action.timeout_ms is not None:
        args["timeout_ms"] = action.timeout_ms
    return _json(args)


def _call_of(item: Any) -> dict | None:
    """The chat tool call of a call item: the name the model used, its arguments JSON."""
    if isinstance(item, rw.FunctionCallItem):
        name, args = flat_name(item.namespace, item.name), item.arguments
    elif isinstance(item, rw.CustomToolCallItem):
        name, args = flat_name(item.namespace, item.name), _json({CUSTOM_INPUT: item.input})
    elif isinstance(item, rw.LocalShellCallItem):
        name, args = LOCAL_SHELL, _shell_arguments(item.action)
    else:
        return None
    return {"id": item.call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _input_messages(value: str | list) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict] = []
    for item in value:
        if isinstance(item, rw.MessageItem):
            out.append({"role": item.role, "content": _content(item.content)})
        elif (call := _call_of(item)) is not None:
            prev = out[-1] if out else None
            if prev is not None and prev["role"] == "assistant":
                # The calls of one reply follow its text: together they are the one
                # assistant message the backend answered (and advertised) as that reply.
                prev.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, (rw.FunctionCallOutputItem, rw.CustomToolCallOutputItem)):
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": _text(item.output)})
        elif isinstance(item, rw.LocalShellCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call, "content": _text(item.output)})
        # A reasoning item holds nothing a chat template can render: dropped.
    return out


# -- request: input items as stored ---------------------------------------------------

_ITEM_ID_PREFIX = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_",
                   "custom_tool_call": "ctc_", "custom_tool_call_output": "ctco_",
                   "local_shell_call": "lsh_", "local_shell_call_output": "lsho_",
                   "reasoning": "rs_"}
# The item types whose objects carry a status when OpenAI lists them.
_WITH_STATUS = {"message", "function_call", "function_call_output", "local_shell_call",
                "local_shell_call_output"}


def _listed_part(part: dict, role: str) -> dict:
    """A content part as OpenAI lists it: an assistant's text is output_text, any other
    role's input_text."""
    if part.get("type") not in ("input_text", "output_text", "text"):
        return part  # a refusal, as sent (images are never stored)
    if role == "assistant":
        return {"type": "output_text", "text": part.get("text", ""),
                "annotations": part.get("annotations") or [], "logprobs": []}
    return {"type": "input_text", "text": part.get("text", "")}


def _listed_item(item: dict) -> dict:
    """One input item (validated) as GET .../input_items lists it: as sent, with an id
    (the client's, or a new one) and a status, a message's content as a list of parts."""
    kind = item.get("type") or "message"
    out = {**item, "type": kind}
    if not isinstance(out.get("id"), str) or not out["id"]:
        out["id"] = new_id(_ITEM_ID_PREFIX.get(kind, "item_"))
    if kind in _WITH_STATUS:
        out.setdefault("status", "completed")
    if kind == "message":
        content = item["content"]
        parts = [{"type": "input_text", "text": content}] if isinstance(content, str) else content
        out["content"] = [_listed_part(p, item["role"]) for p in parts]
    return out


def _listed_items(value: str | list) -> list[dict]:
    if isinstance(value, str):
        return [_listed_item({"type": "message", "role": "user", "content": value})]
    return [_listed_item(item) for item in value]


def parse(body: dict) -> ResponsesRequest:
    req = validate(rw.ResponsesBody, body)
    tools, routes, ignored = _chat_tools(req.tools or [])
    messages = _input_messages(req.input)
    # Stored conversations live in Redis, which never holds an image (DESIGN.md
    # invariant 3): a response with images in its input is not stored.
    images = any(isinstance(m["content"], list) for m in messages)
    store = req.store is not False and not images
    out = ResponsesRequest(
        model=req.model, input=messages, instructions=req.instructions,
        tools=tools or None, tools_echo=body["tools"] if req.tools else [],  # as sent
        routes=routes, ignored_tools=ignored,
        tool_choice=body["tool_choice"] if req.tool_choice else "auto",  # as sent
        parallel_tool_calls=req.parallel_tool_calls is not False,
        stream=bool(req.stream), store=store,
        previous_response_id=req.previous_response_id,
        max_output_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p,
        stop=req.stop, metadata=req.metadata or {}, user=req.user,
        verbosity=req.text.verbosity if req.text else None,
        prompt_cache_key=req.prompt_cache_key,
        text_format=body["text"]["format"] if req.text and req.text.format else None,
        logprobs=rw.INCLUDE_LOGPROBS in (req.include or []), top_logprobs=req.top_logprobs,
        input_items=_listed_items(body["input"]) if store else [],
    )
    if out.tool_choice not in ("auto", "none") and not out.tools:
        raise bad_request("A forced tool_choice needs a function tool: kvroute runs none of "
                          "the hosted tools.", param="tool_choice", code="invalid_value")
    return out


def _chat_tool_choice(choice: str | dict) -> str | dict:
    """Responses' {"type": "function", "name"} as chat's {"type": "function", "function":
    {"name"}}."""
    if isinstance(choice, dict):
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(fmt: dict | None) -> dict | None:
    """Responses' text.format as chat's response_format (json_schema's fields nested)."""
    if fmt is None or fmt.get("type") != "json_schema":
        return fmt
    return {"type": "json_schema",
            "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


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
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)
        if not req.parallel_tool_calls:
            body["parallel_tool_calls"] = False
    if (fmt := _response_format(req.text_format)) is not None:
        body["response_format"] = fmt
    for name, value in (("max_tokens", req.max_output_tokens), ("temperature", req.temperature),
                        ("top_p", req.top_p), ("stop", req.stop)):
        if value is not None:
            body[name] = value
    if req.logprobs:
        body["logprobs"] = True
        if req.top_logprobs is not None:
            body["top_logprobs"] = req.top_logprobs
    return body


# -- response: output items --------------------------------------------------------------

_CHAT_PARAMS = {"max_tokens": "max_output_tokens", "messages": "input",
                "response_format": "text.format", "logprobs": "include"}


def _usage(u: Usage) -> dict:
    # Every field the SDK's ResponseUsage requires. Cache writes are not counted
    # (kvroute caches every prompt), as Messages' cache_creation_input_tokens is 0.
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def _top(alternatives: Any, with_bytes: bool) -> list[dict]:
    out = []
    for t in alternatives if isinstance(alternatives, list) else []:
        if isinstance(t, dict):
            top = {"token": t.get("token", ""), "logprob": t.get("logprob", 0.0)}
            out.append({**top, "bytes": t.get("bytes") or []} if with_bytes else top)
    return out


def part_logprobs(entries: list[dict]) -> list[dict]:
    """Chat logprob entries as an output_text part's `logprobs`."""
    return [{"token": e.get("token", ""), "logprob": e.get("logprob", 0.0),
             "bytes": e.get("bytes") or [], "top_logprobs": _top(e.get("top_logprobs"), True)}
            for e in entries]


def event_logprobs(entries: list[dict]) -> list[dict]:
    """Chat logprob entries as the `logprobs` of an output_text delta or done event
    (OpenAI's events carry no bytes)."""
    return [{"token": e.get("token", ""), "logprob": e.get("logprob", 0.0),
             "top_logprobs": _top(e.get("top_logprobs"), False)} for e in entries]


def _text_part(text: str, logprobs: list[dict] | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [],
            "logprobs": part_logprobs(logprobs or [])}


def _message_item(item_id: str, text: str, status: str,
                  logprobs: list[dict] | None = None) -> dict:
    """The assistant's message item: `incomplete` when max_output_tokens cut its text."""
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [] if status == "in_progress" else [_text_part(text, logprobs)]}


def _status(reply: ChatReply) -> str:
    return "incomplete" if reply.finish_reason == "length" else "completed"


def _custom_input(args: str) -> str:
    """The text a freeform call carries: its one argument, or what the model wrote when
    it did not write that argument."""
    try:
        parsed = orjson.loads(args)
    except orjson.JSONDecodeError:
        return args
    if isinstance(parsed, dict) and isinstance(parsed.get(CUSTOM_INPUT), str) and len(parsed) == 1:
        return parsed[CUSTOM_INPUT]
    return args


def _shell_action(args: str) -> dict:
    try:
        parsed = orjson.loads(args)
    except orjson.JSONDecodeError:
        parsed = {}
    parsed = parsed if isinstance(parsed, dict) else {}
    command = parsed.get("command")
    if isinstance(command, str):
        command = [command]
    command = [str(c) for c in command] if isinstance(command, list) else []
    timeout = parsed.get("timeout_ms")
    cwd = parsed.get("working_directory")
    return {"type": "exec", "command": command, "env": {},
            "timeout_ms": timeout if isinstance(timeout, int) and not isinstance(timeout, bool)
            else None,
            "working_directory": cwd if isinstance(cwd, str) else None, "user": None}


_ITEM_PREFIX = {"function": "fc_", "custom": "ctc_", "local_shell": "lsh_"}


@dataclass
class OutputCall:
    """One tool call of the reply, as the output item of the client's kind of tool."""

    item_id: str
    call_id: str
    route: ToolRoute
    arguments: str  # as the model wrote them

    @classmethod
    def of(cls, call: dict, routes: dict[str, ToolRoute]) -> "OutputCall":
        call_id, name, args = tool_call_parts(call)
        route = routes.get(name) or ToolRoute("function", name)
        return cls(new_id(_ITEM_PREFIX[route.kind]), call_id, route, args)

    def item(self, status: str) -> dict:
        r, done = self.route, status == "completed"
        if r.kind == "local_shell":
            return {"id": self.item_id, "type": "local_shell_call", "status": status,
                    "call_id": self.call_id, "action": _shell_action(self.arguments)}
        if r.kind == "custom":
            item = {"id": self.item_id, "type": "custom_tool_call", "call_id": self.call_id,
                    "name": r.name, "input": _custom_input(self.arguments) if done else ""}
        else:
            item = {"id": self.item_id, "type": "function_call", "status": status,
                    "call_id": self.call_id, "name": r.name,
                    "arguments": self.arguments if done else ""}
        if r.namespace is not None:
            item["namespace"] = r.namespace
        return item

    def argument_events(self, index: int) -> list[tuple[str, dict]]:
        """The events between the item's `added` and `done` (the backend sends each call
        whole: one delta carries it all)."""
        ids = {"item_id": self.item_id, "output_index": index}
        if self.route.kind == "custom":
            text = _custom_input(self.arguments)
            return [("response.custom_tool_call_input.delta", {**ids, "delta": text}),
                    ("response.custom_tool_call_input.done", {**ids, "input": text})]
        if self.route.kind == "function":
            return [("response.function_call_arguments.delta", {**ids, "delta": self.arguments}),
                    ("response.function_call_arguments.done",
                     {**ids, "name": self.route.name, "arguments": self.arguments})]
        return []


class _ResponsesRelay(Relay):
    def __init__(self, request: web.Request, req: ResponsesRequest, history: list[dict],
                 history_items: list[dict]):
        self.gateway = request.app[GATEWAY]
        self.scope = request.get("scope")
        self.req = req
        self.history = history
        self.history_items = history_items  # the continued response's input and output items
        self.id = new_id("resp_")
        self.created = int(time.time())

    def headers(self, headers: dict) -> dict:
        if self.req.ignored_tools:
            return {**headers, IGNORED_TOOLS_HEADER: ",".join(self.req.ignored_tools)}
        return headers

    def response(self, status: str, output: list[dict], usage: Usage | None,
                 error: dict | None = None) -> dict:
        """The response object, as its create answers it and its stream's events carry it."""
        r = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "background": False, "error": error,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "model": r.model, "output": output, "parallel_tool_calls": r.parallel_tool_calls,
            "previous_response_id": r.previous_response_id,
            "prompt_cache_key": r.prompt_cache_key,
            "reasoning": {"effort": None, "summary": None}, "store": r.store,
            "temperature": 1.0 if r.temperature is None else r.temperature,
            "text": {"format": r.text_format or {"type": "text"},
                     "verbosity": r.verbosity or "medium"},
            "tool_choice": r.tool_choice,
            "tools": r.tools_echo, "top_p": 1.0 if r.top_p is None else r.top_p,
            "truncation": "disabled", "usage": _usage(usage) if usage else None,
            "user": r.user, "metadata": r.metadata,
        }

    async def finish(self, reply: ChatReply, output: list[dict]) -> dict:
        """The finished response object, stored (with its conversation) unless `store`
        is false."""
        obj = self.response(_status(reply), output, reply.usage)
        if self.req.store:
            messages = self.history + self.req.input + [reply.message()]
            items = self.history_items + self.req.input_items
            await self.gateway.responses.put(self.scope, self.id, {
                "v": 1, "messages": messages, "response": obj, "items": items})
        return obj

    def held_error(self, err: APIError) -> bytes:
        # Nothing was sent before it: the stream's first event.
        return sse_event("error", {"type": "error", "sequence_number": 0, **error_fields(err)})

    def refusal(self, err: APIError) -> APIError:
        # The backend names chat parameters; say which of this request's it means.
        err.param = _CHAT_PARAMS.get(err.param or "", err.param)
        return err

    async def answer(self, reply: ChatReply) -> dict:
        output = []
        if reply.text or not reply.tool_calls:
            # Calls come after the text: the text was cut only when the reply ends in it.
            status = "completed" if reply.tool_calls else _status(reply)
            output.append(_message_item(new_id("msg_"), reply.text, status, reply.logprobs))
        output += [OutputCall.of(call, self.req.routes).item("completed")
                   for call in reply.tool_calls]
        return await self.finish(reply, output)

    def events(self, sse: SSEWriter, reply: ChatReply) -> "_ResponsesEvents":
        return _ResponsesEvents(self, sse, reply)


class _ResponsesEvents:
    """The Responses stream of one reply, every event with its `sequence_number`:
    response.created and .in_progress; an output item per text run (a message, its
    text in deltas) and per tool call (the item of the client's kind of tool, its
    arguments in one delta: the backend sends each call whole); then
    response.completed or .incomplete with the finished response object."""

    def __init__(self, relay: _ResponsesRelay, sse: SSEWriter, reply: ChatReply):
        self.relay, self.sse, self.reply = relay, sse, reply
        self.seq = itertools.count()
        self.output: list[dict] = []  # finished items, in output_index order
        self.message: dict | None = None  # the open message item, while its text streams
        self.placed = 0  # the reply's text logprobs already sent in a delta

    async def send(self, kind: str, **fields) -> bool:
        return await self.sse.send(kind, {"type": kind, "sequence_number": next(self.seq),
                                          **fields})

    async def begin(self) -> None:
        initial = self.relay.response("in_progress", [], None)
        await self.send("response.created", response=initial)
        await self.send("response.in_progress", response=initial)

    async def text(self, text: str) -> None:
        if self.message is None:
            await self._open_message()
        new = self.reply.logprobs[self.placed:]
        self.placed += len(new)
        self.message["text"] += text
        self.message["logprobs"] += new
        await self.send("response.output_text.delta", item_id=self.message["id"],
                        output_index=len(self.output), content_index=0, delta=text,
                        logprobs=event_logprobs(new))

    async def tool_call(self, call: dict) -> None:
        await self._close_message("completed")  # a call follows: the text was not cut
        out, index = OutputCall.of(call, self.relay.req.routes), len(self.output)
        await self.send("response.output_item.added", output_index=index,
                        item=out.item("in_progress"))
        for kind, fields in out.argument_events(index):
            await self.send(kind, **fields)
        done = out.item("completed")
        await self.send("response.output_item.done", output_index=index, item=done)
        self.output.append(done)

    async def end(self) -> None:
        if not self.output and self.message is None:  # an empty reply is still one message
            await self._open_message()
        await self._close_message(_status(self.reply))
        final = await self.relay.finish(self.reply, self.output)
        incomplete = final["status"] == "incomplete"
        await self.send("response.incomplete" if incomplete else "response.completed",
                        response=final)

    async def fail(self, error: APIError) -> None:
        await self.send("error", **error_fields(error))
        await self.send("response.failed", response=self.relay.response(
            "failed", self.output, None, error={"code": error.code or "server_error",
                                                "message": error.message}))

    async def _open_message(self) -> None:
        self.message = {"id": new_id("msg_"), "text": "", "logprobs": []}
        index = len(self.output)
        await self.send("response.output_item.added", output_index=index,
                        item=_message_item(self.message["id"], "", "in_progress"))
        await self.send("response.content_part.added", item_id=self.message["id"],
                        output_index=index, content_index=0, part=_text_part(""))

    async def _close_message(self, status: str) -> None:
        if self.message is None:
            return
        item, index = self.message, len(self.output)
        text, logprobs = item["text"], item["logprobs"]
        ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
        await self.send("response.output_text.done", **ids, text=text,
                        logprobs=event_logprobs(logprobs))
        await self.send("response.content_part.done", **ids, part=_text_part(text, logprobs))
        done = _message_item(item["id"], text, status, logprobs)
        await self.send("response.output_item.done", output_index=index, item=done)
        self.output.append(done)
        self.message = None


# -- handlers ----------------------------------------------------------------------------


async def create(request: web.Request) -> web.StreamResponse:
    t_start = time.perf_counter()
    gateway = request.app[GATEWAY]
    raw, body = await read_json(request)
    req = await off_loop_if_large(len(raw), parse, body)
    history: list[dict] = []
    history_items: list[dict] = []
    if req.previous_response_id is not None:
        record = await gateway.responses.get(request.get("scope"), req.previous_response_id)
        if record is None or not isinstance(record.get("messages"), list):
            raise not_found(f"Previous response with id '{req.previous_response_id[:100]}' not "
                            "found.", param="previous_response_id",
                            code="previous_response_not_found")
        history = record["messages"]
        if req.store:
            # The items the model saw are the continued response's inputs and outputs.
            # Older outputs' logprobs are dropped: kept, every later record of the chain
            # would copy them all (a 500-token answer's, with 20 alternatives each, is
            # ~0.7 MB); the continued response's own output keeps its logprobs.
            history_items = [_without_logprobs(i) for i in _items_of(record)] + _output_of(record)
    chat = carry_fault(body, chat_body(req, history))
    relay = _ResponsesRelay(request, req, history, history_items)
    return await gateway.route_chat(request, chat, relay, t_start)


def error_fields(err: APIError) -> dict:
    """The fields of an `error` event that ends a stream after its 200."""
    return {"code": err.code or err.type, "message": err.message, "param": err.param}


def _unknown(response_id: str) -> Exception:
    # Unknown, expired, not stored (store: false) or another scope's: all the same here.
    return not_found(f"Response with id '{response_id[:100]}' not found.", param="response_id",
                     code="response_not_found")


async def retrieve(request: web.Request) -> web.Response:
    """GET /v1/responses/{id}: the stored response object, as its create answered it."""
    response_id = request.match_info["response_id"]
    record = await request.app[GATEWAY].responses.get(request.get("scope"), response_id,
                                                      param="response_id")
    if record is None or not isinstance(record.get("response"), dict):
        raise _unknown(response_id)
    return json_response(record["response"], {})


def _items_of(record: dict) -> list[dict]:
    # A record stored before input items were kept lists none.
    items = record.get("items")
    return [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []


def _output_of(record: dict) -> list[dict]:
    response = record.get("response")
    output = response.get("output") if isinstance(response, dict) else None
    return output if isinstance(output, list) else []


MAX_LIST_LIMIT = 100


def _list_params(query: Any) -> tuple[int, str, str | None, list[str]]:
    """(limit, order, after, include) of a list request, as OpenAI's list endpoints
    take them; a 400 naming the parameter otherwise."""
    raw = query.get("limit", "20")
    limit = int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 3 else 0
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise bad_request(f"Invalid 'limit': {raw[:20]!r}; expected an integer from 1 to "
                          f"{MAX_LIST_LIMIT}.", param="limit", code="invalid_value")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f"Invalid 'order': {order[:20]!r}; expected 'asc' or 'desc'.",
                          param="order", code="invalid_value")
    # The SDKs send a list as include[]=a&include[]=b; include=a is read the same.
    include = query.getall("include[]", []) + query.getall("include", [])
    return limit, order, query.get("after"), include


def _without_logprobs(item: dict) -> dict:
    """An output message item whose text parts' logprobs were not asked for: empty, as
    a response created without them has them."""
    if item.get("type") != "message" or not isinstance(item.get("content"), list):
        return item
    return {**item, "content": [{**p, "logprobs": []} if isinstance(p, dict)
                                and p.get("type") == "output_text" else p
                                for p in item["content"]]}


async def input_items(request: web.Request) -> web.Response:
    """GET /v1/responses/{id}/input_items: the items the model was given for a stored
    response (those of the responses it continued, their outputs too, then its own
    input), a page at a time as OpenAI lists them (newest first unless order=asc)."""
    response_id = request.match_info["response_id"]
    limit, order, after, include = _list_params(request.query)
    record = await request.app[GATEWAY].responses.get(request.get("scope"), response_id,
                                                      param="response_id")
    if record is None or not isinstance(record.get("response"), dict):
        raise _unknown(response_id)
    items = _items_of(record)
    if order == "desc":
        items = items[::-1]
    if after is not None:
        at = next((i for i, item in enumerate(items) if item.get("id") == after), None)
        if at is None:
            raise bad_request(f"No input item with id '{after[:100]}' in this response.",
                              param="after", code="invalid_value")
        items = items[at + 1:]
    page = items[:limit]
    if rw.INCLUDE_LOGPROBS not in include:
        page = [_without_logprobs(item) for item in page]
    return json_response({"object": "list", "data": page,
                          "first_id": page[0]["id"] if page else None,
                          "last_id": page[-1]["id"] if page else None,
                          "has_more": len(items) > limit}, {})


async def delete(request: web.Request) -> web.Response:
    """DELETE /v1/responses/{id}: forget a stored response (it can no longer be continued)."""
    response_id = request.match_info["response_id"]
    if not await request.app[GATEWAY].responses.delete(request.get("scope"), response_id):
        raise _unknown(response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True}, {})


def add_routes(app: web.Application) -> None:
    app.router.add_post(PATH, create)
    app.router.add_get(PATH + "/{response_id}", retrieve)
    app.router.add_get(PATH + "/{response_id}/input_items", input_items)
    app.router.add_delete(PATH + "/{response_id}", delete)

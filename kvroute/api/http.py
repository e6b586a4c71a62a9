"""What every handler does with HTTP: read a JSON body (a 413 past the server's limit),
answer JSON, and stream server-sent events."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import orjson
from aiohttp import web

from .errors import APIError, bad_request

# Headers of every SSE answer, the backend's and the proxy's.
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
SSE_DONE = b"data: [DONE]\n\n"  # the last event of a chat or completion stream

# orjson reads JSON nested up to 1024 levels deep but writes at most 254: a body nested
# deeper than it can write would be accepted, then fail (a 500) wherever the server
# writes it again (an agent API's translation, the prefix chain, the forward to the
# backend). Such bodies are refused where they are read, with room to spare: a
# translation puts a client's value a few levels deeper than it was (a Messages tool's
# input_schema becomes a chat tool's function.parameters).
MAX_DEPTH = 200
_WRITE_DEPTH = 254  # orjson's limit (tests/test_messages_edges.py pins it)
_NAMED_STEPS = 5  # how much of a too-deep value's path a refusal names
# Bodies larger than this are parsed, translated and hashed into prefix chains off the
# event loop: a big agent history is megabytes of JSON and thousands of items.
INLINE_BYTES = 256 << 10


def parse_json(raw: bytes) -> dict:
    if not raw:
        raise bad_request("The request body is empty; expected a JSON object.")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}.", code="invalid_json")
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    _check_depth(raw, body)
    return body


def _check_depth(raw: bytes, body: dict) -> None:
    """A 400 for a body nested more than MAX_DEPTH levels deep, naming where."""
    if raw.count(b"{") + raw.count(b"[") <= MAX_DEPTH:  # too few brackets to nest that deep
        return
    # Writing the body below enough extra levels is the test, in C: a walk in Python
    # would cost as much as the parse itself on a large agent history.
    wrapped: Any = body
    for _ in range(_WRITE_DEPTH - MAX_DEPTH):
        wrapped = [wrapped]
    try:
        orjson.dumps(wrapped)
    except orjson.JSONEncodeError:
        param = _too_deep(body)
        raise bad_request(f"Invalid '{param}': nested more than {MAX_DEPTH} levels deep (JSON "
                          "objects and arrays within each other), which this server does not "
                          "accept.", param=param, code="nested_too_deeply") from None


def _too_deep(body: dict) -> str:
    """The path (`tools[0].input_schema.x`, its first steps) to a value nested past
    MAX_DEPTH. Depth first, holding only the path it is on: a body of many shallow
    containers beside one deep branch costs its size in time, not size x depth."""
    path: list = []
    stack: list = [iter(body.items())]  # one iterator per container on the path
    while stack:
        for key, value in stack[-1]:
            if isinstance(value, (dict, list)):
                path.append(key)
                if len(stack) + 1 > MAX_DEPTH:
                    out = ""
                    for step in path[:_NAMED_STEPS]:
                        out += f"[{step}]" if isinstance(step, int) else (f".{step}" if out else step)
                    return out
                stack.append(iter(value.items()) if isinstance(value, dict) else enumerate(value))
                break
        else:
            stack.pop()
            if path:
                path.pop()
    return "body"  # not reached: orjson writes whatever it read, but for its depth


async def read_json(request: web.Request) -> tuple[bytes, dict]:
    """The body as sent, and as the JSON object it must be."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise APIError(413, f"Request body too large: {exc.reason}.", code="request_too_large")
    return raw, await off_loop_if_large(len(raw), parse_json, raw)


async def off_loop_if_large(size: int, fn: Callable, *args) -> Any:
    """`fn(*args)`, in a thread when it works on a body of more than INLINE_BYTES."""
    if size > INLINE_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def json_response(obj: Any, headers: dict | None = None, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, headers=headers,
                        content_type="application/json")


def sse_data(obj: Any) -> bytes:
    """One unnamed SSE event (the chat and completion streams)."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"

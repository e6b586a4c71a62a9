"""What every handler does with HTTP: read a JSON body (a 413 past the server's limit),
answer JSON, and stream server-sent events."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from .errors import APIError, bad_request

# Headers of every SSE answer, the backend's and the proxy's.
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
SSE_DONE = b"data: [DONE]\n\n"  # the last event of a chat or completion stream


def parse_json(raw: bytes) -> dict:
    if not raw:
        raise bad_request("The request body is empty; expected a JSON object.")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}.", code="invalid_json")
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    return body


async def read_json(request: web.Request) -> tuple[bytes, dict]:
    """The body as sent, and as the JSON object it must be."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise APIError(413, f"Request body too large: {exc.reason}.", code="request_too_large")
    return raw, parse_json(raw)


def json_response(obj: Any, headers: dict | None = None, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, headers=headers,
                        content_type="application/json")


def sse_data(obj: Any) -> bytes:
    """One unnamed SSE event (the chat and completion streams)."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"

"""What every handler of both servers does with HTTP: read a JSON body (a 413 past the
server's limit), answer JSON, and stream server-sent events."""

from __future__ import annotations

import orjson

from .errors import bad_request

# Headers of every SSE answer, the backend's and the proxy's.
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


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

"""The OpenAI error envelope, shared by proxy and backend.

Every failure a client can see is `{"error": {"message", "type", "param", "code"}}`
with a matching HTTP status, so OpenAI SDKs raise their usual typed exceptions.
"""

from __future__ import annotations

from dataclasses import dataclass

import logging

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

log = logging.getLogger("kvroute.errors")


@dataclass
class APIError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def not_found(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(404, message, "invalid_request_error", param, code)


def embeddings_not_served() -> APIError:
    """/v1/embeddings, on proxy and backend alike: a 404 that says why, not a bare one."""
    return not_found(
        "Embeddings are not served: kvroute routes chat and completion requests to the MLX "
        "backend holding their prompt's KV cache, and an embedding has no cache to reuse. "
        "Serve embeddings beside it (e.g. mlx-embeddings, Ollama) and point your client's "
        "embeddings calls there.", code="embeddings_not_served")


async def embeddings(request: web.Request) -> web.Response:
    raise embeddings_not_served()


def server_error(message: str, code: str | None = None) -> APIError:
    return APIError(500, message, "server_error", None, code)


def overloaded(message: str, retry_after: float = 1.0) -> APIError:
    err = APIError(429, message, "rate_limit_error", None, "queue_full")
    err.retry_after = retry_after  # type: ignore[attr-defined]
    return err


def error_response(err: APIError) -> web.Response:
    headers = {}
    retry_after = getattr(err, "retry_after", None)
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, round(retry_after)))
    return web.Response(
        body=orjson.dumps(err.body()),
        status=err.status,
        content_type="application/json",
        headers=headers,
    )


# aiohttp raises its own HTTPException subclasses for routing and protocol
# failures (404, 405, 413); they are translated so no plain-text error escapes.
_HTTP_TYPES = {
    401: ("authentication_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
}


def from_http_exception(exc: web.HTTPException) -> APIError:
    etype, code = _HTTP_TYPES.get(exc.status, ("invalid_request_error", None))
    if exc.status >= 500:
        etype = "server_error"
    message = exc.text or exc.reason
    if exc.status == 413:
        message = f"Request body too large: {exc.reason}."
    return APIError(exc.status, message, etype, None, code)


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as err:
        return error_response(err)
    except RequestPayloadError as exc:
        # A body that cannot be decoded (bad gzip or deflate data): the client's fault.
        cause = exc.__cause__
        detail = " ".join(str(getattr(cause, "message", None) or exc).split())
        return error_response(bad_request(f"The request body could not be read: {detail}.",
                                          code="invalid_body"))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = error_response(from_http_exception(exc))
        if "Allow" in exc.headers:  # a 405 names the methods that are allowed (RFC 9110)
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    except Exception:
        # A bug must cost one request, never the process.
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(server_error("Internal server error."))

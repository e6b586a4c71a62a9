"""The backend's chat answer, read back: a whole completion or its SSE chunks, into one
`ChatReply` (text, tool calls, why it ended, usage) that an agent API turns into its own
(whole, or event by event as gateway.py's `Relay.stream` accumulates it)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import aiohttp
import orjson

from kvroute.api.errors import APIError

log = logging.getLogger("kvroute.proxy.agents")


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def upstream_error(status: int, data: bytes) -> APIError:
    """The backend's (or proxy's) OpenAI error envelope as an APIError to re-raise."""
    try:
        err = orjson.loads(data)["error"]
        return APIError(status, str(err.get("message") or "Backend error."),
                        str(err.get("type") or "server_error"), err.get("param"), err.get("code"))
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return APIError(status if status >= 400 else 502, "The backend's answer could not be read.",
                        "server_error", None, "backend_failed")


class UpstreamFailed(Exception):
    """The backend's stream broke after its first byte (`broken`), or carried an error
    event (the backend's own failure, which another backend would likely repeat)."""

    def __init__(self, error: APIError, broken: bool = True):
        super().__init__(error.message)
        self.error, self.broken = error, broken


async def chat_chunks(upstream: Any, bid: str) -> AsyncIterator[dict]:
    """The chunks of the backend's chat SSE stream, until `data: [DONE]`.

    Split by hand rather than with `readline`: one event (a tool call's arguments) can
    exceed aiohttp's line limit. An `error` event or a broken connection raises
    UpstreamFailed; a stream that ends without [DONE] does too."""
    buffer = b""
    chunks = upstream.content.iter_any().__aiter__()
    while True:
        try:
            data = await chunks.__anext__()
        except StopAsyncIteration:
            break
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError,
                asyncio.TimeoutError) as exc:
            log.warning("backend %s failed mid-stream: %s", bid, exc)
            raise UpstreamFailed(APIError(502, f"Backend {bid} failed mid-stream.", "server_error",
                                          None, "backend_failed")) from None
        buffer += data
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    return
                try:
                    chunk = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    raise UpstreamFailed(APIError(502, f"Backend {bid} sent an unreadable event.",
                                                  "server_error", None, "backend_failed")) from None
                if isinstance(chunk, dict) and "error" in chunk:
                    raise UpstreamFailed(upstream_error(500, payload), broken=False)
                if isinstance(chunk, dict):
                    yield chunk
    raise UpstreamFailed(APIError(502, f"Backend {bid} ended its stream early.", "server_error",
                                  None, "backend_failed"))


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    @classmethod
    def from_chat(cls, usage: Any) -> "Usage":
        if not isinstance(usage, dict):
            return cls()
        details = usage.get("prompt_tokens_details") or {}
        return cls(int(usage.get("prompt_tokens") or 0), int(details.get("cached_tokens") or 0),
                   int(usage.get("completion_tokens") or 0))

    @classmethod
    def from_headers(cls, headers: dict) -> "Usage":
        """What the backend knew when it sent its headers (with the first token)."""
        def num(name: str) -> int:
            value = headers.get(name, "")
            return int(value) if value.isdigit() else 0
        return cls(num("x-kvroute-prompt-tokens"), num("x-kvroute-cached-tokens"))


@dataclass
class ChatReply:
    """The assistant turn of a chat answer: text, tool calls, why it ended, usage, and
    (when the backend was asked for them) the logprobs of its text's tokens. Read whole
    (`from_completion`) or accumulated chunk by chunk (`add`)."""

    text: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI format, arguments a JSON string
    finish_reason: str | None = None  # stop, length, tool_calls
    stop: str | None = None  # the stop string that ended it (the backend's stop_reason)
    usage: Usage = field(default_factory=Usage)
    # The chat logprob entries of the tokens that made `text`, in order. The backend
    # sends only those: each with the text that holds it, none of a tool call's tokens
    # or of a stop string's (kvroute/backend/engine.py, `_sendable_logprobs`).
    logprobs: list[dict] = field(default_factory=list)

    @classmethod
    def from_completion(cls, data: bytes) -> "ChatReply":
        try:
            body = orjson.loads(data)
            choice = body["choices"][0]
            message = choice["message"]
            reply = cls(text=message.get("content") or "",
                        tool_calls=message.get("tool_calls") or [],
                        finish_reason=choice.get("finish_reason"), stop=_stop(choice),
                        usage=Usage.from_chat(body.get("usage")))
            reply.logprobs = _logprob_entries(choice)
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError):
            raise APIError(502, "The backend's answer could not be read.", "server_error", None,
                           "backend_failed") from None
        return reply

    def add(self, chunk: dict) -> tuple[str, list[dict]]:
        """Take one chat chunk into the reply; the text and tool calls it brought."""
        if chunk.get("usage"):
            self.usage = Usage.from_chat(chunk["usage"])
        choices = chunk.get("choices") or []
        if not choices or not isinstance(choices[0], dict):
            return "", []
        choice = choices[0]
        delta = choice.get("delta") or {}
        text, calls = delta.get("content") or "", delta.get("tool_calls") or []
        if not isinstance(text, str) or not isinstance(calls, list):
            text, calls = "", []
        self.logprobs += _logprob_entries(choice)
        self.text += text
        self.tool_calls += calls
        if choice.get("finish_reason"):
            self.finish_reason, self.stop = choice["finish_reason"], _stop(choice)
        return text, calls

    def message(self) -> dict:
        """The turn as a chat message, exactly as the backend extends its prefix chain with
        it (content null when empty), so the next turn's chain continues this one's."""
        msg: dict = {"role": "assistant", "content": self.text or None}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


def _logprob_entries(choice: dict) -> list[dict]:
    """The chat logprob entries of a choice or chunk (none when not asked for)."""
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    return [e for e in content if isinstance(e, dict)] if isinstance(content, list) else []


def _stop(choice: dict) -> str | None:
    stop = choice.get("stop_reason")
    return stop if isinstance(stop, str) else None


def tool_call_parts(call: dict) -> tuple[str, str, str]:
    """(id, name, arguments JSON) of an OpenAI tool call."""
    fn = call.get("function") or {}
    args = fn.get("arguments")
    if not isinstance(args, str):
        args = orjson.dumps(args if args is not None else {}).decode()
    return str(call.get("id") or new_id("call_")), str(fn.get("name") or ""), args



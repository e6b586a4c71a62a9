"""The gateway of the agent APIs (Responses, Messages) into the chat path.

Each of those APIs is a translation: its handler turns the client's request into the
canonical chat-completions body, hands it to the proxy's chat routing (`Gateway.
route_chat`: same prefix chain, lookup and forwarding as /v1/chat/completions), and
gives it a `Relay` that turns the backend's chat answer, whole or streamed, back into
its own API. This module holds what both translations share on that way: the gateway
the proxy provides, the client's body read, and the way back: one relay loop that
accumulates the backend's chunks into one reply (reply.py) and has each API write it
as its own events. (What each API accepts is its model in kvroute/api/responses.py
and kvroute/api/messages.py.)

It imports nothing from the proxy's routing: the app builds the `Gateway` and puts it
in the app, so the translations depend on the routing only through that object.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Protocol

import orjson
from aiohttp import web

from kvroute.api.errors import APIError
from kvroute.api.http import SSE_HEADERS, json_response

from .. import loading
from .reply import ChatReply, UpstreamFailed, Usage, chat_chunks, upstream_error

log = logging.getLogger("kvroute.proxy.agents")


@dataclass
class Gateway:
    """What the proxy offers the translating APIs (built by `proxy.app.create_app`)."""

    # (request, canonical chat body, relay, t_start) -> the client's response
    route_chat: Callable[[web.Request, dict, Relay, float], Awaitable[web.StreamResponse]]
    # (request, model, backend path, body) -> (status, body): a question, not a generation
    ask_backend: Callable[[web.Request, str, str, dict], Awaitable[tuple[int, bytes]]]
    responses: Any  # proxy.agents.store.ResponseStore


GATEWAY = web.AppKey("gateway", Gateway)


# -- the way in ------------------------------------------------------------------------


def carry_fault(body: dict, chat: dict) -> dict:
    """The testing-only `kvroute_fault` field travels on, as it does in a chat body the
    proxy passes through: only a backend started with --enable-faults honours it."""
    if isinstance(body.get("kvroute_fault"), str):
        chat["kvroute_fault"] = body["kvroute_fault"]
    return chat


# -- the way back ----------------------------------------------------------------------


class Relay:
    """Turns the backend's chat answer into one API's answer: whole (`answer`, from a
    JSON body; a refusal, any status >= 400, re-raised as `refusal` words it) or
    streamed (`events`, written as the one loop of `stream` reads the chunks).
    `held_error` is the error event that ends a stream started while its model loaded,
    before anything else was sent; `headers` what the API adds to the answer's.
    `completion_tokens` is the reply's generated tokens once it has ended (its team's
    figures count them)."""

    completion_tokens: int = 0

    @property
    def client_stream(self) -> bool | None:
        """Whether the client reads a stream, for an API whose chat body streams either
        way; None: as the chat body says."""
        return None

    def headers(self, headers: dict) -> dict:
        return headers

    def held_error(self, err: APIError) -> bytes:
        raise NotImplementedError

    def refusal(self, err: APIError) -> APIError:
        return err

    async def answer(self, reply: ChatReply) -> dict:
        raise NotImplementedError

    def events(self, sse: SSEWriter, reply: ChatReply) -> ReplyEvents:
        raise NotImplementedError

    async def whole(self, status: int, data: bytes, headers: dict) -> web.StreamResponse:
        if status >= 400:
            raise self.refusal(upstream_error(status, data))
        reply = ChatReply.from_completion(data)
        self.completion_tokens = reply.usage.completion_tokens
        return json_response(await self.answer(reply), self.headers(headers))

    async def stream(self, request: web.Request, upstream: Any, headers: dict,
                     bid: str) -> web.StreamResponse:
        sse = SSEWriter(self.headers(headers))
        if not await sse.start(request):
            return sse.resp
        reply = ChatReply(usage=Usage.from_headers(headers))
        events = self.events(sse, reply)
        await events.begin()
        try:
            async for chunk in chat_chunks(upstream, bid):
                text, calls = reply.add(chunk)
                if text:
                    await events.text(text)
                for call in calls:
                    await events.tool_call(call)
                if not sse.open:
                    # The client left: stop reading, so the proxy's forward closes upstream
                    # and the backend stops decoding (its prompt stays cached).
                    return sse.resp
            await events.end()
        except UpstreamFailed as exc:
            await events.fail(exc.error)
        finally:
            self.completion_tokens = reply.usage.completion_tokens
        return await sse.end()


class ReplyEvents(Protocol):
    """One API's events for a streamed reply, written as `Relay.stream` accumulates it
    (the reply so far is the `ChatReply` the events were made with)."""

    async def begin(self) -> None: ...  # before the first chunk

    async def text(self, text: str) -> None: ...

    async def tool_call(self, call: dict) -> None: ...  # one whole OpenAI tool call

    async def end(self) -> None: ...  # the backend's stream ended well: the reply is whole

    async def fail(self, error: APIError) -> None: ...  # it broke after the first byte


class SSEWriter:
    """One SSE response to the client. `send` returns False once the client is gone."""

    def __init__(self, headers: dict):
        self.resp = web.StreamResponse(status=200, headers={**headers, **SSE_HEADERS})
        self.open = True

    async def start(self, request: web.Request) -> bool:
        # A request that waited for its model to load has its stream started already.
        self.resp = loading.held(request) or self.resp
        try:
            await self.resp.prepare(request)
        except ConnectionError:
            self.open = False
        return self.open

    async def send(self, event: str, data: dict) -> bool:
        if not self.open:
            return False
        try:
            await self.resp.write(sse_event(event, data))
        except ConnectionError:
            # The client went away: not a backend failure. Closing upstream (the
            # proxy's forward does it) stops the backend decoding.
            log.debug("client of a translated stream went away")
            self.open = False
        return self.open

    async def end(self) -> web.StreamResponse:
        if self.open:
            try:
                await self.resp.write_eof()
            except ConnectionError:
                self.open = False
        return self.resp


def sse_event(event: str, data: dict) -> bytes:
    """One named SSE event (the agent APIs' streams)."""
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


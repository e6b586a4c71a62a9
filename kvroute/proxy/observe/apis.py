"""Which client API a request speaks, counted per API for /metrics and /stats.

chat and completions are OpenAI's passed-through endpoints; responses and messages
are translated onto the chat path (proxy/agents/). Counted in the
outermost middleware, so every request is seen with its final status: also those
refused before any routing (400, 401, 413) and those no backend answered.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from kvroute.api.routes import (CHAT_PATH, COMPLETIONS_PATH, MESSAGES_COUNT_PATH, MESSAGES_PATH,
                                RESPONSES_PATH)

from .metrics import ProxyMetrics
from .stats import Stats

APIS = {
    CHAT_PATH: "chat",
    COMPLETIONS_PATH: "completions",
    RESPONSES_PATH: "responses",
    MESSAGES_PATH: "messages",
    MESSAGES_COUNT_PATH: "messages",
}


def api_of(path: str) -> str | None:
    return APIS.get(path)


def count_middleware(metrics: ProxyMetrics, stats: Stats):
    @web.middleware
    async def count(request: web.Request, handler) -> web.StreamResponse:
        api = api_of(request.path)
        if api is None:
            return await handler(request)
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except asyncio.CancelledError:
            status = 499  # the client went away before an answer began
            raise
        finally:
            metrics.child(metrics.api_requests, api, str(status)).inc()
            stats.count_api(api, status)

    return count

"""API keys: who may call /v1/, the cache scope each key's requests share, and who may
read /stats.

/stats lists every tenant's recent routing decisions, so with keys set it needs a key
of the reserved scope `operator` (`--api-key KEY:operator`); /health, /metrics and
/openapi.json stay open (ids, counters and sizes, never a tenant's requests), and so
does the dashboard's page, whose data comes from /stats.
"""

from __future__ import annotations

import hmac

from aiohttp import web

from kvroute.api.errors import APIError

from .state import state_of

OPERATOR_SCOPE = "operator"
OPERATOR_PATHS = frozenset({"/stats"})


def check_api_key(keys: dict[str, str | None], header: str) -> tuple[bool, str | None]:
    """Constant-time: every configured key is compared, whatever matches first."""
    given = header[7:].strip() if header[:7].lower() == "bearer " else ""
    ok, scope = False, None
    for key, key_scope in keys.items():
        if hmac.compare_digest(given.encode(), key.encode()):
            ok, scope = True, key_scope
    return ok, scope


def _authenticate(request: web.Request, keys: dict[str, str | None]) -> str | None:
    """The key's scope (the key itself goes into request["api_key"], for the usage limits
    that name a key); 401 in the error envelope without a valid key."""
    header = request.headers.get("Authorization", "")
    ok, scope = check_api_key(keys, header)
    if not ok and "x-api-key" in request.headers:
        # Anthropic clients send the key this way (Claude Code's ANTHROPIC_API_KEY).
        header = "Bearer " + request.headers["x-api-key"]
        ok, scope = check_api_key(keys, header)
    if not ok:
        raise APIError(401, "Missing or invalid API key (send 'Authorization: Bearer <key>' "
                       "or 'x-api-key: <key>').", "authentication_error", None,
                       "invalid_api_key")
    request["api_key"] = header[7:].strip()
    return scope


@web.middleware
async def auth_middleware(request: web.Request, handler):
    keys = state_of(request).config.api_keys
    scope = None  # set either way: a missing key costs request.get an exception
    if keys and request.path.startswith("/v1/"):
        scope = _authenticate(request, keys)
    elif keys and request.path in OPERATOR_PATHS:
        if _authenticate(request, keys) != OPERATOR_SCOPE:
            raise APIError(403, f"{request.path} needs an operator key (one configured as "
                           f"'--api-key KEY:{OPERATOR_SCOPE}').", "permission_error", None,
                           "operator_key_required")
    request["scope"] = scope
    return await handler(request)

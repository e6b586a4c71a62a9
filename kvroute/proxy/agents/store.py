"""Stored /v1/responses answers: what a later `previous_response_id` continues from,
and what `GET /v1/responses/{id}` shows.

A stored record holds the response object as its create answered it, and the
response's canonical conversation: the chat messages of every input item that led to
it and of its reply, without the request's `instructions` (OpenAI does not carry those
over to a continuation). A continuation then only appends its new
input, and its chat body is the one the same conversation sent in full would make, so
it routes to and hits the same cache. It also holds those input items as the client
sent them (each with an id), for `GET /v1/responses/{id}/input_items`: the chat
messages lose what kind of tool a call was for.

Redis holds it encrypted with AES-256-GCM under a key derived from the deployment
secret and the API key's scope, and the key name carries a keyed hash of the scope:
the registry's promise that Redis never holds prompt text still stands, and one scope
can neither read nor find another scope's responses (an id from another scope is
simply unknown). Without a secret the key derives from an empty one, like the prefix
keys' salt: set `--secret` in a deployment.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os

import orjson
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvroute.api.errors import APIError
from kvroute.core.redis_keys import RESPONSE_ID_RE
from kvroute.core.prefix import scope_bytes
from kvroute.core.registry import Registry, RegistryUnavailable

log = logging.getLogger("kvroute.proxy.responses")

_VERSION = b"kvroute-responses-v1"
_NONCE_BYTES = 12


class ResponseStore:
    def __init__(self, registry: Registry, secret: str, ttl: float):
        self.registry = registry
        self.secret = secret.encode()
        self.ttl = ttl

    def _derive(self, what: bytes, scope: str | None) -> bytes:
        return hmac.new(self.secret, _VERSION + b"/" + what + b"/" + scope_bytes(scope),
                        hashlib.sha256).digest()

    def _tag_and_key(self, scope: str | None) -> tuple[str, AESGCM]:
        return self._derive(b"tag", scope)[:16].hex(), AESGCM(self._derive(b"key", scope))

    async def put(self, scope: str | None, response_id: str, record: dict) -> bool:
        """Keep `record` for the store's TTL. False (logged) when Redis cannot take it:
        the answer itself is still given, only continuing from it will not work."""
        tag, aead = self._tag_and_key(scope)
        nonce = os.urandom(_NONCE_BYTES)
        blob = nonce + aead.encrypt(nonce, orjson.dumps(record), response_id.encode())
        try:
            await self.registry.put_response(tag, response_id, blob, self.ttl)
            return True
        except RegistryUnavailable as exc:
            log.warning("could not store response %s: %s", response_id, exc)
            return False

    async def get(self, scope: str | None, response_id: str,
                  param: str = "previous_response_id") -> dict | None:
        """The record stored under `response_id` for this scope, None when there is none
        (unknown, expired, or stored by another scope). Raises a 503 APIError (naming
        `param`) when Redis cannot answer: the id may well exist."""
        if not RESPONSE_ID_RE.fullmatch(response_id):
            return None
        tag, aead = self._tag_and_key(scope)
        try:
            blob = await self.registry.get_response(tag, response_id)
        except RegistryUnavailable as exc:
            raise _unavailable(exc, param) from None
        if blob is None or len(blob) <= _NONCE_BYTES:
            return None
        try:
            plain = aead.decrypt(blob[:_NONCE_BYTES], blob[_NONCE_BYTES:], response_id.encode())
            record = orjson.loads(plain)
        except (InvalidTag, orjson.JSONDecodeError):
            # Another secret wrote it (a redeploy with a new secret): as good as unknown.
            return None
        return record if isinstance(record, dict) else None

    async def delete(self, scope: str | None, response_id: str) -> bool:
        """Forget the record of `response_id` in this scope; False when there was none
        (another scope's id included: its key is another). Raises a 503 APIError when
        Redis cannot answer."""
        if not RESPONSE_ID_RE.fullmatch(response_id):
            return False
        tag, _ = self._tag_and_key(scope)
        try:
            return await self.registry.delete_response(tag, response_id)
        except RegistryUnavailable as exc:
            raise _unavailable(exc, "response_id") from None


def _unavailable(exc: Exception, param: str) -> APIError:
    return APIError(503, f"Stored responses are unavailable right now ({exc}).", "server_error",
                    param, "store_unavailable")

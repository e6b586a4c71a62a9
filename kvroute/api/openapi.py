"""The OpenAPI 3.1 description of kvroute's HTTP surface, served at /openapi.json.

One description for both processes: the proxy and the backend accept the same chat and
completion bodies (the proxy passes them through unchanged); each serves the operations
it has. Request bodies are not written here: their schemas are generated from the
pydantic models that validate them (kvroute/api/chat.py, responses.py,
messages.py), so the description cannot drift from what the servers enforce (the
few rules a model adds to its schema by hand are checked by tests/test_openapi.py).
Answers (which kvroute writes, not validates) are described here by hand.
"""

from __future__ import annotations

from pydantic.json_schema import models_json_schema

from kvroute import __version__
from .chat import ChatCompletionBody, CompletionBody
from .messages import CountTokensBody, MessagesBody
from .responses import ResponsesBody
from .routes import (CHAT_PATH, COMPLETIONS_PATH, COUNT_TOKENS_PATH, EMBEDDINGS_PATH,
                     HEALTH_PATH, MESSAGES_COUNT_PATH, MESSAGES_PATH, MODELS_PATH,
                     RESPONSES_PATH)
from .validation import Body

_REF = "#/components/schemas/{model}"
_BODIES: dict[str, tuple[type[Body], ...]] = {
    "backend": (ChatCompletionBody, CompletionBody),
    "proxy": (ChatCompletionBody, CompletionBody, ResponsesBody, MessagesBody, CountTokensBody),
}


def request_schemas(role: str) -> tuple[dict[str, dict], dict[str, dict]]:
    """({model name: its request body schema}, every schema they refer to), with
    references into the description's components."""
    refs, defs = models_json_schema([(m, "validation") for m in _BODIES[role]],
                                    ref_template=_REF)
    return {m.__name__: refs[(m, "validation")] for m in _BODIES[role]}, defs["$defs"]

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"],
    "properties": {
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
        "prompt_tokens_details": {"type": "object", "required": ["cached_tokens"],
                                  "properties": {"cached_tokens": {"type": "integer"}}},
    },
}

_COMPLETION_RESPONSE = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices"],
    "properties": {
        "id": {"type": "string"},
        "object": {"enum": ["chat.completion", "text_completion"]},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {"type": "array"},
        "usage": _USAGE,
    },
}


# OpenAPI 3.1 has the schema of text/event-stream describe one event. Its data is a
# chunk as JSON, an error (a failure after the 200) or the final `[DONE]`.
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "event": {"type": "string"},
        "data": {"anyOf": [
            {"const": "[DONE]"},
            {"type": "string", "contentMediaType": "application/json",
             "contentSchema": {"type": "object", "anyOf": [
                 {"required": ["id", "object", "created", "model", "choices"]},
                 {"required": ["error"], "properties": {"error": _ERROR["properties"]["error"]}},
             ]}},
        ]},
    },
}


def _errors(*codes: int) -> dict:
    reasons = {400: "Invalid request", 401: "Missing or wrong key or token", 404: "Unknown model",
               413: "Body too large", 429: "Every queue is full (see Retry-After)",
               500: "Generation failed", 502: "Backend failed", 503: "No backend reachable"}
    return {str(c): {"description": reasons[c], "content": {"application/json": {"schema": _ERROR}}}
            for c in codes}


def _generate(summary: str, schema: dict, proxy: bool) -> dict:
    codes = (400, 401, 404, 413, 429, 500) + ((502, 503) if proxy else ())
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
            "responses": {
                "200": {
                    "description": "A completion, or with stream=true an SSE stream of chunks "
                                   "ending in `data: [DONE]`",
                    "content": {"application/json": {"schema": _COMPLETION_RESPONSE},
                                "text/event-stream": {"schema": _SSE_EVENT}},
                },
                **_errors(*codes),
            },
        }
    }


# -- the agent APIs (proxy only) -------------------------------------------------------

# Anthropic's error envelope, which every error under /v1/messages takes.
ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {"type": "object", "required": ["type", "message"],
                  "properties": {"type": {"type": "string"}, "message": {"type": "string"}}},
    },
}

_RESPONSE_OBJECT = {
    "type": "object",
    "required": ["id", "object", "created_at", "status", "model", "output"],
    "properties": {
        "id": {"type": "string"}, "object": {"const": "response"},
        "created_at": {"type": "integer"},
        "status": {"enum": ["completed", "incomplete", "failed", "in_progress"]},
        "model": {"type": "string"}, "output": {"type": "array"},
        "usage": {"type": "object",
                  "required": ["input_tokens", "input_tokens_details", "output_tokens",
                               "output_tokens_details", "total_tokens"],
                  "properties": {"input_tokens_details": {
                      "type": "object", "required": ["cached_tokens", "cache_write_tokens"]}}},
    },
}

_DELETED_RESPONSE = {
    "type": "object", "required": ["id", "object", "deleted"],
    "properties": {"id": {"type": "string"}, "object": {"const": "response"},
                   "deleted": {"const": True}},
}

_ITEM_LIST = {
    "type": "object", "required": ["object", "data", "first_id", "last_id", "has_more"],
    "properties": {"object": {"const": "list"},
                   "data": {"type": "array", "items": {"type": "object",
                                                       "required": ["id", "type"]}},
                   "first_id": {"type": ["string", "null"]},
                   "last_id": {"type": ["string", "null"]}, "has_more": {"type": "boolean"}},
}

_MODEL_OBJECT = {
    "type": "object", "required": ["id", "object", "created", "owned_by"],
    "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                   "created": {"type": "integer"}, "owned_by": {"type": "string"},
                   "state": {"enum": ["loaded", "loading", "unloaded"]}},
}

_MESSAGE_OBJECT = {
    "type": "object",
    "required": ["id", "type", "role", "model", "content", "stop_reason", "usage"],
    "properties": {
        "id": {"type": "string"}, "type": {"const": "message"}, "role": {"const": "assistant"},
        "model": {"type": "string"}, "content": {"type": "array"},
        "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
        "usage": {"type": "object", "required": ["input_tokens", "output_tokens",
                                                 "cache_read_input_tokens",
                                                 "cache_creation_input_tokens"]},
    },
}

# An event of the agent APIs' streams: a named event whose data is one JSON object.
_NAMED_EVENT = {
    "type": "object",
    "required": ["event", "data"],
    "properties": {
        "event": {"type": "string"},
        "data": {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"type": "object", "required": ["type"]}},
    },
}


def _agent(summary: str, schema: dict, ok: dict, error: dict, stream: bool = True) -> dict:
    content = {"application/json": {"schema": ok}}
    if stream:
        content["text/event-stream"] = {"schema": _NAMED_EVENT}
    errors = _errors(400, 401, 404, 413, 429, 500, 502, 503)
    for answer in errors.values():
        answer["content"]["application/json"]["schema"] = error
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "responses": {"200": {"description": "The answer, or with stream=true its events",
                              "content": content}, **errors},
    }}


def _get(summary: str, ctype: str = "application/json") -> dict:
    return {"get": {"summary": summary,
                    "responses": {"200": {"description": summary, "content": {ctype: {"schema": {}}}}}}}


def _by_id(name: str, about: str, operations: dict[str, tuple[str, dict]]) -> dict:
    """Operations on one object named in the path: {method: (summary, answer schema)};
    an unknown one is a 404 in OpenAI's envelope."""
    parameter = {"name": name, "in": "path", "required": True, "description": about,
                 "schema": {"type": "string"}}
    return {method: {"summary": summary, "parameters": [parameter],
                     "responses": {"200": {"description": summary, "content": {
                         "application/json": {"schema": schema}}}, **_errors(401, 404)}}
            for method, (summary, schema) in operations.items()}


def _input_items() -> dict:
    """GET /v1/responses/{response_id}/input_items, OpenAI's list of a response's input
    items, with its query parameters."""
    def query(name: str, about: str, schema: dict) -> dict:
        return {"name": name, "in": "query", "required": False, "description": about,
                "schema": schema}

    summary = "The input items of a stored response, a page at a time"
    parameters = [
        {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"},
         "description": "A stored response's id (in the API key's scope)"},
        query("limit", "Items per page", {"type": "integer", "minimum": 1, "maximum": 100,
                                          "default": 20}),
        query("order", "asc: oldest first; desc: newest first",
              {"enum": ["asc", "desc"], "default": "desc"}),
        query("after", "The id of the item the page starts after", {"type": "string"}),
        query("include", "message.output_text.logprobs: the logprobs of earlier outputs' text",
              {"type": "array", "items": {"type": "string"}}),
    ]
    return {"get": {"summary": summary, "parameters": parameters, "responses": {
        "200": {"description": summary,
                "content": {"application/json": {"schema": _ITEM_LIST}}},
        **_errors(400, 401, 404)}}}


def spec(role: str) -> dict:
    """role: "proxy" or "backend"."""
    proxy = role == "proxy"
    body, defs = request_schemas(role)
    paths = {
        CHAT_PATH: _generate("Chat completion", body["ChatCompletionBody"], proxy),
        COMPLETIONS_PATH: _generate("Text completion", body["CompletionBody"], proxy),
        MODELS_PATH: _get("Models served"),
        HEALTH_PATH: _get("Liveness and state"),
        "/metrics": _get("Prometheus metrics", "text/plain"),
        "/openapi.json": _get("This description"),
        EMBEDDINGS_PATH: {"post": {
            "summary": "Not served: embeddings have no prompt cache to route by",
            "responses": {"404": {"description": "Always: the error says why and where to go",
                                  "content": {"application/json": {"schema": _ERROR}}}}}},
    }
    if proxy:
        paths[RESPONSES_PATH] = _agent(
            "OpenAI Responses API, routed and cached like chat", body["ResponsesBody"],
            _RESPONSE_OBJECT, _ERROR)
        paths[RESPONSES_PATH + "/{response_id}"] = _by_id(
            "response_id", "A stored response's id (in the API key's scope)", {
                "get": ("A stored response, as its create answered it", _RESPONSE_OBJECT),
                "delete": ("Forget a stored response", _DELETED_RESPONSE)})
        paths[RESPONSES_PATH + "/{response_id}/input_items"] = _input_items()
        paths[MODELS_PATH + "/{model}"] = _by_id("model", "A model id of /v1/models", {
            "get": ("One model of /v1/models", _MODEL_OBJECT)})
        paths[MESSAGES_PATH] = _agent(
            "Anthropic Messages API, routed and cached like chat", body["MessagesBody"],
            _MESSAGE_OBJECT, ANTHROPIC_ERROR)
        paths[MESSAGES_COUNT_PATH] = _agent(
            "Anthropic token count, by a backend's chat template", body["CountTokensBody"],
            {"type": "object", "required": ["input_tokens"],
             "properties": {"input_tokens": {"type": "integer"}}}, ANTHROPIC_ERROR, stream=False)
        paths["/stats"] = _get("Cache and routing figures (the dashboard's data)")
        paths["/dashboard"] = _get("Live dashboard", "text/html")
    else:
        paths["/debug/cache"] = _get("Prompt-cache entries (counts and digests, never text)")
        paths[COUNT_TOKENS_PATH] = {"post": {
            "summary": "Internal: the prompt tokens of a chat body (the proxy's count_tokens)",
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": body["ChatCompletionBody"]}}},
            "responses": {"200": {"description": "The count", "content": {"application/json": {
                "schema": {"type": "object", "required": ["prompt_tokens"],
                           "properties": {"prompt_tokens": {"type": "integer"}}}}}},
                **_errors(400, 401, 404, 413)},
        }}
    return {
        "openapi": "3.1.0",
        "info": {"title": f"kvroute {role}", "version": __version__,
                 "description": "OpenAI-compatible endpoints with KV-cache-aware routing."},
        "paths": paths,
        "components": {
            "schemas": {"Error": _ERROR, **({"AnthropicError": ANTHROPIC_ERROR} if proxy else {}),
                        **defs},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                **({"x-api-key": {"type": "apiKey", "in": "header",
                                                  "name": "x-api-key"}} if proxy else {})},
        },
    }

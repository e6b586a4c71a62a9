"""The OpenAPI 3.1 description of kvroute's HTTP surface, served at /openapi.json.

One description for both processes: the proxy and the backend accept the same
chat and completion bodies (the proxy passes them through unchanged); each serves the
operations it has. Schemas here mirror `kvroute/wire.py`, which is what really
validates: keep the two in step (tests fuzz the servers from this description). The
proxy's agent APIs (/v1/responses, /v1/messages) mirror `proxy/responses_api.py` and
`proxy/messages_api.py` the same way: whatever these schemas call invalid, those
refuse with a 4xx.
"""

from __future__ import annotations

from . import __version__
from .wire import COUNT_TOKENS_PATH, MAX_COMPLETION_LOGPROBS, MAX_STOP, MAX_TOP_LOGPROBS, ROLES

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


def _nullable(properties: dict) -> dict:
    """wire.py reads an optional field sent as null as if it were absent."""
    return {name: {"anyOf": [schema, {"type": "null"}]} for name, schema in properties.items()}


def _requires(name: str, schema: dict, then: dict) -> dict:
    """When `name` is present and matches `schema` (not null), `then` applies."""
    return {"if": {"required": [name], "properties": {name: schema}}, "then": then}


_TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}

_TOOL_CALL = {
    "type": "object",
    "required": ["function"],
    "properties": {
        **_nullable({"id": {"type": "string"}}),
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": {"type": "string", "minLength": 1},
                           "arguments": {"type": ["string", "object"]}},
        },
    },
}

_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"enum": list(ROLES)},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART},
                              {"type": "null"}]},
        **_nullable({"name": {"type": "string"},
                     "tool_calls": {"type": "array", "items": _TOOL_CALL},
                     "tool_call_id": {"type": "string"}}),
    },
    "allOf": [
        {"if": {"properties": {"role": {"const": "assistant"}}},
         "else": {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}},
        {"if": {"properties": {"role": {"const": "tool"}}},
         "then": {"required": ["tool_call_id"],
                  "properties": {"tool_call_id": {"type": "string", "minLength": 1}}}},
    ],
}

_TOOL = {
    "type": "object",
    "required": ["function"],
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "minLength": 1},
                "description": {"type": "string"},
                "parameters": {"type": "object"},
            },
        },
    },
}

_SAMPLING = _nullable({
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "seed": {"type": "integer", "minimum": -(1 << 63), "maximum": (1 << 64) - 1},
    "stop": {"anyOf": [{"type": "string"},
                       {"type": "array", "items": {"type": "string"}, "maxItems": MAX_STOP}]},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "logit_bias": {"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                   "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "n": {"const": 1},
    "user": {"type": "string"},
})

_STREAM_OPTIONS_NEED_STREAM = _requires("stream_options", {"type": "object"},
                                        {"required": ["stream"],
                                         "properties": {"stream": {"const": True}}})

CHAT_REQUEST = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        "model": {"type": "string", "minLength": 1},
        "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
        **_nullable({
            "tools": {"type": "array", "items": _TOOL},
            "tool_choice": {"enum": ["auto", "none"]},
            "max_completion_tokens": {"type": "integer", "minimum": 1},
            "logprobs": {"type": "boolean"},
            "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS},
            "response_format": {"type": "object", "required": ["type"],
                                "properties": {"type": {"const": "text"}}},
        }),
        **_SAMPLING,
    },
    "allOf": [
        _STREAM_OPTIONS_NEED_STREAM,
        _requires("top_logprobs", {"type": "integer"},
                  {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}),
    ],
}

COMPLETION_REQUEST = {
    "type": "object",
    "required": ["model", "prompt"],
    "properties": {
        "model": {"type": "string", "minLength": 1},
        "prompt": {"anyOf": [{"type": "string", "minLength": 1},
                             {"type": "array", "items": {"type": "string", "minLength": 1},
                              "minItems": 1, "maxItems": 1}]},
        **_nullable({"logprobs": {"type": "integer", "minimum": 0,
                                  "maximum": MAX_COMPLETION_LOGPROBS}}),
        **_SAMPLING,
    },
    "allOf": [_STREAM_OPTIONS_NEED_STREAM],
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

_STR1 = {"type": "string", "minLength": 1}

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

_RESPONSE_TEXT = {"anyOf": [
    {"type": "string"},
    {"type": "array", "items": {
        "type": "object", "required": ["type", "text"],
        "properties": {"type": {"enum": ["input_text", "output_text", "text"]},
                       "text": {"type": "string"}}}},
]}

_RESPONSE_ITEM = {"anyOf": [
    {"type": "object", "required": ["role", "content"],
     "properties": {"type": {"enum": ["message", None]},
                    "role": {"enum": ["user", "assistant", "system", "developer"]},
                    "content": _RESPONSE_TEXT}},
    {"type": "object", "required": ["type", "call_id", "name", "arguments"],
     "properties": {"type": {"const": "function_call"}, "call_id": _STR1, "name": _STR1,
                    "arguments": {"type": "string"}}},
    {"type": "object", "required": ["type", "call_id", "output"],
     "properties": {"type": {"const": "function_call_output"}, "call_id": _STR1,
                    "output": _RESPONSE_TEXT}},
    # Accepted and dropped: nothing in it is renderable (proxy/responses_api.py).
    {"type": "object", "required": ["type"], "properties": {"type": {"const": "reasoning"}}},
]}

RESPONSES_REQUEST = {
    "type": "object",
    "required": ["model", "input"],
    "properties": {
        "model": _STR1,
        "input": {"anyOf": [{"type": "string"}, {"type": "array", "items": _RESPONSE_ITEM}]},
        **_nullable({
            "instructions": {"type": "string"},
            "previous_response_id": {"type": "string"},
            "tools": {"type": "array", "items": {
                "type": "object", "required": ["type", "name"],
                "properties": {"type": {"const": "function"}, "name": _STR1,
                               **_nullable({"description": {"type": "string"},
                                            "parameters": {"type": "object"},
                                            "strict": {"type": "boolean"}})}}},
            "tool_choice": {"enum": ["auto", "none"]},
            "parallel_tool_calls": {"type": "boolean"},
            "max_output_tokens": {"type": "integer", "minimum": 1},
            "temperature": {"type": "number", "minimum": 0, "maximum": 2},
            "top_p": {"type": "number", "minimum": 0, "maximum": 1},
            "stop": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"},
                                                     "maxItems": MAX_STOP}]},
            "stream": {"type": "boolean"},
            "store": {"type": "boolean"},
            "metadata": {"type": "object"},
            "user": {"type": "string"},
            "background": {"const": False},
            "text": {"type": "object", "properties": {"format": {"anyOf": [
                {"type": "object", "required": ["type"], "properties": {"type": {"const": "text"}}},
                {"type": "null"}]}}},
            "top_logprobs": {"const": 0},
            "truncation": {"enum": ["auto", "disabled"]},
            "include": {"type": "array", "items": {"type": "string"}},
            "reasoning": {"type": "object"},
            "prompt_cache_key": {"type": "string"},
            "service_tier": {"type": "string"},
        }),
        "conversation": {"type": "null"},
        "prompt": {"type": "null"},
    },
}

_TEXT_BLOCK = {"type": "object", "required": ["type", "text"],
               "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}

_MESSAGE_BLOCK = {"anyOf": [
    _TEXT_BLOCK,
    {"type": "object", "required": ["type", "id", "name", "input"],
     "properties": {"type": {"const": "tool_use"}, "id": _STR1, "name": _STR1,
                    "input": {"type": "object"}}},
    {"type": "object", "required": ["type", "tool_use_id"],
     "properties": {"type": {"const": "tool_result"}, "tool_use_id": _STR1,
                    **_nullable({"content": {"anyOf": [{"type": "string"},
                                                       {"type": "array", "items": _TEXT_BLOCK}]},
                                 "is_error": {"type": "boolean"}})}},
    {"type": "object", "required": ["type"],
     "properties": {"type": {"enum": ["thinking", "redacted_thinking"]}}},
]}

_MESSAGES_COMMON = {
    "model": _STR1,
    "messages": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["role", "content"],
        "properties": {"role": {"enum": ["user", "assistant"]},
                       "content": {"anyOf": [{"type": "string"},
                                             {"type": "array", "items": _MESSAGE_BLOCK}]}}}},
    **_nullable({
        "system": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_BLOCK}]},
        "tools": {"type": "array", "items": {
            "type": "object", "required": ["name", "input_schema"],
            "properties": {"name": _STR1, "input_schema": {"type": "object"},
                           **_nullable({"type": {"const": "custom"},
                                        "description": {"type": "string"}})}}},
        "tool_choice": {"type": "object", "required": ["type"],
                        "properties": {"type": {"enum": ["auto", "none"]},
                                       **_nullable({"disable_parallel_tool_use":
                                                    {"type": "boolean"}})}},
        "thinking": {"type": "object"},
        "metadata": {"type": "object", "properties": _nullable({"user_id": {"type": "string"}})},
    }),
}

MESSAGES_REQUEST = {
    "type": "object",
    "required": ["model", "max_tokens", "messages"],
    "properties": {
        **_MESSAGES_COMMON,
        "max_tokens": {"type": "integer", "minimum": 1},
        **_nullable({
            "stop_sequences": {"type": "array", "items": {"type": "string"}, "maxItems": MAX_STOP},
            "temperature": {"type": "number", "minimum": 0, "maximum": 1},
            "top_p": {"type": "number", "minimum": 0, "maximum": 1},
            "stream": {"type": "boolean"},
        }),
        "top_k": {"type": "null"},
    },
}

COUNT_TOKENS_REQUEST = {"type": "object", "required": ["model", "messages"],
                        "properties": _MESSAGES_COMMON}

_RESPONSE_OBJECT = {
    "type": "object",
    "required": ["id", "object", "created_at", "status", "model", "output"],
    "properties": {
        "id": {"type": "string"}, "object": {"const": "response"},
        "created_at": {"type": "integer"},
        "status": {"enum": ["completed", "incomplete", "failed", "in_progress"]},
        "model": {"type": "string"}, "output": {"type": "array"},
        "usage": {"type": "object", "required": ["input_tokens", "input_tokens_details",
                                                 "output_tokens", "total_tokens"]},
    },
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


def spec(role: str) -> dict:
    """role: "proxy" or "backend"."""
    proxy = role == "proxy"
    paths = {
        "/v1/chat/completions": _generate("Chat completion", CHAT_REQUEST, proxy),
        "/v1/completions": _generate("Text completion", COMPLETION_REQUEST, proxy),
        "/v1/models": _get("Models served"),
        "/health": _get("Liveness and state"),
        "/metrics": _get("Prometheus metrics", "text/plain"),
        "/openapi.json": _get("This description"),
    }
    if proxy:
        paths["/v1/responses"] = _agent(
            "OpenAI Responses API, routed and cached like chat", RESPONSES_REQUEST,
            _RESPONSE_OBJECT, _ERROR)
        paths["/v1/messages"] = _agent(
            "Anthropic Messages API, routed and cached like chat", MESSAGES_REQUEST,
            _MESSAGE_OBJECT, ANTHROPIC_ERROR)
        paths["/v1/messages/count_tokens"] = _agent(
            "Anthropic token count, by a backend's chat template", COUNT_TOKENS_REQUEST,
            {"type": "object", "required": ["input_tokens"],
             "properties": {"input_tokens": {"type": "integer"}}}, ANTHROPIC_ERROR, stream=False)
        paths["/stats"] = _get("Cache and routing figures (the dashboard's data)")
        paths["/dashboard"] = _get("Live dashboard", "text/html")
    else:
        paths["/debug/cache"] = _get("Prompt-cache entries (counts and digests, never text)")
        paths[COUNT_TOKENS_PATH] = {"post": {
            "summary": "Internal: the prompt tokens of a chat body (the proxy's count_tokens)",
            "requestBody": {"required": True,
                            "content": {"application/json": {"schema": CHAT_REQUEST}}},
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
            "schemas": {"Error": _ERROR, "ChatRequest": CHAT_REQUEST,
                        "CompletionRequest": COMPLETION_REQUEST,
                        **({"ResponsesRequest": RESPONSES_REQUEST,
                            "MessagesRequest": MESSAGES_REQUEST,
                            "AnthropicError": ANTHROPIC_ERROR} if proxy else {})},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                **({"x-api-key": {"type": "apiKey", "in": "header",
                                                  "name": "x-api-key"}} if proxy else {})},
        },
    }

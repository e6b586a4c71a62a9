"""/openapi.json against what the servers do: every route is described, and each
request body's described constraints (required fields, enums and constants, ranges,
lengths) are exactly what validation enforces.

The bodies' schemas are generated from the same pydantic models that validate
(kvroute/api/chat.py, responses.py, messages.py), so these tests guard the
seams: constraints a model adds by hand to its schema (cross-field rules, the
logit_bias key pattern), and pydantic's schema matching its own validation in strict
mode. For each constrained field a body is built at each edge of the description
(the bound itself, and one step past it) and judged twice: by JSON Schema
(jsonschema_rs, from the description) and by the server's validation. They must
agree, and a refusal must name the field. Chat and completion edges also go over real
HTTP to the real backend (200 vs 400); the agent APIs' edges go through the proxy's
parsers in-process (their HTTP path is fuzzed in test_agent_fuzz.py).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import jsonschema_rs
import pytest
from tests.harness import post_json

from kvroute import config
from kvroute.api import openapi
from kvroute.api.errors import APIError
from kvroute.api.chat import ChatCompletionBody, CompletionBody
from kvroute.api.messages import CountTokensBody, MessagesBody
from kvroute.api.responses import ResponsesBody
from kvroute.backend.requests import parse_chat, parse_completion
from kvroute.proxy.agents import messages as messages_api, responses as responses_api

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
        "logprobs": True}
COMPLETION = {"model": "demo", "prompt": "1 2 3", "max_tokens": 1}
RESPONSES = {"model": "demo", "input": "Hi", "max_output_tokens": 1}
MESSAGES = {"model": "demo", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
COUNT = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}]}
# A forced tool_choice needs tools (a rule over two fields): its edges are tried with one.
WITH = {("chat", "tool_choice"): {"tools": [{"type": "function", "function": {"name": "f"}}]},
        ("responses", "tool_choice"): {"tools": [{"type": "function", "name": "f"}]}}

# Self-contained schemas (each with its own $defs): a body judged by JSON Schema alone.
BODIES = {  # name: (self-contained schema, base body, validation)
    "chat": (ChatCompletionBody.model_json_schema(), CHAT, parse_chat),
    "completion": (CompletionBody.model_json_schema(), COMPLETION, parse_completion),
    "responses": (ResponsesBody.model_json_schema(), RESPONSES, responses_api.parse),
    "messages": (MessagesBody.model_json_schema(), MESSAGES, messages_api.parse),
    "count_tokens": (CountTokensBody.model_json_schema(), COUNT,
                     lambda body: messages_api.parse(body, count_only=True)),
}


# -- every route is described -------------------------------------------------------------


def _routes(app) -> set[tuple[str, str]]:
    return {(r.method.lower(), r.resource.canonical) for r in app.router.routes()
            if r.method != "HEAD"}  # aiohttp adds HEAD to each GET


def _described(role: str) -> set[tuple[str, str]]:
    return {(method, path) for path, ops in openapi.spec(role)["paths"].items() for method in ops}


def test_every_proxy_route_is_described():
    from kvroute.cli import _fields_of
    from kvroute.proxy.app import create_app
    from kvroute.proxy.state import ProxyConfig

    # The proxy's own settings, as `kvroute proxy` builds them (nothing is started:
    # only the router is read).
    s = config.resolve(config.PROXY, {"redis_url": "redis://127.0.0.1:1/0"}, {})
    app = create_app(ProxyConfig(**_fields_of(ProxyConfig, s), api_keys={},
                                 lookup_timeout=s["lookup_timeout_ms"] / 1000))
    assert _routes(app) == _described("proxy")


def test_every_backend_route_is_described():
    from kvroute.backend.metrics import BackendMetrics
    from kvroute.backend.app import create_app

    # A backend's state holds a loaded model; building the router reads only these
    # three of its fields, so a stand-in carries them (nothing is served).
    state = SimpleNamespace(metrics=BackendMetrics("m", "b"),
                            config=SimpleNamespace(internal_token="", max_body_bytes=1 << 20))
    assert _routes(create_app(state)) == _described("backend")


# -- the described constraints are the enforced ones ------------------------------------------


def _alternatives(schema: dict, defs: dict) -> list[dict]:
    """The non-null schemas a property may take (its anyOf members, references resolved)."""
    if "$ref" in schema:
        return _alternatives(defs[schema["$ref"].rsplit("/", 1)[1]], defs)
    if "anyOf" in schema:
        return [s for member in schema["anyOf"] for s in _alternatives(member, defs)]
    return [] if schema.get("type") == "null" else [schema]


def _edges(schema: dict) -> list[tuple[Any, bool]]:
    """(value, valid per the description) at the edges of one schema's constraints."""
    out: list[tuple[Any, bool]] = []
    kind = schema.get("type")
    step = 1 if kind == "integer" else 0.5
    if "minimum" in schema:
        out += [(schema["minimum"], True), (schema["minimum"] - step, False)]
    if "maximum" in schema:
        out += [(schema["maximum"], True), (schema["maximum"] + step, False)]
    if "const" in schema:
        const = schema["const"]
        wrong = (not const if isinstance(const, bool) else const + 1
                 if isinstance(const, (int, float)) else "not-" + str(const))
        out += [(const, True), (wrong, False)]
    if "enum" in schema:
        out += [(v, True) for v in schema["enum"]] + [("not-a-member", False)]
    if kind == "string" and schema.get("minLength") == 1:
        out += [("x", True), ("", False)]
    if kind == "array" and "maxItems" in schema:
        n = schema["maxItems"]
        item = "x" if schema.get("items", {}).get("type") == "string" else None
        if item is not None:
            out += [([item] * n, True), ([item] * (n + 1), False)]
    if kind == "array" and schema.get("minItems") == 1:
        out.append(([], False))
    return out


def _cases(name: str) -> list[tuple[str, dict, bool]]:
    """(field, body, valid per the description) for every edge of every top-level field,
    and for every required field left out."""
    schema, base, _ = BODIES[name]
    defs = schema.get("$defs", {})
    cases = []
    for field, prop in schema["properties"].items():
        for alternative in _alternatives(prop, defs):
            for value, valid in _edges(alternative):
                cases.append((field, {**copy.deepcopy(base), **WITH.get((name, field), {}),
                                      field: value}, valid))
    for field in schema.get("required", []):
        cases.append((field, {k: v for k, v in base.items() if k != field}, False))
    return cases


def _judge(name: str, body: dict) -> tuple[bool, bool, str | None]:
    """(valid per JSON Schema, accepted by validation, the parameter a refusal names)."""
    schema, _, parse = BODIES[name]
    described = jsonschema_rs.validator_for(schema).is_valid(body)
    try:
        parse(body)
        return described, True, None
    except APIError as err:
        assert err.status == 400, err
        return described, False, err.param


def _ids(cases) -> list[str]:
    return [f"{field}={str(body.get(field, '<absent>'))[:20]}" for field, body, _ in cases]


CASES = {name: _cases(name) for name in BODIES}


@pytest.mark.parametrize("name", list(BODIES))
def test_every_constrained_field_has_edges(name):
    # The walk above found the bounds it was written for (a schema change that hides
    # them from it, e.g. behind a $ref it cannot follow, must not pass unnoticed).
    fields = {field for field, _, _ in CASES[name]}
    expected = {"chat": {"model", "messages", "max_tokens", "temperature", "top_p", "seed",
                         "stop", "top_logprobs", "n", "tool_choice", "max_completion_tokens"},
                "completion": {"model", "prompt", "max_tokens", "logprobs", "best_of", "echo"},
                "responses": {"model", "input", "max_output_tokens", "temperature", "top_p",
                              "tool_choice", "truncation", "background", "top_logprobs"},
                "messages": {"model", "messages", "max_tokens", "temperature", "top_p",
                             "stop_sequences"},
                "count_tokens": {"model", "messages"}}[name]
    assert expected <= fields, expected - fields


@pytest.mark.parametrize("name,field,body,valid",
                         [(n, *c) for n in BODIES for c in CASES[n]],
                         ids=[f"{n}:{i}" for n in BODIES for i in _ids(CASES[n])])
def test_described_edges_are_the_enforced_ones(name, field, body, valid):
    described, accepted, param = _judge(name, body)
    assert described == valid, (field, body.get(field), "the description disagrees with the edge")
    assert accepted == valid, (field, body.get(field), param)
    if not accepted:
        assert param == field or param.startswith((field + ".", field + "[")), param


@pytest.mark.parametrize("name,fields,param", [
    # The rules over several fields, which a model states both as a validator and in
    # its schema (if/then).
    ("chat", {"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
    ("chat", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("completion", {"stream": False, "stream_options": {}}, "stream_options"),
    ("chat", {"logit_bias": {"12": 100}}, None),
    ("chat", {"logit_bias": {"12": 100.5}}, "logit_bias"),
    ("chat", {"logit_bias": {"-12": 1}}, "logit_bias"),
    ("chat", {"logit_bias": {"1" * 19: 1}}, "logit_bias"),
    ("chat", {"messages": [{"role": "assistant"}, {"role": "user", "content": "x"}]}, None),
    ("chat", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("chat", {"messages": [{"role": "tool", "content": "x", "tool_call_id": ""}]},
     "messages[0].tool_call_id"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ("chat", {"tool_choice": "required", "tools": []}, "tool_choice"),
    ("responses", {"input": [{"type": "reasoning"}]}, None),
    ("responses", {"input": [{"type": "function_call", "call_id": "c", "name": "f"}]},
     "input[0].arguments"),
    ("messages", {"messages": [{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t"}]}, {"role": "user", "content": "x"}]},
     "messages[0].content[0].type"),
    # Nested rules below the top-level fields the edges walk: refusal parts (assistant
    # messages only), OpenAI's tool and metadata limits.
    ("chat", {"messages": [{"role": "assistant", "content": [{"type": "refusal", "refusal": "No"}]},
                           {"role": "user", "content": "x"}]}, None),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "No"}]}]},
     "messages[0].content[0].type"),
    ("chat", {"messages": [{"role": "assistant", "tool_calls": [{"function": {
        "name": "f", "arguments": {}}}]}, {"role": "user", "content": "x"}]},
     "messages[0].tool_calls[0].function.arguments"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "a.b"}}]},
     "tools[0].function.name"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f" * 129}}]},
     "tools[0].function.name"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f" * 64, "parameters": {
        "type": "object"}}}]}, None),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "array"}}}]}, "tools[0].function.parameters"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}],
              "tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
    ("chat", {"metadata": {str(i): "v" * 512 for i in range(16)}}, None),
    ("chat", {"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ("chat", {"metadata": {"k" * 65: "v"}}, "metadata"),
    ("chat", {"metadata": {"k": "v" * 513}}, "metadata"),
    ("chat", {"metadata": {"k": 1}}, "metadata"),
])
def test_cross_field_rules_agree(name, fields, param):
    described, accepted, got = _judge(name, {**copy.deepcopy(BODIES[name][1]), **fields})
    assert (described, accepted, got) == (param is None, param is None, param)


# -- and over HTTP, on the real backend -----------------------------------------------------


@pytest.mark.parametrize("path,name", [("/v1/chat/completions", "chat"),
                                       ("/v1/completions", "completion")])
def test_edges_over_http(backend, path, name):
    for field, body, valid in CASES[name]:
        if field == "model":
            continue  # any other name is a model this backend does not serve: a 404
        body = {**body, "model": backend.model_id}
        status, answer = post_json(backend.url + path, body)
        assert status == (200 if valid else 400), (field, body.get(field), answer)
        if not valid:
            got = answer["error"]["param"]
            assert got == field or got.startswith((field + ".", field + "[")), (field, answer)

"""Request bodies as pydantic models: the one definition that both validates a body
and describes it in /openapi.json (kvroute/openapi.py generates the schemas).

Every model is strict (a JSON `true` is not a number, `"1"` not an integer) and reads
an optional field sent as null as if it were absent. A validation failure becomes the
OpenAI error envelope naming the offending parameter the way OpenAI does
(`messages[0].content[0].type`), with a code a client can branch on.

A few rules span fields (`top_logprobs` needs `logprobs`); a model states them twice,
next to each other: as an `after` validator, and as `json_schema_extra` (JSON Schema
if/then) so the description refuses what validation refuses. tests/test_openapi.py
checks the two against each other.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Discriminator, Field, StrictInt,
                      StringConstraints, ValidationError, WithJsonSchema, WrapValidator)
from pydantic_core import PydanticCustomError

from .errors import APIError, bad_request


class Body(BaseModel):
    """Base of every request body and part of one. Unknown fields are ignored, as
    OpenAI's SDKs send fields newer than a server knows."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


M = TypeVar("M", bound=Body)

# Field types the bodies of every API share.
MAX_STOP = 4
NonEmpty = Annotated[str, StringConstraints(min_length=1)]
# A /v1/completions prompt as token ids (ints, not numbers in strings or booleans):
# the backend checks them against its vocabulary.
TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0, lt=1 << 32)]], Field(min_length=1)]
Stop = Union[str, Annotated[list[str], Field(max_length=MAX_STOP)]]
# A tool's name, as Anthropic takes it: OpenAI's characters, up to 128 of them rather
# than OpenAI's 64, since Messages requests (Claude Code's MCP tools, mcp__server__tool)
# and Codex's namespaced tools arrive as chat requests.
TOOL_NAME = r"[a-zA-Z0-9_-]{1,128}"
ToolName = Annotated[str, StringConstraints(pattern=f"^{TOOL_NAME}$")]


def repeated(names: Any) -> tuple[int, int] | None:
    """(index, index of its first use) of the first name given twice, else None."""
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in seen:
            return i, seen[name]
        seen[name] = i
    return None


def invalid(param: str, message: str, code: str = "invalid_value") -> PydanticCustomError:
    """An error of a rule over several fields, raised from a model validator (whose
    own location is the whole body): `param` names the field to blame."""
    return PydanticCustomError(code, "{message}", {"message": message, "param": param})


def only(value: bool | int) -> Any:
    """The type of a field that takes this one value, compared by type too (a Literal
    compares with ==: 0 would pass as false, true as 1), described as `const`."""
    kind = type(value)

    def check(v: Any) -> Any:
        if v != value:
            raise ValueError(f"Input should be {value!r}")
        return v

    json_type = "boolean" if kind is bool else "integer"
    return Annotated[kind, AfterValidator(check),
                     WithJsonSchema({"type": json_type, "const": value})]


def refusing(message: str, code: str = "unsupported_parameter") -> WrapValidator:
    """Any value the annotated type refuses gets `message` and `code` instead of
    pydantic's own (for parameters kvroute knows but does not implement). `{value}`
    in the message is the value sent."""

    def check(value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError(code, "{message}",
                                      {"message": message.format(value=_short(value))}) from None

    return WrapValidator(check)


def tagged_by(field: str, kind: Any, message: str, code: str) -> Discriminator:
    """A union's discriminator: `kind(value)` is the tag; a value of no member's tag
    gets `message` and `code`, blamed on `field`. (Both travel in the error type: a
    discriminator's error context would make the annotation unhashable.)"""
    return Discriminator(kind, custom_error_type=f"{code}:{field}", custom_error_message=message)


def validate(model: type[M], body: dict) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise api_error(exc, body) from None


# -- a ValidationError as the OpenAI envelope --------------------------------------------

_EXPECTED = {
    "string_type": "a string", "int_type": "an integer", "float_type": "a number",
    "bool_type": "a boolean", "list_type": "a list", "dict_type": "an object",
    "model_type": "an object", "model_attributes_type": "an object",
}


def api_error(exc: ValidationError, body: Any) -> APIError:
    errors = exc.errors(include_url=False)
    params = [_param(e, body) for e in errors]
    # One failure can show as several errors (one per member of a union such as
    # "a string or a list of parts"): of those about the first error's parameter, the
    # deepest names the real culprit (`content[0].type` rather than `content`).
    first = params[0]
    # A value error says more than "expected a string" from a member it was not meant for.
    best = max((i for i, p in enumerate(params) if p.startswith(first)),
               key=lambda i: (len(params[i]), errors[i]["type"] not in _EXPECTED))
    # A wrong type for a union says what each member expects ("a string or a list").
    expected = [_EXPECTED[e["type"]] for e, p in zip(errors, params)
                if p == params[best] and e["type"] in _EXPECTED]
    return _as_api_error(errors[best], params[best], " or ".join(dict.fromkeys(expected)))


def _as_api_error(error: dict, param: str, expected: str) -> APIError:
    kind, ctx = error["type"], error.get("ctx") or {}
    value = error.get("input")
    if kind in ("missing", "union_tag_not_found"):  # a field, or a union's tag, left out
        return bad_request(f"'{param}' is required.", param, "missing_required_parameter")
    if kind == "int_type" and _past_64_bits(value):
        return bad_request(f"Invalid '{param}': the integer is out of range (it does not fit "
                           "in 64 bits).", param, "invalid_value")
    if kind in _EXPECTED:
        return bad_request(f"Invalid type for '{param}': expected {expected}, got "
                           f"{type(value).__name__}.", param, "invalid_type")
    if "message" in ctx:  # one of ours: `invalid` or `refusing`
        return bad_request(ctx["message"], param, kind)
    if ":" in kind:  # `tagged_by`
        return bad_request(error["msg"], param, kind.split(":")[0])
    return bad_request(f"Invalid '{param}': {error['msg']}.", param, "invalid_value")


def _past_64_bits(value: Any) -> bool:
    """An integer orjson could not hold: it reads one past 64 bits as a float."""
    return isinstance(value, float) and value.is_integer() and not -(1 << 63) <= value < (1 << 64)


def _param(error: dict, body: Any) -> str:
    """The error's location in the body as OpenAI writes it (`tools[0].function.name`).

    pydantic's `loc` also holds labels that are no place in the body: a union member's
    (`str`, `list[TextPart]`), a tagged union's tag, a validator's
    (`function-wrap[check()]`). Walking the body alongside the location tells them
    apart: a key names a field when the object has it, or when the field is missing
    (the last key of a `missing` error); any other key is a label."""
    ctx = error.get("ctx") or {}
    if "param" in ctx:
        return ctx["param"]
    loc, node, out = error["loc"], body, ""
    if "[key]" in loc:  # a bad key of a mapping: the mapping is the parameter
        loc = loc[:loc.index("[key]") - 1]
    for i, key in enumerate(loc):
        if isinstance(key, int) and isinstance(node, list) and 0 <= key < len(node):
            out += f"[{key}]"
            node = node[key]
        elif isinstance(key, str) and isinstance(node, dict) and (
                key in node or (i == len(loc) - 1 and error["type"] == "missing")):
            out += f".{key}" if out else key
            node = node.get(key)
    # A tagged union's failure is its tag's: the field the tag is read from.
    kind = error["type"]
    tag = kind.split(":")[1] if ":" in kind else str(ctx.get("discriminator", "")).strip("'") \
        if kind in ("union_tag_invalid", "union_tag_not_found") else ""
    if tag:
        out += f".{tag}" if out else tag
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."

"""Prefix keys: the chain of block hashes that names a request's prompt prefix.

The proxy and the backend both compute these keys from the request body alone
(no tokenizer), so they must agree byte for byte. The body becomes a canonical
byte stream made of segments:

    header   salt and model id
    tools    canonical JSON of the tool list (only when tools are given and
             tool_choice is not "none": the template then never sees them)
    message  one segment per message: role, name, text content, tool calls, tool_call_id
    prompt   for /v1/completions: the prompt text (a one-element list counts as its string)

Every field is length-prefixed, so moving bytes from one field or message into the
next one changes the stream. Each segment is cut into blocks of at most
`block_bytes` bytes; a block never straddles a segment boundary, so every message
boundary is a block boundary and a conversation that grows by one message keeps
its old chain as a prefix. Keys chain: key_i = xxh3_64(key_{i-1} || block_i), the
first block chained from a seed derived from the salt. A change anywhere changes
every key from its block on.

Keys are routing hints: the backend matches its cache exactly at token level.
`request_chain` is the one entry point both sides use, so what the proxy predicts
and what the backend advertises come from the same code. `fingerprint` names the
scheme a process uses (version, block size, a tag of the secret): processes whose
fingerprints differ compute unrelated keys.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Any

import orjson
import xxhash

DEFAULT_BLOCK_BYTES = 256

# Bump when the canonical stream changes: old and new keys must never meet.
PREFIX_SCHEME = 2
_VERSION = b"kvroute-prefix-v%d" % PREFIX_SCHEME

_H = xxhash.xxh3_64_intdigest
_U32 = struct.Struct(">I")
_U64 = struct.Struct("<Q")

# Segment tags: the first byte of each segment says what it is.
_TAG_HEADER = b"H"
_TAG_TOOLS = b"T"
_TAG_MESSAGE = b"M"
_TAG_PROMPT = b"P"


def make_salt(secret: str | bytes, scope: str | None = None) -> bytes:
    """Derive the chain salt from the deployment secret and an optional cache scope.

    The scope (e.g. one per API key) isolates tenants: different secrets or scopes
    give unrelated chains. HMAC keeps the secret out of the salt itself, and
    `None` and `""` are different scopes.
    """
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, bytes):
        raise ValueError(f"secret must be str or bytes, not {type(secret).__name__}")
    if scope is None:
        msg = b"\x00"
    elif isinstance(scope, str):
        msg = b"\x01" + scope.encode("utf-8", "surrogatepass")
    else:
        raise ValueError(f"scope must be str or None, not {type(scope).__name__}")
    return hmac.new(secret, _VERSION + b"/salt/" + msg, hashlib.sha256).digest()


# ---------------------------------------------------------------------------
# Canonical encoding


def _field(data: bytes) -> bytes:
    return _U32.pack(len(data)) + data


def _text(value: str) -> bytes:
    # surrogatepass: a lone surrogate from a JSON body must not crash hashing.
    return value.encode("utf-8", "surrogatepass")


def _canonical_json(value: Any, what: str) -> bytes:
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except (TypeError, orjson.JSONEncodeError) as e:
        raise ValueError(f"{what} is not JSON-serialisable: {e}") from None


def _canonical_arguments(args: Any) -> Any:
    """Tool-call arguments may be a JSON string: parse it so key order is irrelevant."""
    if isinstance(args, str):
        try:
            return orjson.loads(args)
        except orjson.JSONDecodeError:
            return args  # not JSON: the string itself is the argument
    return args


def _canonical_tool_calls(calls: Any, where: str) -> bytes:
    if calls is None:
        return b""
    if not isinstance(calls, list):
        raise ValueError(f"{where}.tool_calls must be a list, not {type(calls).__name__}")
    out = []
    for j, call in enumerate(calls):
        if not isinstance(call, dict):
            raise ValueError(f"{where}.tool_calls[{j}] must be an object")
        fn = call.get("function")
        if isinstance(fn, dict) and "arguments" in fn:
            call = {**call, "function": {**fn, "arguments": _canonical_arguments(fn["arguments"])}}
        out.append(call)
    return _canonical_json(out, f"{where}.tool_calls") if out else b""


def _content_text(content: Any, where: str) -> bytes:
    """A string, or the text parts of a list concatenated (as chat templates render them)."""
    if content is None:
        return b""
    if isinstance(content, str):
        return _text(content)
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string or a list, not {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict):
            text = part.get("text")
            if part.get("type", "text") == "text":
                if not isinstance(text, str):
                    raise ValueError(f"{where}.content[{j}].text must be a string")
                texts.append(text)
            # Non-text parts (images, audio) are not part of the text prefix.
        else:
            raise ValueError(f"{where}.content[{j}] must be an object or a string")
    return _text("".join(texts))


def _optional_str(msg: dict, name: str, where: str) -> bytes:
    value = msg.get(name)
    if value is None:
        return b""
    if not isinstance(value, str):
        raise ValueError(f"{where}.{name} must be a string, not {type(value).__name__}")
    return _text(value)


def _header_segment(model: str, salt: bytes) -> bytes:
    if not isinstance(model, str) or not model:
        raise ValueError("model must be a non-empty string")
    if not isinstance(salt, bytes):
        raise ValueError(f"salt must be bytes, not {type(salt).__name__}")
    return _TAG_HEADER + _field(_VERSION) + _field(salt) + _field(_text(model))


def _message_segment(msg: Any, i: int) -> bytes:
    where = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise ValueError(f"{where} must be an object, not {type(msg).__name__}")
    role = msg.get("role")
    if not isinstance(role, str) or not role:
        raise ValueError(f"{where}.role must be a non-empty string")
    return (
        _TAG_MESSAGE
        + _field(_text(role))
        + _field(_optional_str(msg, "name", where))
        + _field(_content_text(msg.get("content"), where))
        + _field(_canonical_tool_calls(msg.get("tool_calls"), where))
        + _field(_optional_str(msg, "tool_call_id", where))
    )


def chat_segments(body: Any, *, model: str, salt: bytes) -> list[bytes]:
    """The canonical segments of a chat completion request body."""
    if not isinstance(body, dict):
        raise ValueError(f"request body must be a JSON object, not {type(body).__name__}")
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise ValueError("'messages' must be a list")
    segments = [_header_segment(model, salt)]
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"'tools' must be a list, not {type(tools).__name__}")
    # tool_choice "none" renders the prompt without tools (kvroute/wire.py): hash what
    # the template sees, or the backend's cache never matches the prediction.
    if tools and body.get("tool_choice") != "none":
        segments.append(_TAG_TOOLS + _field(_canonical_json(tools, "tools")))
    segments.extend(_message_segment(m, i) for i, m in enumerate(messages))
    return segments


def completion_segments(prompt: Any, *, model: str, salt: bytes) -> list[bytes]:
    """The canonical segments of a /v1/completions prompt (a string, or a list of one)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # the backend accepts it as that string (kvroute/wire.py)
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a string, not {type(prompt).__name__}")
    return [_header_segment(model, salt), _TAG_PROMPT + _field(_text(prompt))]


# ---------------------------------------------------------------------------
# Chaining


def _seed(salt: bytes) -> int:
    return _H(_VERSION + b"/seed/" + salt)


def chain_segments(
    segments: list[bytes], *, salt: bytes, block_bytes: int = DEFAULT_BLOCK_BYTES
) -> list[tuple[int, int]]:
    """(key, end offset in the canonical stream) for each block of the segments."""
    if not isinstance(block_bytes, int) or block_bytes <= 0:
        raise ValueError("block_bytes must be a positive integer")
    pack = _U64.pack
    out: list[tuple[int, int]] = []
    key = _seed(salt)
    offset = 0
    for seg in segments:
        n = len(seg)
        for start in range(0, n, block_bytes):
            block = seg[start : start + block_bytes]
            key = _H(pack(key) + block)
            out.append((key, offset + start + len(block)))
        offset += n
    return out


def _keys(pairs: list[tuple[int, int]]) -> list[int]:
    return [k for k, _ in pairs]


def chat_chain_with_ends(
    body: dict, *, model: str, salt: bytes, block_bytes: int = DEFAULT_BLOCK_BYTES
) -> list[tuple[int, int]]:
    """Like chat_chain, with each key paired with the byte offset where its block ends.

    Offsets count bytes of the canonical stream (header and framing included), a
    rough stand-in for "matched bytes" when estimating matched tokens.
    """
    return chain_segments(chat_segments(body, model=model, salt=salt), salt=salt, block_bytes=block_bytes)


def chat_chain(
    body: dict, *, model: str, salt: bytes, block_bytes: int = DEFAULT_BLOCK_BYTES
) -> list[int]:
    """Prefix keys of a chat completion request body (unsigned 64-bit ints)."""
    return _keys(chat_chain_with_ends(body, model=model, salt=salt, block_bytes=block_bytes))


def completion_chain_with_ends(
    prompt: str, *, model: str, salt: bytes, block_bytes: int = DEFAULT_BLOCK_BYTES
) -> list[tuple[int, int]]:
    return chain_segments(
        completion_segments(prompt, model=model, salt=salt), salt=salt, block_bytes=block_bytes
    )


def completion_chain(
    prompt: str, *, model: str, salt: bytes, block_bytes: int = DEFAULT_BLOCK_BYTES
) -> list[int]:
    """Prefix keys of a /v1/completions prompt."""
    return _keys(completion_chain_with_ends(prompt, model=model, salt=salt, block_bytes=block_bytes))


def request_chain(
    kind: str, body: Any, *, model: str, salt: bytes, block_bytes: int = DEFAULT_BLOCK_BYTES
) -> list[tuple[int, int]]:
    """(key, end offset) for each block of a request body; `kind` is "chat" (a
    /v1/chat/completions body) or "completion" (a /v1/completions body).

    The one chain function of the project: the proxy predicts with it, the backend
    advertises with it. Raises ValueError for a body the scheme cannot hash.
    """
    if not isinstance(body, dict):
        raise ValueError(f"request body must be a JSON object, not {type(body).__name__}")
    if kind == "chat":
        segments = chat_segments(body, model=model, salt=salt)
    elif kind == "completion":
        segments = completion_segments(body.get("prompt"), model=model, salt=salt)
    else:
        raise ValueError(f"unknown request kind {kind!r}")
    return chain_segments(segments, salt=salt, block_bytes=block_bytes)


def request_kind(path: str) -> str:
    """"chat" or "completion" for a request path."""
    return "chat" if path.endswith("/chat/completions") else "completion"


def secret_tag(secret: str | bytes) -> str:
    """A short public tag of the deployment secret: equal secrets give equal tags,
    and the tag reveals nothing usable about the secret (HMAC, truncated)."""
    if isinstance(secret, str):
        secret = secret.encode()
    return hmac.new(secret, _VERSION + b"/fingerprint", hashlib.sha256).hexdigest()[:16]


def fingerprint(secret: str | bytes, block_bytes: int) -> dict[str, Any]:
    """What two processes must share for their chains to meet."""
    return {"prefix_scheme": PREFIX_SCHEME, "block_bytes": int(block_bytes),
            "secret_tag": secret_tag(secret)}


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading keys two chains share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n

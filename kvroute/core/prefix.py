"""Prefix keys: the chain of block hashes that names a request's prompt prefix.

The proxy and the backend both compute these keys from the request body alone
(no tokenizer), so they must agree byte for byte. The body becomes a canonical
byte stream made of segments:

    header   salt and model id
    tools    canonical JSON of the tool list (only when tools are given and
             tool_choice is not "none": the template then never sees them)
    mark     one byte saying tools are given, for templates that then change what
             they write before the tools (Llama 3.1)
    message  one segment per message: role, name, content (text, and each image as a
             marker and the SHA-256 of its decoded bytes, where it stands), tool calls,
             tool_call_id
    prompt   for /v1/completions: the prompt text, or its token ids as given (a
             one-element list counts as its string or its ids)

The segments come in the order the model's chat template renders them (a `Layout`,
found by `detect_layout` when a backend loads, published in its record): Qwen-style
templates write the system prompt first and the tools after it, so hashing the tools
first would make conversations that share only a tool list look like a shared prefix.

Every field is length-prefixed, so moving bytes from one field or message into the
next one changes the stream. Each segment is cut into blocks of at most
`block_bytes` bytes; a block never straddles a segment boundary, so every message
boundary is a block boundary and a conversation that grows by one message keeps
its old chain as a prefix, wherever the template keeps its old text (Mistral moves
the tools and the system prompt to the last user turn: there neither does). Keys chain: key_i = xxh3_64(key_{i-1} || block_i), the
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
from dataclasses import dataclass
from typing import Any, Callable

import orjson
import xxhash

from .images import ImageError, decode_data_url, image_url_of

DEFAULT_BLOCK_BYTES = 256

# Bump when the canonical stream changes: old and new keys must never meet.
# 3: segments follow the chat template's layout (tools, system prompt, tools mark).
# 4: images in message content hash as a marker and the SHA-256 of their bytes.
PREFIX_SCHEME = 4
_VERSION = b"kvroute-prefix-v%d" % PREFIX_SCHEME

_H = xxhash.xxh3_64_intdigest
_U32 = struct.Struct(">I")
_U64 = struct.Struct("<Q")

# An image in a message's content: never a byte of UTF-8 text (0xFF is not one), so
# no text can spell it; followed by the 32-byte SHA-256 of the image's bytes.
_IMAGE_MARK = b"\xffimg"

# Segment tags: the first byte of each segment says what it is.
_TAG_HEADER = b"H"
_TAG_TOOLS = b"T"
_TAG_MESSAGE = b"M"
_TAG_PROMPT = b"P"
_TAG_TOKEN_IDS = b"I"  # a completions prompt given as token ids
_TAG_TOOLS_MARK = b"t"


# ---------------------------------------------------------------------------
# Layout: where a chat template renders the tools and the system prompt

# Where the tool list goes among the messages.
TOOLS_AT = (
    "start",  # before every message
    "after_system",  # after a leading system message (Qwen2.5/3, Llama 3.1, the demo model)
    "before_last_user",  # just before the last user message (Mistral v3 [AVAILABLE_TOOLS])
    "end",  # after every message
    "none",  # nowhere: the template ignores tools (Gemma 3)
)
# Where a leading system message goes.
SYSTEM_AT = (
    "first",  # where it is sent
    # Into the last message when that is a user message, else nowhere (Mistral v3's
    # "[INST] system\n\nuser[/INST]"): it moves with every new turn.
    "last_user",
)
SYSTEM_ROLES = ("system", "developer")
TOOLS = "tools"  # the tool list's item in `arrange`
MARK = "mark"  # the "tools given" mark's item in `arrange`


@dataclass(frozen=True)
class Layout:
    """Where a model's chat template renders what the canonical stream hashes.

    `tools_mark`: the template changes what it writes before the tools' place when
    tools are given (Llama 3.1 writes "Environment: ipython" ahead of the system
    prompt), so a one-byte mark right after the header says tools are given.
    """

    tools_at: str = "start"
    system_at: str = "first"
    tools_mark: bool = False

    def __post_init__(self) -> None:
        if self.tools_at not in TOOLS_AT:
            raise ValueError(f"tools_at must be one of {TOOLS_AT}, not {self.tools_at!r}")
        if self.system_at not in SYSTEM_AT:
            raise ValueError(f"system_at must be one of {SYSTEM_AT}, not {self.system_at!r}")
        if not isinstance(self.tools_mark, bool):
            raise ValueError("tools_mark must be a boolean")

    def __str__(self) -> str:
        extra = ([f"system {self.system_at}"] if self.system_at != "first" else []) + (
            ["tools mark"] if self.tools_mark else [])
        return f"tools {self.tools_at}" + "".join(f", {e}" for e in extra)


DEFAULT_LAYOUT = Layout()


def _last_user(roles: list[str], order: list) -> int | None:
    """Index in `order` of the last user message, None without one."""
    for j in range(len(order) - 1, -1, -1):
        if isinstance(order[j], int) and roles[order[j]] == "user":
            return j
    return None


def arrange(roles: list[str], tools: bool, layout: Layout = DEFAULT_LAYOUT) -> list[int | str]:
    """The order of a chat request's segments after the header: message indices,
    TOOLS for the tool list (when `tools`), MARK for the tools mark.

    Tools are placed among the messages as sent, then a system prompt the template
    moves is moved: Mistral v3 writes [AVAILABLE_TOOLS] before the last user turn
    and the system prompt inside that turn, after the tools.
    """
    order: list[int | str] = list(range(len(roles)))
    if tools and layout.tools_at != "none":
        at = layout.tools_at
        if at == "start":
            order.insert(0, TOOLS)
        elif at == "after_system":
            order.insert(1 if roles and roles[0] in SYSTEM_ROLES else 0, TOOLS)
        elif at == "end":
            order.append(TOOLS)
        else:  # before_last_user; without a user message the template renders no tools
            j = _last_user(roles, order)
            if j is not None:
                order.insert(j, TOOLS)
        if layout.tools_mark and TOOLS in order:
            order.insert(0, MARK)
    if layout.system_at == "last_user" and roles and roles[0] in SYSTEM_ROLES:
        order.remove(0)
        if roles[-1] == "user" and len(roles) > 1:
            order.insert(order.index(len(roles) - 1), 0)
    return order


# ---------------------------------------------------------------------------
# Finding a template's layout: render probe conversations, find their markers

Render = Callable[[list[dict], list[dict] | None], str]

_PROBE = "kvroute-probe-"
_PROBE_TOOL = {"type": "function", "function": {
    "name": "kvroute_probe_tool", "description": _PROBE + "tool-",
    "parameters": {"type": "object", "properties": {}}}}
# Roles of the probe conversations: with and without a leading system message,
# ending in a user turn (the system prompt may move into it) and in an assistant turn.
_PROBES = (("system", "user", "assistant", "user"), ("user", "assistant", "user"),
           ("system", "user", "assistant"), ("system", "user"))


def _probe_messages(roles: tuple[str, ...]) -> list[dict]:
    return [{"role": r, "content": f"{_PROBE}{i}-"} for i, r in enumerate(roles)]


def _rendered_order(text: str, n: int) -> list[int | str]:
    """The probe items in the order `text` renders them (those it renders at all)."""
    found = {i: text.find(f"{_PROBE}{i}-") for i in range(n)}
    tool = [p for p in (text.find(_PROBE_TOOL["function"]["name"]), text.find(_PROBE + "tool-"))
            if p >= 0]
    if tool:
        found[TOOLS] = min(tool)
    return sorted((k for k, p in found.items() if p >= 0), key=found.__getitem__)


def _marked(text: str, plain: str, order: list[int | str]) -> bool:
    """Whether rendering the tools changed the text before their place: then the
    stream needs the tools mark, or tools and no tools would share that prefix."""
    j = order.index(TOOLS) if TOOLS in order else 0
    if j == 0:
        return False
    marker = f"{_PROBE}{order[j - 1]}-"
    end = text.find(marker) + len(marker)
    return text[:end] != plain[:end]


_CANDIDATES = tuple(Layout(t, s) for t in TOOLS_AT for s in SYSTEM_AT)


def detect_layout(render: Render) -> tuple[Layout, str]:
    """The layout of the chat template behind `render(messages, tools) -> text`, and
    "" or why it fell back to the default (the caller logs it).

    Each probe conversation is rendered with a probe tool and without; the layout is
    the one whose `arrange` predicts the order in which the markers of every probe's
    messages and tool appear. Probes the template refuses are skipped.
    """
    seen: list[tuple[tuple[str, ...], list, list, str, str]] = []
    for roles in _PROBES:
        messages = _probe_messages(roles)
        try:
            text, plain = render(messages, [_PROBE_TOOL]), render(messages, None)
        except Exception:
            continue  # e.g. a template that refuses system messages
        seen.append((roles, _rendered_order(text, len(roles)),
                     _rendered_order(plain, len(roles)), text, plain))
    if not seen:
        return DEFAULT_LAYOUT, "the template rendered none of the probe conversations"
    for layout in _CANDIDATES:
        if all(arrange(list(r), True, layout) == tools and arrange(list(r), False, layout) == plain
               for r, tools, plain, _, _ in seen):
            mark = any(_marked(text, plain, tools) for _, tools, _, text, plain in seen)
            return Layout(layout.tools_at, layout.system_at, mark), ""
    shown = "; ".join(f"{'/'.join(r)}: {tools}" for r, tools, _, _, _ in seen)
    return DEFAULT_LAYOUT, f"no known layout renders the probes in their order ({shown})"


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
    if scope is not None and not isinstance(scope, str):
        raise ValueError(f"scope must be str or None, not {type(scope).__name__}")
    return hmac.new(secret, _VERSION + b"/salt/" + scope_bytes(scope), hashlib.sha256).digest()


def scope_bytes(scope: str | None) -> bytes:
    """A cache scope as bytes to derive from: None (no key, or a key without a scope)
    and "" are different scopes."""
    return b"\x00" if scope is None else b"\x01" + scope.encode("utf-8", "surrogatepass")


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
    """A string, or the parts of a list concatenated as chat templates render them: the
    text of text parts, and for each image a marker and its content hash where it
    stands (the same conversation with the same images keeps its keys; another image
    changes them; Redis never sees an image's bytes, only keys derived from the hash)."""
    if content is None:
        return b""
    if isinstance(content, str):
        return _text(content)
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string or a list, not {type(content).__name__}")
    out = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            out.append(_text(part))
        elif isinstance(part, dict):
            kind = part.get("type", "text")
            if kind in ("text", "refusal"):  # a refusal renders as its text (backend/requests.py)
                text = part.get(kind)
                if not isinstance(text, str):
                    raise ValueError(f"{where}.content[{j}].{kind} must be a string")
                out.append(_text(text))
            elif kind == "image_url":
                try:
                    image = decode_data_url(image_url_of(part))
                except ImageError as exc:
                    raise ImageError(f"{where}.content[{j}]: {exc}") from None
                out.append(_IMAGE_MARK + image.sha256)
            # Other non-text parts (audio) are not part of the prefix.
        else:
            raise ValueError(f"{where}.content[{j}] must be an object or a string")
    return b"".join(out)


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


def chat_segments(body: Any, *, model: str, salt: bytes,
                  layout: Layout = DEFAULT_LAYOUT) -> list[bytes]:
    """The canonical segments of a chat completion request body, in the order the
    chat template of `layout` renders them."""
    if not isinstance(body, dict):
        raise ValueError(f"request body must be a JSON object, not {type(body).__name__}")
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise ValueError("'messages' must be a list")
    header = _header_segment(model, salt)
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"'tools' must be a list, not {type(tools).__name__}")
    # tool_choice "none" renders the prompt without tools (kvroute/backend/requests.py):
    # hash what the template sees, or the backend's cache never matches the prediction.
    hashed = bool(tools) and body.get("tool_choice") != "none"
    tools_segment = _TAG_TOOLS + _field(_canonical_json(tools, "tools")) if hashed else b""
    segments = [_message_segment(m, i) for i, m in enumerate(messages)]
    if layout == DEFAULT_LAYOUT:  # the common case, without a walk over the roles
        return [header, tools_segment, *segments] if hashed else [header, *segments]
    roles = [m["role"] for m in messages]  # validated by _message_segment
    extra = {TOOLS: tools_segment, MARK: _TAG_TOOLS_MARK}
    return [header] + [segments[i] if isinstance(i, int) else extra[i]
                       for i in arrange(roles, hashed, layout)]


def completion_segments(prompt: Any, *, model: str, salt: bytes) -> list[bytes]:
    """The canonical segments of a /v1/completions prompt: a string, or token ids (a
    list of one of either counts as it, as the backend takes it: requests.py)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return [_header_segment(model, salt), _TAG_PROMPT + _field(_text(prompt))]
    if isinstance(prompt, list) and prompt and all(_is_token_id(t) for t in prompt):
        ids = struct.pack(f"<{len(prompt)}I", *prompt)
        return [_header_segment(model, salt), _TAG_TOKEN_IDS + _field(ids)]
    raise ValueError(f"prompt must be a string or token ids, not {type(prompt).__name__}")


def _is_token_id(value: Any) -> bool:
    return type(value) is int and 0 <= value < 1 << 32


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


def request_chain(
    kind: str, body: Any, *, model: str, salt: bytes, block_bytes: int = DEFAULT_BLOCK_BYTES,
    layout: Layout = DEFAULT_LAYOUT,
) -> list[tuple[int, int]]:
    """(key, end offset) for each block of a request body; `kind` is "chat" (a
    /v1/chat/completions body) or "completion" (a /v1/completions body); `layout`
    is the model's chat template layout (chat only; backends publish theirs).
    Offsets count bytes of the canonical stream (header and framing included), a
    rough stand-in for "matched bytes" when estimating matched tokens.

    The one chain function of the project: the proxy predicts with it, the backend
    advertises with it. Raises ValueError for a body the scheme cannot hash.
    """
    if not isinstance(body, dict):
        raise ValueError(f"request body must be a JSON object, not {type(body).__name__}")
    if kind == "chat":
        segments = chat_segments(body, model=model, salt=salt, layout=layout)
    elif kind == "completion":
        segments = completion_segments(body.get("prompt"), model=model, salt=salt)
    else:
        raise ValueError(f"unknown request kind {kind!r}")
    return chain_segments(segments, salt=salt, block_bytes=block_bytes)


def chat_chain(
    body: dict, *, model: str, salt: bytes, block_bytes: int = DEFAULT_BLOCK_BYTES,
    layout: Layout = DEFAULT_LAYOUT,
) -> list[int]:
    """The keys alone of request_chain("chat", ...) (tests and benchmarks look them up)."""
    return _keys(request_chain("chat", body, model=model, salt=salt, block_bytes=block_bytes,
                               layout=layout))


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

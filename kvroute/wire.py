"""OpenAI request types: parsing and validation of chat and completion bodies.

Everything a client sends is checked here, once, into dataclasses; a bad field
becomes an `APIError` naming the parameter. Parameters kvroute does not
implement are refused with a 400 rather than silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from .errors import APIError, bad_request

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 4
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
# The backend's internal token count of a chat body (under /v1, so it takes the internal
# token like the rest): the proxy's Anthropic count_tokens asks it, having no tokenizer.
COUNT_TOKENS_PATH = "/v1/kvroute/count_tokens"


@dataclass
class SamplingParams:
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    stop: list[str] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)


@dataclass
class ChatRequest:
    model: str
    messages: list[dict]  # normalised for the chat template
    tools: list[dict] | None
    stream: bool
    include_usage: bool
    params: SamplingParams
    fault: str | None = None


@dataclass
class CompletionRequest:
    model: str
    prompt: str
    stream: bool
    include_usage: bool
    params: SamplingParams
    fault: str | None = None


def parse_json(raw: bytes) -> dict:
    if not raw:
        raise bad_request("The request body is empty; expected a JSON object.")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}.", code="invalid_json")
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    return body


def _type_error(param: str, expected: str, value: Any) -> APIError:
    return bad_request(
        f"Invalid type for '{param}': expected {expected}, got {type(value).__name__}.",
        param=param,
        code="invalid_type",
    )


def _get(body: dict, name: str, kinds: tuple, expected: str, default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    # bool is an int subclass: True must not pass as a number.
    if isinstance(value, bool) and bool not in kinds:
        raise _type_error(name, expected, value)
    if not isinstance(value, kinds):
        raise _type_error(name, expected, value)
    return value


def _in_range(name: str, value: float, lo: float, hi: float) -> float:
    if not lo <= value <= hi:
        raise bad_request(
            f"'{name}' must be between {lo} and {hi}, got {value}.", param=name,
            code="invalid_value",
        )
    return value


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    return _in_range(name, float(_get(body, name, (int, float), "a number", default)), lo, hi)


def _model(body: dict) -> str:
    model = _get(body, "model", (str,), "a string")
    if not model:
        raise bad_request("'model' is required.", param="model", code="missing_required_parameter")
    return model


def _refuse_unsupported(body: dict) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise bad_request("Only n=1 is supported.", param="n", code="unsupported_parameter")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise bad_request("Only best_of=1 is supported.", param="best_of", code="unsupported_parameter")
    if body.get("echo"):
        raise bad_request("'echo' is not supported.", param="echo", code="unsupported_parameter")
    _get(body, "user", (str,), "a string")  # accepted and unused, but typed as in OpenAI's API
    if body.get("suffix"):
        raise bad_request("'suffix' is not supported.", param="suffix", code="unsupported_parameter")
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "text":
            raise bad_request(
                "Only response_format {'type': 'text'} is supported.",
                param="response_format",
                code="unsupported_parameter",
            )


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _type_error("stop", "a string or a list of strings", stop)
    if len(stop) > MAX_STOP:
        raise bad_request(
            f"'stop' accepts at most {MAX_STOP} sequences, got {len(stop)}.",
            param="stop",
            code="invalid_value",
        )
    return [s for s in stop if s]


def _logit_bias(body: dict) -> dict[int, float]:
    bias = _get(body, "logit_bias", (dict,), "an object mapping token ids to numbers", {})
    out = {}
    for key, value in bias.items():
        # Decimal token ids only (int() would also take "+5", " 5", "1_0", other scripts' digits).
        token = int(key) if key.isascii() and key.isdigit() and len(key) <= 18 else -1
        if token < 0:
            # Token ids index the logits: the backend also bounds them by its vocabulary.
            raise bad_request(f"logit_bias key {key[:40]!r} is not a token id.", param="logit_bias",
                              code="invalid_value")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad_request("logit_bias values must be numbers in [-100, 100].", param="logit_bias")
        out[token] = float(value)
    return out


def _seed(body: dict) -> int | None:
    seed = _get(body, "seed", (int,), "an integer")
    if seed is None:
        return None
    # OpenAI's seeds are signed 64-bit; the sampler's PRNG key takes an unsigned one.
    if not -(1 << 63) <= seed < (1 << 64):
        raise bad_request("'seed' must be a 64-bit integer.", param="seed", code="invalid_value")
    return seed % (1 << 64)


def _max_tokens(body: dict) -> int | None:
    value = None
    for name in ("max_tokens", "max_completion_tokens"):
        v = _get(body, name, (int,), "an integer")
        if v is not None:
            if v < 1:
                raise bad_request(f"'{name}' must be at least 1, got {v}.", param=name, code="invalid_value")
            value = v  # max_completion_tokens, read last, wins: it is the newer name
    return value


def _sampling(body: dict, chat: bool) -> SamplingParams:
    params = SamplingParams(
        max_tokens=_max_tokens(body),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        seed=_seed(body),
        stop=_stop(body),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        logit_bias=_logit_bias(body),
    )
    if chat:
        params.logprobs = _get(body, "logprobs", (bool,), "a boolean", False)
        top = _get(body, "top_logprobs", (int,), "an integer")
        if top is not None:
            _in_range("top_logprobs", top, 0, MAX_TOP_LOGPROBS)
            if not params.logprobs:
                raise bad_request(
                    "'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs"
                )
            params.top_logprobs = top
    else:
        n = _get(body, "logprobs", (int,), "an integer")
        if n is not None:
            _in_range("logprobs", n, 0, MAX_COMPLETION_LOGPROBS)
            params.logprobs, params.top_logprobs = True, n
    return params


def _stream(body: dict) -> tuple[bool, bool]:
    stream = _get(body, "stream", (bool,), "a boolean", False)
    options = _get(body, "stream_options", (dict,), "an object")
    if options is not None and not stream:
        raise bad_request(
            "'stream_options' is only allowed when 'stream' is true.", param="stream_options"
        )
    include_usage = (options or {}).get("include_usage", False)
    if not isinstance(include_usage, bool) and include_usage is not None:
        raise _type_error("stream_options.include_usage", "a boolean", include_usage)
    return stream, bool(include_usage)


def _text_content(content: Any, param: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _type_error(param, "a string or a list of content parts", content)
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict):
            raise _type_error(f"{param}[{i}]", "an object", part)
        if part.get("type") != "text":
            raise bad_request(
                f"Content part type {part.get('type')!r} is not supported; only 'text' is.",
                param=f"{param}[{i}].type",
                code="unsupported_content",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise _type_error(f"{param}[{i}].text", "a string", text)
        texts.append(text)
    return "".join(texts)


def _arguments(raw: Any, param: str) -> Any:
    # Templates render arguments with `tojson`; a JSON string would be encoded twice.
    if isinstance(raw, dict):
        return raw
    if not isinstance(raw, str):
        raise _type_error(param, "a JSON string", raw)
    try:
        return orjson.loads(raw) if raw.strip() else {}
    except orjson.JSONDecodeError:
        return raw


def _tool_calls(calls: Any, param: str) -> list[dict]:
    if not isinstance(calls, list):
        raise _type_error(param, "a list", calls)
    out = []
    for i, call in enumerate(calls):
        p = f"{param}[{i}]"
        if not isinstance(call, dict):
            raise _type_error(p, "an object", call)
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"'{p}.function.name' is required.", param=f"{p}.function.name")
        args = _arguments(fn.get("arguments", "{}"), f"{p}.function.arguments")
        if call.get("type", "function") != "function":
            raise bad_request(f"'{p}.type' must be 'function'.", param=f"{p}.type",
                              code="invalid_value")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise _type_error(f"{p}.id", "a string", call_id)
        out.append(
            {
                "id": call_id,
                "type": "function",
                "function": {"name": fn["name"], "arguments": args},
            }
        )
    return out


def _message(msg: Any, i: int) -> dict:
    param = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise _type_error(param, "an object", msg)
    role = msg.get("role")
    if role not in ROLES:
        raise bad_request(
            f"Invalid role {role!r} in {param}; expected one of {', '.join(ROLES)}.",
            param=f"{param}.role",
            code="invalid_value",
        )
    content = _text_content(msg.get("content"), f"{param}.content")
    out: dict = {"role": role, "content": content}
    name = msg.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise _type_error(f"{param}.name", "a string", name)
        out["name"] = name
    calls = msg.get("tool_calls")
    if calls is not None:
        # Checked on every role (they are part of the prefix keys); rendered for assistants.
        calls = _tool_calls(calls, f"{param}.tool_calls")
    if role == "assistant" and calls:
        out["tool_calls"] = calls
    elif content is None and role != "assistant":
        raise bad_request(f"{param}.content is required for role {role!r}.", param=f"{param}.content")
    if role == "tool":
        call_id = msg.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise bad_request(
                f"{param}.tool_call_id is required for tool messages.",
                param=f"{param}.tool_call_id",
            )
        out["tool_call_id"] = call_id
    if out["content"] is None:
        out["content"] = ""
    return out


def _tools(body: dict) -> list[dict] | None:
    tools = _get(body, "tools", (list,), "a list of tools")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise bad_request(
            "Only tool_choice 'auto' and 'none' are supported.",
            param="tool_choice",
            code="unsupported_parameter",
        )
    if not tools or choice == "none":
        return None
    for i, tool in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise bad_request(f"{p} must be an object of type 'function'.", param=p)
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"{p}.function.name is required.", param=f"{p}.function.name")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise _type_error(f"{p}.function.parameters", "an object", fn["parameters"])
        if "description" in fn and not isinstance(fn["description"], str):
            raise _type_error(f"{p}.function.description", "a string", fn["description"])
    return tools


def _fault(body: dict) -> str | None:
    fault = body.get("kvroute_fault")
    return fault if isinstance(fault, str) else None


def parse_chat(body: dict) -> ChatRequest:
    _refuse_unsupported(body)
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise _type_error("messages", "a list of messages", messages)
    if not messages:
        raise bad_request("'messages' must not be empty.", param="messages", code="invalid_value")
    stream, include_usage = _stream(body)
    return ChatRequest(
        model=_model(body),
        messages=[_message(m, i) for i, m in enumerate(messages)],
        tools=_tools(body),
        stream=stream,
        include_usage=include_usage,
        params=_sampling(body, chat=True),
        fault=_fault(body),
    )


def parse_completion(body: dict) -> CompletionRequest:
    _refuse_unsupported(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        raise bad_request(
            "Only a single string prompt is supported.", param="prompt", code="unsupported_parameter"
        )
    if not isinstance(prompt, str):
        raise _type_error("prompt", "a string", prompt)
    if not prompt:
        raise bad_request("'prompt' must not be empty.", param="prompt", code="invalid_value")
    stream, include_usage = _stream(body)
    return CompletionRequest(
        model=_model(body),
        prompt=prompt,
        stream=stream,
        include_usage=include_usage,
        params=_sampling(body, chat=False),
        fault=_fault(body),
    )

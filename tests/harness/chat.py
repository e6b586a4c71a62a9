"""One chat completion through the official `openai` client, to a backend or a proxy,
and the tool list tests send with it."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:  # openai is a test extra: the benchmarks import the harness without it
    import openai
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

SCOPE_HEADER = "x-kvroute-scope"


def tool(name: str, description: str, parameters: dict | None = None) -> dict:
    """A function tool as a chat request carries it."""
    parameters = parameters or {"type": "object", "properties": {"query": {"type": "string"}}}
    return {"type": "function",
            "function": {"name": name, "description": description, "parameters": parameters}}


# The demo tool model calls this one (kvroute/devtools/demo_model.py).
TOOLS = [tool("get_weather", "Get the current weather for a city",
              {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})]


@dataclass
class Reply:
    """One answer: its headers, and either a whole completion or a stream's chunks."""

    headers: Mapping[str, str]
    body: dict | None = None  # a whole answer's JSON, as sent
    completion: ChatCompletion | None = None  # the same, as the official client parses it
    chunks: list[ChatCompletionChunk] = field(default_factory=list)

    @property
    def text(self) -> str:
        if self.completion is not None:
            return self.completion.choices[0].message.content or ""
        return "".join(c.choices[0].delta.content or "" for c in self.chunks if c.choices)

    @property
    def message(self) -> dict:
        """The assistant message as sent: what the next turn of a conversation carries."""
        assert self.body is not None, "a stream has no message"
        return self.body["choices"][0]["message"]


def client(server: Any, key: str = "unused", timeout: float = 60.0) -> openai.OpenAI:
    """The official client on `server` (anything with a `url`: a backend, a proxy, serve)."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=timeout)


def chat(server: Any, messages: list[dict], model: str | None = None, *, key: str = "unused",
         scope: str | None = None, headers: dict | None = None, timeout: float = 60.0,
         **params: Any) -> Reply:
    """One chat completion; `params` are the request's other fields (max_tokens, tools,
    stream, kvroute_fault, ...). `model` defaults to the server's own (a backend's model
    id); `key` is the API key; `scope` sets the cache-scope header. A non-2xx answer
    raises the client's error, which carries the error body."""
    completions = client(server, key, timeout).chat.completions
    # Fields the client has no parameter for (kvroute_fault) go in the body as they are.
    known = inspect.signature(completions.create).parameters
    extra_body = {k: params.pop(k) for k in list(params) if k not in known}
    extra_headers = {**({SCOPE_HEADER: scope} if scope else {}), **(headers or {})}
    raw = completions.with_raw_response.create(
        model=model or server.model_id, messages=messages, extra_headers=extra_headers or None,
        extra_body=extra_body or None, **params)
    parsed = raw.parse()
    if params.get("stream"):
        return Reply(raw.headers, chunks=list(parsed))
    return Reply(raw.headers, body=raw.http_response.json(), completion=parsed)

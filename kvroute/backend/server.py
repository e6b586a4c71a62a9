"""The backend's HTTP surface (aiohttp): OpenAI endpoints, health, metrics.

Handlers parse and validate, tokenize off the event loop, hand a `Job` to the
engine and relay its events. They never touch model state or caches; on a client
disconnect aiohttp cancels the handler and the `finally` sets the job's cancel
flag, which the engine honours within one step.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from kvroute.core import accel, prefix
from kvroute.api import openapi
from kvroute.api.process import bind_sockets, start_site, wait_for_stop
from kvroute.api.errors import APIError, bad_request, error_middleware, not_found
from kvroute.core.registry import BackendRecord, Registry, new_instance_id
from kvroute.core.usage import USAGE_HEADER, usage_comment
from kvroute.api.wire import (CHAT_PATH, COMPLETIONS_PATH, COUNT_TOKENS_PATH, HEALTH_PATH,
                              MODELS_PATH, SSE_HEADERS, ChatRequest, CompletionRequest, parse_chat,
                              parse_completion, parse_json)

from .disk import DiskTier, open_disk_tier
from .engine import Delta, Engine, Finish, Job
from .metrics import BackendMetrics
from .misses import Misses, template_opening, view_headers
from .publisher import Publisher
from .chunks import ChatBuilder, CompletionBuilder
from .store import Store

log = logging.getLogger("kvroute.backend")

# The engine thread (MLX) and the event loop share the GIL, and when both want it
# Python hands it over only every switch interval (5 ms by default): a decode step
# that ended while the loop was writing tokens out waited up to that long to queue
# the next one. On an H200 (7B, through the proxy) one stream decoded at 112 tok/s
# with 5 ms and 180 tok/s with 0.5 ms; 8 streams 529 and 569 (BENCHMARKS.md). On a
# CPU, where MLX's own work competes for the cores, 0.5 ms cost a tiny model's single
# stream a quarter of its rate, so there the default stays.
GPU_GIL_SWITCH_S = 0.0005

STATE_KEY = web.AppKey("state", object)


@dataclass(kw_only=True)
class BackendConfig:
    """`kvroute backend`'s settings; names, defaults and help are in kvroute/config.py."""

    model: str
    host: str
    port: int
    backend_id: str  # empty: <hostname>-<port>
    model_id: str  # the name clients use; empty: the model path's last part
    cache_bytes: int
    prefill_step: int  # 0: by platform (GPU 2048, CPU 512)
    memory_limit: int  # 0: MLX's default
    long_prefill: str  # auto, serial, batched
    cache_limit: int  # 0: a tenth of memory_limit
    no_warmup: bool
    max_batch: int
    max_queue: int
    max_body_bytes: int
    max_prompt_tokens: int  # 0: the model's context length
    default_max_tokens: int
    enable_faults: bool
    redis_url: str  # empty: no registry, the backend serves on its own
    secret: str  # salts the prefix keys; must be the same on every proxy and backend
    advertise_url: str  # the URL proxies should use; empty: http://host:port
    internal_token: str  # when set, /v1 and /debug require it in x-kvroute-token
    block_bytes: int
    disk_cache_dir: str = ""  # the disk tier's folder; empty: RAM only
    disk_cache_bytes: int = 0


@dataclass
class State:
    config: BackendConfig
    engine: Engine
    tokenizer: Any
    metrics: BackendMetrics
    store: Store
    context_length: int
    started: float
    instance_id: str = ""
    publisher: Publisher | None = None
    vocab_size: int = 0  # rows of the logits: logit_bias token ids must index inside them
    bytes_per_token: float = 0.0  # measured canonical request bytes per prompt token
    drops_reasoning: str = ""  # see _drops_reasoning
    layout: prefix.Layout = prefix.DEFAULT_LAYOUT  # the chat template's, see _chat_layout
    disk: DiskTier | None = None
    disk_publisher: Publisher | None = None  # keeps the disk tier's key sets in Redis
    device: dict = field(default_factory=dict)  # accelerator, memory limits, warm-up seconds


def _state(request: web.Request) -> State:
    return request.app[STATE_KEY]


async def _read_body(request: web.Request) -> dict:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise APIError(413, f"Request body too large: {exc.reason}.", code="request_too_large")
    return parse_json(raw)


def _check_model(state: State, model: str) -> None:
    if model != state.config.model_id:
        raise not_found(
            f"The model '{model}' does not exist on this backend; it serves "
            f"'{state.config.model_id}'.",
            param="model",
            code="model_not_found",
        )


def _render(state: State, messages: list[dict], tools: list[dict] | None, generation: bool,
            tokenize: bool = True) -> Any:
    out = state.tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=generation, tokenize=tokenize)
    return list(out) if tokenize else out


def _header_messages(messages: list[dict]) -> int:
    """How many leading messages form the shared header (system prompts)."""
    n = 0
    while n < len(messages) and messages[n].get("role") in ("system", "developer"):
        n += 1
    return n


def _render_prompt(state: State, req: ChatRequest) -> list[int]:
    try:
        return _render(state, req.messages, req.tools, True)
    except Exception as exc:  # template errors are the request's fault (bad role order, ...)
        raise bad_request(f"The messages could not be rendered by the chat template: {exc}.",
                          param="messages")


def _render_chat(state: State, req: ChatRequest) -> tuple[list[int], dict[int, int]]:
    """The prompt, and {token position: number of messages it ends} for the
    checkpoints a model with untrimmable caches keeps (see engine.py)."""
    prompt = _render_prompt(state, req)
    marks: dict[int, int] = {}
    if state.engine.checkpointing:
        text = _render(state, req.messages, req.tools, True, tokenize=False)
        for n in {_header_messages(req.messages), len(req.messages)}:
            position = _prefix_position(state, prompt, text, req.messages[:n], req.tools)
            if position:
                marks[position] = n
    return prompt, marks


def _template_tokens(state: State, text: str) -> list[int]:
    # As apply_chat_template tokenizes: the template writes BOS itself.
    return list(state.tokenizer.encode(text, add_special_tokens=False))


def _prefix_position(state: State, prompt: list[int], text: str, messages: list[dict],
                     tools: list[dict] | None) -> int | None:
    """Where the rendering of `messages` ends inside `prompt` (rendered as
    `text`), or None where the template renders that part differently or refuses
    it. Only a position is chosen here: the checkpoint holds the prompt's own
    tokens up to it, so a slightly off position costs a hit, never correctness."""
    if not messages:
        return None
    try:
        head = _render(state, messages, tools, False, tokenize=False)
    except Exception:
        return None
    if not (0 < len(head) < len(text) and text.startswith(head)):
        return None
    if len(head) <= len(text) // 2:
        tokens = _template_tokens(state, head)
        n = len(tokens)
        return n if n < len(prompt) and prompt[:n] == tokens else None
    # Tokenize the shorter side: the rest (the generation prompt, for the last
    # message) starts with a special token in chat templates, where tokenizers
    # split before anything else, so its tokens end the prompt's.
    tail = _template_tokens(state, text[len(head):])
    n = len(prompt) - len(tail)
    return n if 0 < n and prompt[n:] == tail else None


def _encode(state: State, prompt: str) -> list[int]:
    return list(state.tokenizer.encode(prompt))


def _budget(state: State, prompt: list[int], requested: int | None, prompt_param: str) -> int:
    limit = state.config.max_prompt_tokens or state.context_length
    limit = min(limit, state.context_length)
    if len(prompt) > limit:
        raise bad_request(
            f"This model's maximum prompt length is {limit} tokens; your prompt has "
            f"{len(prompt)} tokens.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    room = state.context_length - len(prompt)
    if requested is not None and requested > room:
        raise bad_request(
            f"This model's maximum context length is {state.context_length} tokens; you "
            f"requested {len(prompt) + requested} ({len(prompt)} in the prompt, {requested} "
            "for the completion).",
            param="max_tokens",
            code="context_length_exceeded",
        )
    if room < 1:
        raise bad_request("The prompt leaves no room for a completion.", param=prompt_param,
                          code="context_length_exceeded")
    return requested if requested is not None else min(room, state.config.default_max_tokens)


def _scope(request: web.Request) -> str | None:
    # Set by the proxy from the client's API key; it only narrows what can hit.
    return request.headers.get("x-kvroute-scope") or None


def _keys(pairs: list[tuple[int, int]]) -> list[int]:
    return [k for k, _ in pairs]


def _chat_chains(state: State, body: dict, req: ChatRequest, scope: str | None,
                 marks: dict[int, int], prompt: list[int]):
    """The request's prefix keys, the keys of each checkpoint, a function giving the
    keys of the next turn once the reply is known, and one giving the keys of a prefill
    cut short."""
    salt = prefix.make_salt(state.config.secret, scope)
    kw = {"model": req.model, "salt": salt, "block_bytes": state.config.block_bytes,
          "layout": state.layout}
    try:
        pairs = prefix.request_chain("chat", body, **kw)
    except ValueError as exc:  # what the template ignores but the key scheme refuses
        raise bad_request(f"Invalid request: {exc}.")
    chain = _keys(pairs)
    _calibrate(state, pairs, len(prompt))
    n_messages = len(body["messages"])
    checkpoints = {len(prompt) - 1: chain}
    for position, n in marks.items():
        checkpoints[position] = chain if n == n_messages else _keys(prefix.request_chain(
            "chat", {**body, "messages": body["messages"][:n]}, **kw))
    think = state.drops_reasoning

    def extend(text: str, tool_calls: list[dict]) -> list[int]:
        if think and think in text:
            # The template renders past replies without their reasoning: next turn's
            # prompt will not extend what this sequence holds past the prompt.
            return chain
        # The assistant turn exactly as an OpenAI client will send it back next time.
        reply: dict = {"role": "assistant", "content": text or None}
        if tool_calls:
            reply["tool_calls"] = tool_calls
        nxt = _keys(prefix.request_chain(
            "chat", {**body, "messages": body["messages"] + [reply]}, **kw))
        # A template that moves the tools or the system prompt past the reply (Mistral:
        # into the last user turn) renders the next turn differently from what this
        # sequence holds: its chain no longer extends the request's.
        return nxt if nxt[:len(chain)] == chain else chain

    def partial(n_tokens: int) -> tuple[int, list[int]]:
        """(token end, keys) of the most leading messages whose rendering ends within
        the first n_tokens: what a prefill cut short (a client gone mid-prompt) can be
        found by. Positions grow with the messages, so a binary search renders a few
        heads only; a head the template renders otherwise counts as too long (fewer
        keys, never a wrong one)."""
        messages = body["messages"]
        text = _render(state, req.messages, req.tools, True, tokenize=False)
        lo, hi, best = 1, len(messages) - 1, (0, [])
        while lo <= hi:
            n = (lo + hi) // 2
            position = _prefix_position(state, prompt, text, req.messages[:n], req.tools)
            if position is not None and position <= n_tokens:
                best, lo = (position, n), n + 1
            else:
                hi = n - 1
        if not best[0]:
            return 0, []
        position, n = best
        return position, _keys(prefix.request_chain("chat", {**body, "messages": messages[:n]}, **kw))

    return chain, checkpoints, extend, partial


def _completion_chains(state: State, body: dict, req: CompletionRequest, scope: str | None,
                       prompt: list[int]):
    salt = prefix.make_salt(state.config.secret, scope)
    kw = {"model": req.model, "salt": salt, "block_bytes": state.config.block_bytes}

    def extend(text: str, tool_calls: list[dict]) -> list[int]:
        return _keys(prefix.request_chain("completion", {"prompt": req.prompt + text}, **kw))

    pairs = prefix.request_chain("completion", body, **kw)
    _calibrate(state, pairs, len(prompt))
    chain = _keys(pairs)
    # One prompt string, one segment: no key names a part of it.
    return chain, {len(prompt) - 1: chain}, extend, None


def _calibrate(state: State, pairs: list[tuple[int, int]], prompt_tokens: int) -> None:
    """Measure canonical-stream bytes per prompt token: proxies have no tokenizer
    and turn request bytes into tokens with it (published in the record)."""
    if pairs and prompt_tokens > 0:
        ratio = pairs[-1][1] / prompt_tokens
        old = state.bytes_per_token
        state.bytes_per_token = ratio if not old else 0.9 * old + 0.1 * ratio


def _chat_layout(tokenizer) -> prefix.Layout:
    """Where the chat template renders the tools and the system prompt, found by
    rendering probe conversations (prefix.detect_layout): every chain this backend
    advertises follows it, and its record tells the proxies."""

    def render(messages: list[dict], tools: list[dict] | None) -> str:
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                             tokenize=False)

    layout, problem = prefix.detect_layout(render)
    if problem:
        log.warning("chat template: %s; prefix keys hash the tools before the messages, "
                    "which may predict cache hits that the tokens do not have", problem)
    else:
        log.info("chat template layout: %s", layout)
    return layout


def _drops_reasoning(tokenizer) -> str:
    """The reasoning start marker when the chat template drops the reasoning of past
    replies (Qwen3-style), else "": the reply of such a turn is not a prefix of the
    next turn's prompt, so only the request's own chain may be advertised for it."""
    start, end = getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None)
    if not (isinstance(start, str) and isinstance(end, str) and start and end):
        return ""
    probe = "kvroute-probe-reasoning"
    messages = [{"role": "user", "content": "a"},
                {"role": "assistant", "content": f"{start}{probe}{end}answer"},
                {"role": "user", "content": "b"}]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception:
        return ""
    return "" if probe in text else start


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = _state(request)
    body = await _read_body(request)
    req = parse_chat(body)
    _check_model(state, req.model)
    scope = _scope(request)
    prompt, marks = await asyncio.to_thread(_render_chat, state, req)
    chains = _chat_chains(state, body, req, scope, marks, prompt)
    builder = ChatBuilder(state.config.model_id, logprobs=req.params.logprobs)
    return await _generate(request, state, req, prompt, builder, req.tools, chains, scope)


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt tokens a chat body renders to with this model's chat template, as
    `usage.prompt_tokens` of the same body would count them; nothing is generated. For
    the proxy's /v1/messages/count_tokens: only a backend has the tokenizer."""
    state = _state(request)
    req = parse_chat(await _read_body(request))
    _check_model(state, req.model)
    prompt = await asyncio.to_thread(_render_prompt, state, req)
    return web.json_response({"object": "token_count", "model": req.model,
                              "prompt_tokens": len(prompt)},
                             dumps=lambda o: orjson.dumps(o).decode())


async def completions(request: web.Request) -> web.StreamResponse:
    state = _state(request)
    body = await _read_body(request)
    req = parse_completion(body)
    _check_model(state, req.model)
    scope = _scope(request)
    prompt = await asyncio.to_thread(_encode, state, req.prompt)
    chains = _completion_chains(state, body, req, scope, prompt)
    builder = CompletionBuilder(state.config.model_id, logprobs=req.params.logprobs)
    return await _generate(request, state, req, prompt, builder, None, chains, scope)


async def _generate(
    request: web.Request,
    state: State,
    req: ChatRequest | CompletionRequest,
    prompt: list[int],
    builder: ChatBuilder | CompletionBuilder,
    tools: list[dict] | None,
    chains: tuple,
    scope: str | None,
) -> web.StreamResponse:
    prompt_param = "messages" if isinstance(req, ChatRequest) else "prompt"
    max_tokens = _budget(state, prompt, req.params.max_tokens, prompt_param)
    bias = req.params.logit_bias
    if bias and max(bias) >= state.vocab_size:
        # An id past the logits would index out of bounds inside MLX (a crash, not an error).
        raise bad_request(f"logit_bias token id {max(bias)} is outside the vocabulary "
                          f"(0 to {state.vocab_size - 1}).", param="logit_bias",
                          code="invalid_value")
    chain, checkpoints, extend_chain, partial_chain = chains
    job = Job(
        prompt=prompt,
        params=req.params,
        max_tokens=max_tokens,
        tools=tools,
        loop=asyncio.get_running_loop(),
        events=asyncio.Queue(),
        chain=chain,
        checkpoints=checkpoints,
        extend_chain=extend_chain,
        partial_chain=partial_chain,
        scope=scope,
        fault=req.fault if state.config.enable_faults else None,
    )
    if state.disk is not None:
        job.restored = await state.disk.prefetch(
            state.config.model_id, prompt, scope,
            lambda: state.store.depth(state.config.model_id, prompt, scope),
            state.engine.prefill_tps)
    state.engine.submit(job)
    try:
        if req.stream:
            return await _stream(request, job, builder, req.include_usage)
        return await _whole(job, builder)
    finally:
        # Runs on normal completion, on errors, and when aiohttp cancels the
        # handler because the client went away: the engine then frees the slot.
        job.cancel()


async def _whole(job: Job, builder: ChatBuilder | CompletionBuilder) -> web.Response:
    while True:
        event = await job.events.get()
        if isinstance(event, Delta):
            builder.add(event)
        elif isinstance(event, Finish):
            return web.Response(body=orjson.dumps(builder.whole(event)), content_type="application/json",
                                headers=_cache_headers(job))
        else:
            raise event


def _cache_headers(job: Job) -> dict:
    # Known once the engine admitted the job (before its first event): lets the
    # proxy measure routing precision without parsing streamed bodies.
    headers = {
        "x-kvroute-prompt-tokens": str(len(job.prompt)),
        "x-kvroute-cached-tokens": str(job.cached_tokens),
    }
    if job.first_token_at is not None:
        headers["x-kvroute-ttft-ms"] = f"{(job.first_token_at - job.submitted) * 1000:.1f}"
    headers.update(view_headers(job.miss))
    return headers


def _sse(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def _stream(
    request: web.Request, job: Job, builder: ChatBuilder | CompletionBuilder, include_usage: bool
) -> web.StreamResponse:
    # Wait for the first event before committing to a 200, so that an engine
    # failure before any output is still reported with a proper status code.
    first = await job.events.get()
    if isinstance(first, APIError):
        raise first
    resp = web.StreamResponse(
        headers={**SSE_HEADERS, **_cache_headers(job)}
    )
    try:
        await resp.prepare(request)
        preamble = builder.first_chunk(include_usage)
        if preamble is not None:
            await resp.write(_sse(preamble))
        event = first
        while True:
            if isinstance(event, Delta):
                await resp.write(_sse(builder.delta_chunk(event, include_usage)))
            elif isinstance(event, Finish):
                await resp.write(_sse(builder.finish_chunk(event, include_usage)))
                if include_usage:
                    await resp.write(_sse(builder.usage_chunk(event)))
                if request.headers.get(USAGE_HEADER):  # the proxy counts every team's tokens
                    await resp.write(usage_comment(event.completion_tokens))
                break
            else:
                await resp.write(_sse(event.body()))
                break
            event = await job.events.get()
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionError:
        # The client went away between two events (before aiohttp cancelled this
        # handler): a disconnect, not a server error. _generate's finally frees the slot.
        request["client_gone"] = True
    return resp


async def models(request: web.Request) -> web.Response:
    state = _state(request)
    body = {
        "object": "list",
        "data": [
            {
                "id": state.config.model_id,
                "object": "model",
                "created": int(state.started),
                "owned_by": "kvroute",
                "context_length": state.context_length,
            }
        ],
    }
    return web.json_response(body, dumps=lambda o: orjson.dumps(o).decode())


async def health(request: web.Request) -> web.Response:
    state = _state(request)
    body = {
        "status": "ok",
        "backend_id": state.config.backend_id,
        "instance_id": state.instance_id,
        "pid": os.getpid(),
        "model": state.config.model_id,
        "uptime_s": round(time.time() - state.started, 1),
        "cache": state.store.stats(),
        "disk": state.disk.stats() if state.disk is not None else None,
        "device": state.device,
        "engine": state.engine.snapshot(),
    }
    return web.json_response(body, dumps=lambda o: orjson.dumps(o).decode())


async def metrics(request: web.Request) -> web.Response:
    state = _state(request)
    return web.Response(body=state.metrics.render(), content_type="text/plain", charset="utf-8")


async def cache_entries(request: web.Request) -> web.Response:
    """Entries of the prompt-cache store, with a digest of each entry's KV bytes.
    Shows hashes and counts only, never tokens or text."""
    state = _state(request)
    entries = await state.engine.call(lambda: _describe_entries(state.store))
    return web.json_response({"entries": entries}, dumps=lambda o: orjson.dumps(o).decode())


def _describe_entries(store: Store) -> list[dict]:
    import mlx.core as mx
    import numpy as np
    import xxhash
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import KVCache

    from .store import held_tokens

    out = []
    with store.lock:
        for e in store.entries.values():
            digest = xxhash.xxh3_64()
            for _, arr in tree_flatten([c.state for c in e.cache]):
                if isinstance(arr, mx.array):
                    # bfloat16 has no numpy dtype: hash the raw bytes through a view.
                    digest.update(np.array(arr.view(mx.uint16) if arr.dtype == mx.bfloat16 else arr).tobytes())
            # Full-attention layers store exactly their tokens' keys; windows and
            # recurrent states hold less (their `offset` still counts every token).
            full = [c.keys.shape[2] for c in e.cache if type(c) is KVCache and c.keys is not None]
            out.append(
                {
                    "id": e.id,
                    "tokens": int(len(e.tokens)),
                    "kv_tokens": min(full) if full else None,
                    "kv_tokens_max": max(full) if full else None,
                    "offset": held_tokens(e.cache),
                    "trimmable": e.trimmable,
                    "nbytes": e.nbytes,
                    "exit_path": e.exit_path,
                    "hits": e.hits,
                    "kv_digest": digest.hexdigest(),
                    # The prefix keys advertised for it, as stored in Redis (hashes only).
                    "chain": [f"{k:016x}" for k in e.chain],
                }
            )
    return out


def _token_middleware(token: str):
    @web.middleware
    async def check(request: web.Request, handler):
        if request.path.startswith(("/v1/", "/debug/")):
            given = request.headers.get("x-kvroute-token", "")
            if not hmac.compare_digest(given.encode(), token.encode()):
                raise APIError(401, "This backend only answers its kvroute proxies.",
                               "authentication_error", None, "invalid_internal_token")
        return await handler(request)

    return check


def _count_middleware(metrics_: BackendMetrics):
    @web.middleware
    async def count(request: web.Request, handler):
        # Outermost: sees the final status, after errors became envelopes.
        status = 500
        try:
            response = await handler(request)
            status = 499 if request.get("client_gone") else response.status
            return response
        except asyncio.CancelledError:
            status = 499  # the client went away
            raise
        finally:
            if request.path.startswith("/v1/"):
                metrics_.l(metrics_.requests, endpoint=request.path, status=str(status)).inc()

    return count


_OPENAPI = orjson.dumps(openapi.spec("backend"))


async def openapi_json(request: web.Request) -> web.Response:
    return web.Response(body=_OPENAPI, content_type="application/json")


def create_app(state: State) -> web.Application:
    middlewares = [_count_middleware(state.metrics), error_middleware]
    if state.config.internal_token:
        middlewares.append(_token_middleware(state.config.internal_token))
    app = web.Application(middlewares=middlewares, client_max_size=state.config.max_body_bytes)
    app[STATE_KEY] = state
    app.router.add_post(CHAT_PATH, chat_completions)
    app.router.add_post(COMPLETIONS_PATH, completions)
    app.router.add_post(COUNT_TOKENS_PATH, count_tokens)
    app.router.add_get(MODELS_PATH, models)
    app.router.add_get(HEALTH_PATH, health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi_json)
    app.router.add_get("/debug/cache", cache_entries)
    return app


def load_state(config: BackendConfig) -> State:
    from mlx_lm import load

    t0 = time.perf_counter()
    device = accel.detect()
    limits = accel.apply_limits(config.memory_limit, config.cache_limit)
    config.prefill_step = config.prefill_step or (512 if device.kind == "cpu" else 2048)
    model, tokenizer, model_config = load(config.model, return_config=True)
    _evaluate_private_arrays(model)
    config.model_id = config.model_id or Path(config.model.rstrip("/")).name
    # Hostname and port: unique across the Macs or containers of one deployment.
    config.backend_id = config.backend_id or f"{socket.gethostname().split('.')[0]}-{config.port}"
    context = int(model_config.get("max_position_embeddings") or 0) or 32768
    metrics_ = BackendMetrics(config.model_id, config.backend_id)
    store = Store(config.cache_bytes)
    metrics_.l(metrics_.cache_budget).set(config.cache_bytes)

    def count_evictions(event) -> None:
        if event.kind == "evict" and event.reason == "evicted":
            metrics_.l(metrics_.evictions).inc()

    store.listeners.append(count_evictions)
    engine = Engine(
        model,
        tokenizer,
        config.model_id,
        store,
        metrics_,
        prefill_step=config.prefill_step,
        serial_prefill=config.long_prefill == "serial"
        or (config.long_prefill == "auto" and device.kind != "cpu"),
        max_batch=config.max_batch,
        max_queue=config.max_queue,
        keep_buffers=device.kind != "cpu" and "cache_limit" in limits,
    )
    log.info("loaded %s in %.1fs (context %d)", config.model, time.perf_counter() - t0, context)
    disk = open_disk_tier(config.model, config.disk_cache_dir, config.disk_cache_bytes,
                          config.cache_bytes, store, metrics_)
    engine.misses = Misses(store, metrics_, disk, template_opening(tokenizer))
    return State(config, engine, tokenizer, metrics_, store, context, time.time(), new_instance_id(),
                 vocab_size=_vocab_size(model_config, tokenizer), disk=disk,
                 drops_reasoning=_drops_reasoning(tokenizer), layout=_chat_layout(tokenizer),
                 device={"kind": device.kind, "name": device.name, "memory": device.memory,
                         "prefill_step": config.prefill_step,
                         "serial_prefill": engine.serial_prefill, **limits})


def _evaluate_private_arrays(model) -> None:
    """Evaluate arrays that `load` leaves lazy: private attributes (e.g. YaRN's
    `_freqs` in gpt-oss and DeepSeek) are not parameters. Built on this loading
    thread, they would be evaluated on the engine thread, where MLX finds no
    stream of the thread that made them and every request fails."""
    import mlx.core as mx

    arrays = [v for _, module in model.named_modules()
              for k, v in [*module.items(), *vars(module).items()]
              if k.startswith("_") and isinstance(v, mx.array)]
    mx.eval(arrays)


def _vocab_size(model_config: dict, tokenizer) -> int:
    for cfg in (model_config, model_config.get("text_config") or {}):
        if isinstance(cfg.get("vocab_size"), int) and cfg["vocab_size"] > 0:
            return cfg["vocab_size"]
    return int(tokenizer.vocab_size)  # the base vocabulary: never more rows than the logits


def _record(state: State) -> BackendRecord:
    c = state.config
    stats = state.store.stats()
    return BackendRecord(
        backend_id=c.backend_id,
        instance_id=state.instance_id,
        url=c.advertise_url or f"http://{c.host}:{c.port}",
        models=[c.model_id],
        cache_bytes=stats["bytes"],
        cache_budget=stats["budget_bytes"],
        waiting=state.engine.waiting,
        running=state.engine.queue_depth - state.engine.waiting,
        **_disk_record(state),
        prefill_tps=state.engine.prefill_tps,
        bytes_per_token=round(state.bytes_per_token, 3),
        decode_steps_per_s=round(state.engine.decode_steps_per_s, 2),
        reply_tokens=round(state.engine.reply_tokens, 1),
        decoding=state.engine.decoding,
        max_batch=state.engine.max_batch,
        **prefix.fingerprint(c.secret, c.block_bytes),
        tools_at=state.layout.tools_at,
        system_at=state.layout.system_at,
        tools_mark=state.layout.tools_mark,
        started_at=state.started,
        updated_at=time.time(),
    )


def start_publisher(state: State) -> Publisher:
    registry = Registry(state.config.redis_url)
    publisher = Publisher(registry, lambda: _record(state), state.store.snapshot)

    state.store.listeners.append(publisher.on_store_event)
    state.engine.on_load_change = publisher.beat_soon
    m = state.metrics
    m.l(m.registry_failures).set_function(lambda: publisher.failures)
    m.l(m.registry_connected).set_function(lambda: float(publisher.connected))
    if state.disk is not None:
        state.disk_publisher = Publisher(registry, lambda: _record(state), state.disk.snapshot,
                                         tier="disk")
        state.disk.listeners.append(state.disk_publisher.on_store_event)
    return publisher


def _disk_record(state: State) -> dict:
    disk, m = state.disk, state.metrics
    hits = {f"{tier}_hits": int(m.l(m.hits, tier=tier)._value.get()) for tier in ("ram", "disk")}
    if disk is None:
        return hits
    return {**hits, "disk_bytes": disk.nbytes, "disk_budget": disk.budget_bytes,
            "restore_tps": disk.restore_tps}


async def _first_sync(publishers: list[Publisher], timeout: float = 5.0) -> None:
    """Advertise what the store and the disk hold before serving, so a restarted
    backend is found by what it kept; past `timeout` (Redis down) serve anyway."""
    deadline = time.monotonic() + timeout
    while any(p.resyncs == 0 for p in publishers) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


async def serve(config: BackendConfig) -> None:
    socks = bind_sockets(config.host, config.port)  # the port is ours from now on
    state = await asyncio.to_thread(load_state, config)
    if state.device["kind"] != "cpu":
        sys.setswitchinterval(GPU_GIL_SWITCH_S)
    if config.redis_url and not config.advertise_url and config.host in ("0.0.0.0", "::"):
        log.warning("listening on %s without --advertise-url: proxies will be told "
                    "http://%s:%d, which they cannot reach", config.host, config.host, config.port)
    if not config.secret and config.redis_url:
        log.warning("no --secret set: prefix keys in Redis are salted with a public default")
    state.engine.start()
    if not config.no_warmup:
        # Before the registry or a proxy hears of this backend: healthy means warm.
        seconds = await state.engine.call(state.engine.warm_up)
        state.device["warmup_s"] = round(seconds, 2)
        log.info("warmed up in %.1fs (prefill step %d)", seconds, config.prefill_step)
    # How long a prompt one entry may hold under the budgets, said once at start.
    await state.engine.call(lambda: state.engine.describe_budgets(
        state.disk.budget_bytes if state.disk else 0, state.context_length))
    if config.redis_url:
        state.publisher = start_publisher(state)
        await state.publisher.start()
        if state.disk_publisher is not None:
            await state.disk_publisher.start()
        await _first_sync([p for p in (state.publisher, state.disk_publisher) if p])
    runner = await start_site(create_app(state), config.host, config.port, socks)
    log.info("backend %s serving %s on http://%s:%d", config.backend_id, config.model_id,
             config.host, config.port)
    await wait_for_stop()
    log.info("shutting down")
    if state.publisher is not None:
        # Withdraw this instance's advertisements first: no proxy should route here now.
        if state.disk_publisher is not None:
            await state.disk_publisher.stop(withdraw=True)
        await state.publisher.stop(withdraw=True)
        await state.publisher.registry.close()
    await runner.cleanup()  # lets in-flight requests finish, up to shutdown_timeout
    await asyncio.to_thread(state.engine.stop)
    if state.disk is not None:
        await asyncio.to_thread(state.disk.close)  # finishes the writes already queued

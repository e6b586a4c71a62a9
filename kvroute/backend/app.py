"""The backend's HTTP surface (aiohttp): OpenAI endpoints, health, metrics.

Handlers parse and validate, render and hash the prompt off the event loop, hand a
`Job` to the engine and relay its events. They never touch model state or caches; on a
client disconnect aiohttp cancels the handler and the `finally` sets the job's cancel
flag, which the engine honours within one step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import orjson
from aiohttp import web

from kvroute.api import openapi
from kvroute.api.errors import APIError, bad_request, embeddings, error_middleware, not_found
from kvroute.api.http import SSE_DONE, SSE_HEADERS, json_response, read_json, sse_data
from kvroute.api.routes import (CHAT_PATH, COMPLETIONS_PATH, COUNT_TOKENS_PATH, EMBEDDINGS_PATH,
                                HEALTH_PATH, MODELS_PATH)
from kvroute.config import BackendConfig
from kvroute.core import accel
from kvroute.core.usage import USAGE_HEADER, usage_comment

from .chunks import ChatBuilder, CompletionBuilder
from .debug import describe_entries
from .disk import DiskTier, Early, Found
from .engine import Engine
from .grammar import Grammar, GrammarError, Grammars, GrammarSpec
from .jobs import Delta, Finish, Job
from .metrics import BackendMetrics
from .misses import view_headers
from .prompt import Prompt, Template
from .publisher import Publisher
from .requests import (ChatRequest, CompletionRequest, SamplingParams, parse_chat,
                       parse_completion)
from .store import Store
from .vision import Vision

STATE_KEY = web.AppKey("state", object)
log = logging.getLogger("kvroute.backend.app")


@dataclass
class State:
    """What the handlers read: built once the model is loaded (boot.py)."""

    config: BackendConfig
    engine: Engine
    template: Template
    metrics: BackendMetrics
    store: Store
    context_length: int
    started: float
    instance_id: str = ""
    publisher: Publisher | None = None
    vocab_size: int = 0  # rows of the logits: logit_bias token ids must index inside them
    disk: DiskTier | None = None
    disk_publisher: Publisher | None = None  # keeps the disk tier's key sets in Redis
    device: dict = field(default_factory=dict)  # accelerator, memory limits, warm-up seconds
    grammars: Grammars | None = None  # compiled grammars; None: the tokenizer has none
    grammars_missing: str = ""  # why not, for the 400 a constrained request gets
    vision: Vision | None = None  # the vision step of a model that takes images


def _state(request: web.Request) -> State:
    return request.app[STATE_KEY]


def _check_model(state: State, model: str) -> None:
    if model != state.config.model_id:
        raise not_found(
            f"The model '{model}' does not exist on this backend; it serves "
            f"'{state.config.model_id}'.",
            param="model",
            code="model_not_found",
        )


def _scope(request: web.Request) -> str | None:
    # Set by the proxy from the client's API key; it only narrows what can hit.
    return request.headers.get("x-kvroute-scope") or None


# -- generation -----------------------------------------------------------------------


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_chat, ChatBuilder)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_completion, CompletionBuilder)


async def _generate(
    request: web.Request,
    parse: Callable[[dict], ChatRequest | CompletionRequest],
    builder_type: type[ChatBuilder] | type[CompletionBuilder],
) -> web.StreamResponse:
    arrived = time.perf_counter()
    state = _state(request)
    _, body = await read_json(request)
    req = parse(body)
    _check_model(state, req.model)
    scope = _scope(request)
    _check_vocabulary(state, req.params.logit_bias, "logit_bias")
    if isinstance(req, CompletionRequest) and isinstance(req.prompt, list):
        _check_vocabulary(state, req.prompt, "prompt")
    prompt, early, found = await asyncio.to_thread(_prepare, state, req, body, scope)
    state.metrics.l(state.metrics.prompt_time).observe(time.perf_counter() - arrived)
    prompt_param = "messages" if isinstance(req, ChatRequest) else "prompt"
    try:
        max_tokens = _budget(state, prompt.tokens, req.params.max_tokens, prompt_param)
        grammar = None
        if isinstance(req, ChatRequest) and req.grammar is not None:
            grammar = await _compile(state, req.grammar)
    except BaseException:  # refused (a prompt past the context, a bad grammar)
        if state.disk is not None and early is not None:
            state.disk.let_go(early)
        raise
    params = _no_image_token(state, req.params)

    def choice(i: int, after: Job | None) -> Job:
        return Job(
            prompt=prompt.tokens,
            params=_nth(params, i),
            max_tokens=max_tokens,
            tools=prompt.tools,
            loop=asyncio.get_running_loop(),
            events=asyncio.Queue(),
            chain=prompt.chain,
            checkpoints=prompt.checkpoints,
            extend_chain=prompt.extend,
            partial_chain=prompt.partial,
            scope=scope,
            fault=req.fault if state.config.enable_faults else None,
            grammar=grammar,
            after=after,
            submitted=arrived,  # its TTFT counts from the request's arrival
        )

    job = choice(0, None)
    jobs = [job, *(choice(i, job) for i in range(1, req.n))]
    if state.disk is not None:
        job.restored = await state.disk.prefetch(
            state.config.model_id, job.prompt, scope,
            lambda: state.store.depth(state.config.model_id, job.prompt, scope),
            state.engine.prefill_tps, early, found)
    first = builder_type(state.config.model_id, logprobs=req.params.logprobs)
    builders = [first, *(builder_type(first.model, logprobs=first.logprobs, index=i, id=first.id,
                                      created=first.created) for i in range(1, req.n))]
    choices = Choices(jobs)
    if prompt.images and state.vision is not None:
        # The encoder reads them when the prefill reaches them (vision.py).
        for _ in jobs:
            state.vision.hold(prompt.images)
    try:
        for j in jobs:
            state.engine.submit(j)
        state.metrics.l(state.metrics.prepare).observe(time.perf_counter() - arrived)
        if req.stream:
            return await _stream(request, choices, builders, req.include_usage, state.metrics)
        return await _whole(choices, builders)
    finally:
        # Runs on normal completion, on errors, and when aiohttp cancels the
        # handler because the client went away: the engine then frees the slot.
        choices.close()
        if prompt.images and state.vision is not None:
            for j in jobs:
                _release_when_done(state.vision, j, prompt.images)


def _check_vocabulary(state: State, ids: Iterable[int], param: str) -> None:
    """A 400 naming `param` for a token id past the logits (or the embeddings): MLX
    would index out of bounds with it (a crash, not an error)."""
    top = max(ids, default=-1)
    if top >= state.vocab_size:
        raise bad_request(f"{param} token id {top} is outside the vocabulary "
                          f"(0 to {state.vocab_size - 1}).", param=param, code="invalid_value")


def _prepare(state: State, req: ChatRequest | CompletionRequest, body: dict,
             scope: str | None) -> tuple[Prompt, Early | None, Found | None]:
    """The request's prompt (the handler's thread). Its prefix keys come first: the
    disk tier begins reading the record they find while the template renders and
    tokenizes (a restore's read then hides the prompt's ~5-10 ms). With a disk tier,
    the record its tokens find too, in the same thread (`DiskTier.find`)."""
    try:
        pairs: list[tuple[int, int]] | None = state.template.keys(req, body, scope)
    except APIError:
        pairs = None  # the prompt refuses it, or first what it finds wrong before (an image)
    early = None
    model = state.config.model_id
    if state.disk is not None and pairs is not None:
        early = state.disk.read_early(model, [k for k, _ in pairs],
                                      lambda keys: state.store.advertises(model, keys),
                                      state.engine.prefill_tps)
    try:
        prompt = state.template.prompt(req, body, scope, pairs)
        found = None
        if state.disk is not None:
            found = state.disk.find(model, prompt.tokens, scope,
                                    lambda: state.store.depth(model, prompt.tokens, scope))
        return prompt, early, found
    except BaseException:
        if state.disk is not None and early is not None:
            state.disk.let_go(early)
        raise


def _release_when_done(vision: Vision, job: Job, images: list) -> None:
    """Let the images go once the engine is done with the job (its phase "done"): a
    cancelled job may still be waiting for, or in, a prefill step that reads them."""
    if job.phase == "done":
        vision.release(images)
        return
    asyncio.get_running_loop().call_later(0.05, _release_when_done, vision, job, images)


def _no_image_token(state: State, params: SamplingParams) -> SamplingParams:
    """A vision model's sampling with its image token never drawn: a reply holding
    it would come back in the next turn's text, which then has more image tokens than
    images and is refused, leaving the conversation stuck."""
    if state.vision is None:
        return params
    banned = {state.vision.prompt.image_token_id: float("-inf")}
    return dataclasses.replace(params, logit_bias={**params.logit_bias, **banned})


def _nth(params: SamplingParams, i: int) -> SamplingParams:
    """Choice i's sampling: a seeded request's choices each get their own seed (the same
    one would make them the same answer)."""
    if i == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + i) % (1 << 64))


class Choices:
    """The events of a request's choices as one stream of (choice, event); one choice's
    are read straight from its job."""

    def __init__(self, jobs: list[Job]):
        self.jobs = jobs
        self._queue: asyncio.Queue | None = asyncio.Queue() if len(jobs) > 1 else None
        self._tasks = ([asyncio.create_task(self._pump(i, j)) for i, j in enumerate(jobs)]
                       if self._queue is not None else [])

    async def _pump(self, i: int, job: Job) -> None:
        while True:
            event = await job.events.get()
            self._queue.put_nowait((i, event))
            if not isinstance(event, Delta):
                return

    async def get(self) -> tuple[int, Delta | Finish | APIError]:
        if self._queue is None:
            return 0, await self.jobs[0].events.get()
        return await self._queue.get()

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for job in self.jobs:
            job.cancel()


def _total(finishes: list[Finish]) -> Finish:
    """The usage of all choices: the prompt once, every choice's completion tokens."""
    return dataclasses.replace(finishes[0],
                               completion_tokens=sum(f.completion_tokens for f in finishes))


async def _compile(state: State, spec: GrammarSpec) -> Grammar:
    """The grammar of `spec`, compiled off the event loop (once per spec: the cache)."""
    if state.grammars is None:
        param = "tool_choice" if spec.kind == "tool_call" else "response_format"
        raise bad_request(f"Constrained decoding is not available for this model: "
                          f"{state.grammars_missing}", param, "unsupported_parameter")
    m, hits = state.metrics, state.grammars.hits
    try:
        grammar = await asyncio.to_thread(state.grammars.compile, spec)
    except GrammarError as e:
        m.l(m.grammar_compiles, result="refused").inc()
        raise bad_request(str(e), e.param, "invalid_value") from None
    except Exception as e:  # the library's own failure on an odd schema: still the client's
        log.warning("compiling a grammar failed", exc_info=True)
        m.l(m.grammar_compiles, result="refused").inc()
        param = "tools" if spec.kind == "tool_call" else "response_format"
        raise bad_request(f"Constrained decoding cannot compile this schema: {e}", param,
                          "invalid_value") from None
    # (another request's compile may count in between: the figure is a close estimate)
    m.l(m.grammar_compiles, result="cached" if state.grammars.hits > hits else "compiled").inc()
    m.l(m.constrained, kind=spec.kind).inc()
    return grammar


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


async def _whole(choices: Choices, builders: list) -> web.Response:
    finishes: dict[int, Finish] = {}
    while len(finishes) < len(builders):
        i, event = await choices.get()
        if choices.jobs[i].first_out_at is None:
            choices.jobs[i].first_out_at = time.perf_counter()  # the handler has it
        if isinstance(event, Delta):
            builders[i].add(event)
        elif isinstance(event, Finish):
            finishes[i] = event
        else:
            raise event
    ordered = [finishes[i] for i in range(len(builders))]
    body = builders[0].whole(_total(ordered))
    if len(builders) > 1:
        body["choices"] = [b.whole(f)["choices"][0] for b, f in zip(builders, ordered)]
    return json_response(body, _cache_headers(choices.jobs[0]))


def _first_out(job: Job, metrics: BackendMetrics) -> None:
    """A stream's chunk is written: the first marks when its client had its first
    output (until then the disk writer holds off: Engine.answering)."""
    if job.first_out_at is not None:
        return
    job.first_out_at = time.perf_counter()
    if job.first_token_at is not None:
        metrics.l(metrics.send).observe(job.first_out_at - job.first_token_at)


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


async def _stream(
    request: web.Request, choices: Choices, builders: list, include_usage: bool,
    metrics: BackendMetrics,
) -> web.StreamResponse:
    # Wait for the first event before committing to a 200, so that an engine
    # failure before any output is still reported with a proper status code.
    i, event = await choices.get()
    if isinstance(event, APIError):
        raise event
    resp = web.StreamResponse(
        headers={**SSE_HEADERS, **_cache_headers(choices.jobs[0])}
    )
    finishes: dict[int, Finish] = {}
    try:
        await resp.prepare(request)
        for builder in builders:
            preamble = builder.first_chunk(include_usage)
            if preamble is not None:
                await resp.write(sse_data(preamble))
        while True:
            builder = builders[i]
            if isinstance(event, Delta):
                await resp.write(sse_data(builder.delta_chunk(event, include_usage)))
            elif isinstance(event, Finish):
                await resp.write(sse_data(builder.finish_chunk(event, include_usage)))
                finishes[i] = event
                if len(finishes) == len(builders):
                    total = _total([finishes[k] for k in range(len(builders))])
                    if include_usage:
                        await resp.write(sse_data(builder.usage_chunk(total)))
                    if request.headers.get(USAGE_HEADER):  # the proxy counts every team's tokens
                        await resp.write(usage_comment(total.completion_tokens))
                    break
            else:
                await resp.write(sse_data(event.body()))
                break
            _first_out(choices.jobs[i], metrics)
            i, event = await choices.get()
        await resp.write(SSE_DONE)
        await resp.write_eof()
    except ConnectionError:
        # The client went away between two events (before aiohttp cancelled this
        # handler): a disconnect, not a server error. _generate's finally frees the slot.
        request["client_gone"] = True
    return resp


# -- questions ------------------------------------------------------------------------


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt tokens a chat body renders to with this model's chat template, as
    `usage.prompt_tokens` of the same body would count them; nothing is generated. For
    the proxy's /v1/messages/count_tokens: only a backend has the tokenizer."""
    state = _state(request)
    _, body = await read_json(request)
    req = parse_chat(body)
    _check_model(state, req.model)
    count = await asyncio.to_thread(state.template.count, req)
    return json_response({"object": "token_count", "model": req.model, "prompt_tokens": count})


async def models(request: web.Request) -> web.Response:
    state = _state(request)
    return json_response({
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
    })


async def health(request: web.Request) -> web.Response:
    state = _state(request)
    lost = state.engine.lost  # the process is on its way out, to be restarted
    body = {
        "status": "gpu_failed" if lost else "ok",
        "backend_id": state.config.backend_id,
        "instance_id": state.instance_id,
        "pid": os.getpid(),
        "model": state.config.model_id,
        "uptime_s": round(time.time() - state.started, 1),
        "cache": state.store.stats(),
        "disk": state.disk.stats() if state.disk is not None else None,
        "device": state.device,
        "memory": accel.memory(),
        "engine": state.engine.snapshot(),
        "grammars": _grammar_stats(state),
        # A model that takes images: images run through its encoder, and those held.
        "vision": state.vision.snapshot() if state.vision is not None else None,
    }
    if lost:
        body["error"] = lost
    return json_response(body, status=503 if lost else 200)


def _grammar_stats(state: State) -> dict | None:
    """The compiled-grammar cache: how many are kept, and how often one was reused."""
    g = state.grammars
    if g is None:
        return None
    return {"cached": len(g), "capacity": g.capacity, "hits": g.hits, "misses": g.misses}


async def metrics(request: web.Request) -> web.Response:
    state = _state(request)
    return web.Response(body=state.metrics.render(), content_type="text/plain", charset="utf-8")


async def cache_entries(request: web.Request) -> web.Response:
    state = _state(request)
    entries = await state.engine.call(lambda: describe_entries(state.store))
    return json_response({"entries": entries})


_OPENAPI = orjson.dumps(openapi.spec("backend"))


async def openapi_json(request: web.Request) -> web.Response:
    return web.Response(body=_OPENAPI, content_type="application/json")


# -- the app --------------------------------------------------------------------------


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
    app.router.add_post(EMBEDDINGS_PATH, embeddings)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi_json)
    app.router.add_get("/debug/cache", cache_entries)
    return app

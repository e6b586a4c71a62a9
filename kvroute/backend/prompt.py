"""A request's prompt as the model's chat template renders it, and the prefix keys its
commits are advertised by.

The prompt's tokens come from the chat template (chat) or the tokenizer (completion).
Its chain is `prefix.request_chain` of the body, laid out as this template renders
tools and the system prompt (`prefix.Layout`, found at load by rendering probes). The
engine commits the prompt at checkpoints and advertises each commit by the keys of what
it holds: the whole chain at the prompt's end; the keys of the shared header and of the
last whole message at the positions where the template ends them (models whose caches
cannot be cut keep those); after a normal finish, the next turn's chain (`extend`); for
a prefill cut short, the keys of the messages it holds whole (`partial`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from kvroute.api.errors import bad_request
from kvroute.core import prefix
from kvroute.core.images import ImageError

from .image_prompt import ImagePrompt, Pixels
from .requests import ChatRequest, CompletionRequest
from .tokenize import PrefixTokenizer

log = logging.getLogger("kvroute.backend")


@dataclass
class Prompt:
    """A request's prompt tokens and the prefix keys its commits are advertised by."""

    tokens: list[int]
    chain: list[int]  # the request's prefix keys
    # Token positions worth a store entry -> the prefix keys of what they hold; always
    # the prompt's last position but one.
    checkpoints: dict[int, list[int]]
    # The keys of the next turn once the reply (text, tool calls) is known.
    extend: Callable[[str, list[dict]], list[int]]
    # (token end, keys) of the most leading messages held whole within n tokens.
    partial: Callable[[int], tuple[int, list[int]]] | None = None
    tools: list[dict] | None = None  # as the template rendered them: calls of these are parsed
    images: list[Pixels] = field(default_factory=list)  # the encoder's input, one per image


class Template:
    """The model's tokenizer and chat template, and what the backend learns of them:
    where the template renders the tools and the system prompt (its layout, which
    every chain follows and the record tells the proxies), whether it drops the
    reasoning of past replies, and the canonical request bytes per prompt token
    (proxies have no tokenizer: they turn request bytes into tokens with it)."""

    def __init__(self, tokenizer: Any, *, secret: str, block_bytes: int, checkpointing: bool,
                 layout: prefix.Layout | None = None, drops_reasoning: str | None = None,
                 images: ImagePrompt | None = None):
        self.tokenizer = tokenizer
        self.images = images  # how the model takes images; None: it takes none
        self.secret, self.block_bytes = secret, block_bytes
        self.checkpointing = checkpointing  # the model keeps checkpoints mid-prompt (engine.py)
        self.layout = chat_layout(tokenizer) if layout is None else layout
        self.drops_reasoning = (reasoning_marker(tokenizer) if drops_reasoning is None
                                else drops_reasoning)
        self.bytes_per_token = 0.0  # measured, see _calibrate
        self.tokens = PrefixTokenizer(tokenizer)

    # -- what a handler asks (tokenizing and hashing: off the event loop) --------------

    def prompt(self, req: ChatRequest | CompletionRequest, body: dict, scope: str | None,
               pairs: list[tuple[int, int]] | None = None) -> Prompt:
        """The request's prompt; `pairs`: its `keys`, where the caller has them already."""
        if not isinstance(req, ChatRequest):
            tokens = req.prompt if isinstance(req.prompt, list) else self.tokenizer.encode(req.prompt)
            return self.chains(req, body, scope, list(tokens), {}, pairs)
        pixels = self._pixels(req)
        req.image_texts = [p.text for p in pixels]
        tokens, marks, order = self._chat_tokens(req)
        prompt = self.chains(req, body, scope, tokens, marks, pairs)
        if order:
            assert self.images is not None  # _pixels refused images otherwise
            try:
                prompt.tokens = self.images.substitute(tokens, [pixels[k] for k in order])
            except ImageError as exc:
                raise bad_request(f"Invalid image prompt: {exc}.", param="messages",
                                  code="invalid_image")
            prompt.images = list({pixels[k].sha256: pixels[k] for k in order}.values())
        return prompt

    def _pixels(self, req: ChatRequest, decode: bool = True) -> list[Pixels]:
        """The request's images decoded for the encoder (or, without `decode`, only
        their texts and token counts); a 400 for a model without images or an image
        that cannot be read."""
        if not req.images:
            return []
        if self.images is None:
            raise bad_request(f"The model '{req.model}' does not take images; send text only "
                              "or use a vision-language model.", param="messages",
                              code="images_unsupported")
        out = []
        for k, url in enumerate(req.images):
            try:
                out.append(self.images.pixels(url, decode))
            except ImageError as exc:
                raise bad_request(f"Invalid image (the request's image {k + 1}): {exc}.",
                                  param="messages", code="invalid_image")
        return out

    def count(self, req: ChatRequest) -> int:
        """The prompt tokens a chat body renders to, as `usage.prompt_tokens` counts them."""
        req.image_texts = [p.text for p in self._pixels(req, decode=False)]
        return len(self._chat_prompt(req))

    def keys(self, req: ChatRequest | CompletionRequest, body: dict,
             scope: str | None) -> list[tuple[int, int]]:
        """The request's prefix keys, each with the end offset of what it hashes
        (`prefix.request_chain`): known before its tokens."""
        try:
            return prefix.request_chain(self._kind(req), body, **self._key_args(req, scope))
        except ValueError as exc:  # what the template ignores but the key scheme refuses
            raise bad_request(f"Invalid request: {exc}.")

    def _kind(self, req: ChatRequest | CompletionRequest) -> str:
        return "chat" if isinstance(req, ChatRequest) else "completion"

    def _key_args(self, req: ChatRequest | CompletionRequest, scope: str | None) -> dict:
        return {"model": req.model, "salt": prefix.make_salt(self.secret, scope),
                "block_bytes": self.block_bytes, "layout": self.layout}

    def chains(self, req: ChatRequest | CompletionRequest, body: dict, scope: str | None,
               tokens: list[int], marks: dict[int, int],
               pairs: list[tuple[int, int]] | None = None) -> Prompt:
        """The prompt `tokens` with the request's prefix keys (`pairs`, or found
        here), the keys of each checkpoint (`marks`: token position -> the number of
        messages it ends) and the functions giving the next turn's keys and a
        cut-short prefill's."""
        kind, kw = self._kind(req), self._key_args(req, scope)

        def chain_of(body_: dict) -> list[int]:
            return [k for k, _ in prefix.request_chain(kind, body_, **kw)]

        if pairs is None:
            pairs = self.keys(req, body, scope)
        chain = [k for k, _ in pairs]
        by_ids = isinstance(req, CompletionRequest) and isinstance(req.prompt, list)
        if not by_ids:  # token ids' bytes say nothing of text's bytes per token
            self._calibrate(pairs, len(tokens))
        checkpoints = {len(tokens) - 1: chain}
        for position, n in marks.items():  # chat only
            messages = body["messages"]
            checkpoints[position] = chain if n == len(messages) else chain_of(
                {**body, "messages": messages[:n]})
        if isinstance(req, CompletionRequest):
            # One prompt string, one segment: no key names a part of it. Token ids: the
            # reply's own ids are not what a client sends back (it gets text), so the
            # answer's entry is advertised by the prompt's keys.
            if by_ids:
                return Prompt(tokens, chain, checkpoints, lambda _text, _calls: chain)
            return Prompt(tokens, chain, checkpoints,
                          lambda text, _calls: chain_of({"prompt": req.prompt + text}))
        return Prompt(tokens, chain, checkpoints, self._next_turn(body, chain, chain_of),
                      self._partial(req, body, tokens, chain_of), req.tools)

    # -- chat ------------------------------------------------------------------------

    def _render(self, messages: list[dict], tools: list[dict] | None, generation: bool,
                tokenize: bool = True, image_texts: list[str] | None = None) -> Any:
        out = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=generation, tokenize=tokenize)
        if tokenize:
            return list(out)
        return self._images(out, image_texts or [])[0]

    def _images(self, text: str, image_texts: list[str]) -> tuple[str, list[int]]:
        """The rendered `text` with each image's text where the template put it, and the
        order of the request's images in it (render errors are the request's: a 400)."""
        if self.images is None:
            return text, []
        try:
            return self.images.render(text, image_texts)
        except ImageError as exc:
            raise bad_request(f"Invalid image prompt: {exc}.", param="messages",
                              code="invalid_image")

    def _chat_text(self, req: ChatRequest) -> tuple[str, list[int]]:
        """The rendered prompt, and the request's images in the order it shows them."""
        if req.images and self.images is None:
            self._pixels(req)  # refuses
        try:
            text = self.tokenizer.apply_chat_template(
                req.messages, tools=req.tools, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # template errors are the request's fault (bad role order, ...)
            raise bad_request(f"The messages could not be rendered by the chat template: {exc}.",
                              param="messages")
        return self._images(text, req.image_texts)

    def _chat_prompt(self, req: ChatRequest) -> list[int]:
        # As apply_chat_template(tokenize=True) tokenizes its rendering, reusing the
        # tokens of an earlier prompt this one extends (tokenize.py).
        return self.tokens.encode(self._chat_text(req)[0])

    def _chat_tokens(self, req: ChatRequest) -> tuple[list[int], dict[int, int], list[int]]:
        """The prompt (each image still its run of image tokens), {token position:
        number of messages it ends} for the checkpoints a model with untrimmable
        caches keeps (see engine.py), and the order of the images in the prompt."""
        text, order = self._chat_text(req)
        prompt = self.tokens.encode(text)
        marks: dict[int, int] = {}
        if self.checkpointing:
            for n in {_header_messages(req.messages), len(req.messages)}:
                position = self._position(prompt, text, req.messages[:n], req.tools,
                                          req.image_texts)
                if position:
                    marks[position] = n
        return prompt, marks, order

    def _template_tokens(self, text: str) -> list[int]:
        # As apply_chat_template tokenizes: the template writes BOS itself.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _position(self, prompt: list[int], text: str, messages: list[dict],
                  tools: list[dict] | None, image_texts: list[str] | None = None) -> int | None:
        """Where the rendering of `messages` ends inside `prompt` (rendered as
        `text`), or None where the template renders that part differently or refuses
        it. Only a position is chosen here: the checkpoint holds the prompt's own
        tokens up to it, so a slightly off position costs a hit, never correctness."""
        if not messages:
            return None
        try:
            head = self._render(messages, tools, False, tokenize=False, image_texts=image_texts)
        except Exception:
            return None
        if not (0 < len(head) < len(text) and text.startswith(head)):
            return None
        if len(head) <= len(text) // 2:
            tokens = self._template_tokens(head)
            n = len(tokens)
            return n if n < len(prompt) and prompt[:n] == tokens else None
        # Tokenize the shorter side: the rest (the generation prompt, for the last
        # message) starts with a special token in chat templates, where tokenizers
        # split before anything else, so its tokens end the prompt's.
        tail = self._template_tokens(text[len(head):])
        n = len(prompt) - len(tail)
        return n if 0 < n and prompt[n:] == tail else None

    def _next_turn(self, body: dict, chain: list[int],
                   chain_of: Callable[[dict], list[int]]) -> Callable[[str, list[dict]], list[int]]:
        think = self.drops_reasoning

        def extend(text: str, tool_calls: list[dict]) -> list[int]:
            if think and think in text:
                # The template renders past replies without their reasoning: next turn's
                # prompt will not extend what this sequence holds past the prompt.
                return chain
            # The assistant turn exactly as an OpenAI client will send it back next time.
            reply: dict = {"role": "assistant", "content": text or None}
            if tool_calls:
                reply["tool_calls"] = tool_calls
            nxt = chain_of({**body, "messages": body["messages"] + [reply]})
            # A template that moves the tools or the system prompt past the reply (Mistral:
            # into the last user turn) renders the next turn differently from what this
            # sequence holds: its chain no longer extends the request's.
            return nxt if nxt[:len(chain)] == chain else chain

        return extend

    def _partial(self, req: ChatRequest, body: dict, prompt: list[int],
                 chain_of: Callable[[dict], list[int]]) -> Callable[[int], tuple[int, list[int]]]:
        def partial(n_tokens: int) -> tuple[int, list[int]]:
            """(token end, keys) of the most leading messages whose rendering ends within
            the first n_tokens: what a prefill cut short (a client gone mid-prompt) can be
            found by. Positions grow with the messages, so a binary search renders a few
            heads only; a head the template renders otherwise counts as too long (fewer
            keys, never a wrong one)."""
            messages = body["messages"]
            text = self._render(req.messages, req.tools, True, tokenize=False,
                                image_texts=req.image_texts)
            lo, hi, best = 1, len(messages) - 1, (0, [])
            while lo <= hi:
                n = (lo + hi) // 2
                position = self._position(prompt, text, req.messages[:n], req.tools,
                                          req.image_texts)
                if position is not None and position <= n_tokens:
                    best, lo = (position, n), n + 1
                else:
                    hi = n - 1
            if not best[0]:
                return 0, []
            position, n = best
            return position, chain_of({**body, "messages": messages[:n]})

        return partial

    def _calibrate(self, pairs: list[tuple[int, int]], prompt_tokens: int) -> None:
        """Measure canonical-stream bytes per prompt token: proxies have no tokenizer
        and turn request bytes into tokens with it (published in the record)."""
        if pairs and prompt_tokens > 0:
            ratio = pairs[-1][1] / prompt_tokens
            old = self.bytes_per_token
            self.bytes_per_token = ratio if not old else 0.9 * old + 0.1 * ratio


def _header_messages(messages: list[dict]) -> int:
    """How many leading messages form the shared header (system prompts)."""
    n = 0
    while n < len(messages) and messages[n].get("role") in ("system", "developer"):
        n += 1
    return n


# -- what a template is, found at load --------------------------------------------------


def chat_layout(tokenizer: Any) -> prefix.Layout:
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


def reasoning_marker(tokenizer: Any) -> str:
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

"""Grammar-constrained decoding: what an answer must be, compiled once, masked per row.

A request may ask for any JSON object, JSON valid against a schema, or a call of
one of its tools (a forced tool choice). `Grammars` compiles each such `GrammarSpec`
with llguidance (docs/DESIGN.md, "Constrained decoding", says why that library)
against the model's tokenizer and keeps the result in a bounded LRU keyed by a hash
of the spec; a spec it cannot compile raises `GrammarError`, whose message names the
unsupported part.

A `GrammarMatcher` is one sequence's state. mlx-lm's `BatchGenerator` calls each
row's logits processors one row at a time, all of them before it samples any row,
with the row's tokens so far (prompt and reply) and its logits. So a matcher is
itself a logits processor: it consumes the token the previous step sampled, and
masks the logits to what may follow. With a `MaskBatch` the work splits: the
processor only consumes and queues the row, and the row's sampler (`sampler`), which
mlx-lm calls after every processor of the step, fills the masks of all queued rows
at once on llguidance's threads and masks before sampling. Constrained and free rows
share one batch either way. When the grammar is complete its mask allows only the
end-of-sequence tokens, so the sequence ends as a normal stop.
"""

from __future__ import annotations

import collections
import copy
import json
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import llguidance
import mlx.core as mx
import numpy as np
import orjson
import xxhash

# Whitespace a JSON answer may hold between two tokens of its syntax: what JSON
# printers write (a space, or one line break and its indentation), never runs of
# blank lines or spaces, on which weak models loop until max_tokens.
WHITESPACE = r"(?:\x20|\r?\n[\x20\t]{0,32})?"
# A forced tool call is one line of JSON, as tool-call formats write them: at most a
# space between two tokens (a weak model otherwise spends its max_tokens on up to 33
# characters of indentation at every comma), and one line break around the call.
TOOL_WHITESPACE = r"\x20?"
AROUND_CALL = r"(?:\x20|\r?\n)?"
CACHE_SIZE = 128  # compiled grammars kept per tokenizer
_JSON_OPTIONS = {"whitespace_pattern": WHITESPACE, "lenient": False}
_TOOL_OPTIONS = {"whitespace_pattern": TOOL_WHITESPACE, "lenient": False}


class GrammarError(ValueError):
    """A spec that cannot be compiled; the API answers it with a 400 naming `param`."""

    def __init__(self, message: str, param: str = "response_format"):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GrammarSpec:
    """What an answer must be. Build one with `json_object`, `json_schema` or
    `tool_call`; `key` identifies it in the cache."""

    kind: str  # "json_object", "json_schema", "tool_call"
    schema: Any = None  # json_schema: the schema
    tools: tuple[tuple[str, str], ...] = ()  # tool_call: (name, parameters as JSON) each
    parallel: bool = False  # tool_call: one call or more
    key: str = field(default="", compare=False)


def json_object() -> GrammarSpec:
    """Any JSON object (`response_format: {"type": "json_object"}`)."""
    return _keyed(GrammarSpec("json_object"))


def json_schema(schema: Any) -> GrammarSpec:
    """JSON valid against `schema` (`response_format: {"type": "json_schema"}`)."""
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("The JSON schema must be an object.")
    return _keyed(GrammarSpec("json_schema", schema=schema))


def tool_call(tools: list[dict], name: str | None = None, parallel: bool = False) -> GrammarSpec:
    """A call of one of `tools` (OpenAI tool or function definitions), or of the tool
    `name` alone, in the model's own tool-call format, its arguments valid against
    the tool's parameters; `parallel`: one call or more."""
    defs = []
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise GrammarError("Each tool needs a function with a name.", param="tools")
        params = fn.get("parameters") or {"type": "object"}
        defs.append((fn["name"], orjson.dumps(params).decode()))
    if name is not None:
        defs = [d for d in defs if d[0] == name]
        if not defs:
            raise GrammarError(f"tool_choice names the function {name!r}, which is not among "
                               "the request's tools.", param="tool_choice")
    if not defs:
        raise GrammarError("A forced tool choice needs at least one tool.", param="tool_choice")
    return _keyed(GrammarSpec("tool_call", tools=tuple(defs), parallel=parallel))


def _keyed(spec: GrammarSpec) -> GrammarSpec:
    # Property order is part of the grammar (answers keep the schema's order), so the
    # key hashes the schema as given, not with sorted keys.
    raw = orjson.dumps([spec.kind, spec.schema, spec.tools, spec.parallel])
    return GrammarSpec(spec.kind, spec.schema, spec.tools, spec.parallel,
                       key=xxhash.xxh3_128_hexdigest(raw))


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes a tool call, from mlx-lm's tool parser for its template."""

    parser: str  # mlx-lm's tool parser module, e.g. "json_tools"
    start: str
    end: str
    args_marker: bool = False  # mistral: `name[ARGS]{...}` rather than a JSON list


# The formats whose calls have a grammar here: JSON between markers. Others (XML-like
# parameters, Python calls) answer a forced tool choice with a GrammarError.
TOOL_FORMATS = ("json_tools", "mistral")


class Grammars:
    """The grammars of one tokenizer: compiled once per spec and kept in a bounded
    LRU. Thread-safe: handlers compile (llguidance releases the GIL meanwhile) and
    the engine thread takes matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None, capacity: int = CACHE_SIZE):
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            raise GrammarError("Constrained decoding needs a fast (tokenizers) tokenizer; "
                               "this model's is not one.")
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
        self.eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [hf.eos_token_id])
        size = len(hf)
        self.vocab_size = max(vocab_size or size, size)
        self.lltok = llguidance.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size,
                                            eos_token=self.eos)
        self.tokenizer = tokenizer
        self.tool_format = _tool_format(tokenizer)
        self.capacity = capacity
        self.hits = self.misses = 0
        self._cache: collections.OrderedDict[str, Grammar] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._cache)

    def compile(self, spec: GrammarSpec) -> Grammar:
        """The compiled grammar of `spec`, from the cache when it is there."""
        with self._lock:
            if (found := self._cache.get(spec.key)) is not None:
                self._cache.move_to_end(spec.key)
                self.hits += 1
                return found
            self.misses += 1
        grammar = self._build(spec)  # outside the lock: one slow schema blocks no other
        with self._lock:
            self._cache[spec.key] = grammar
            self._cache.move_to_end(spec.key)
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return grammar

    def _build(self, spec: GrammarSpec) -> Grammar:
        if spec.kind == "json_object":
            source = _from_schema({"type": "object"})
        elif spec.kind == "json_schema":
            source = _from_schema(spec.schema)
        elif spec.kind == "tool_call":
            source = llguidance.LLMatcher.grammar_from_lark(self._tool_lark(spec))
        else:
            raise GrammarError(f"Unknown grammar kind {spec.kind!r}.")
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, self.lltok)
        param = "tools" if spec.kind == "tool_call" else "response_format"
        if failed:
            raise GrammarError(_explain(messages[0], spec), param=param)
        proto = llguidance.LLMatcher(self.lltok, source, log_level=0)
        if proto.is_error():
            raise GrammarError(_explain(proto.get_error(), spec), param=param)
        probe = proto.deep_copy()  # once per spec: compiled grammars are cached
        probe.compute_bitmask()
        if probe.is_error():
            # It compiles but nothing can start an answer: e.g. a $ref that only refers
            # to itself. Unrefused, the answer would be empty text, silently not JSON.
            raise GrammarError("No answer can satisfy this schema: it admits no value "
                               "(for example a $ref that only refers to itself).", param=param)
        return Grammar(spec.key, source, proto, self.vocab_size, self.eos)

    def _tool_lark(self, spec: GrammarSpec) -> str:
        fmt = self.tool_format
        if fmt is None or fmt.parser not in TOOL_FORMATS:
            found = fmt.parser if fmt else "none"
            raise GrammarError(
                f"A forced tool choice is not supported for this model: its tool-call format "
                f"({found}) has no grammar here; supported: {', '.join(TOOL_FORMATS)}.",
                param="tool_choice")
        tools = [(name, json.loads(params)) for name, params in spec.tools]
        start = self._marker(fmt.start)
        if fmt.parser == "mistral" and not fmt.args_marker:
            # Older Mistral templates: [TOOL_CALLS][{"name": ..., "arguments": ...}, ...]
            calls = {"type": "array", "items": {"anyOf": [_call_object(n, p) for n, p in tools]},
                     "minItems": 1, **({} if spec.parallel else {"maxItems": 1})}
            return f"start: {start} {_embedded(calls)}"
        choice = " | ".join(f"c{i}" for i in range(len(tools)))
        if fmt.parser == "mistral":  # [TOOL_CALLS]name[ARGS]{...}, each call so
            rules = [f"c{i}: {_quote(n)} {self._marker('[ARGS]')} {_embedded(p)}"
                     for i, (n, p) in enumerate(tools)]
            lines = [f"call: {start} ({choice})", *rules]
            between = ""
        else:  # json_tools: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
            rules = [f"c{i}: {_embedded(_call_object(n, p))}"
                     for i, (n, p) in enumerate(tools)]
            lines = [f"call: {start} WS ({choice}) WS {self._marker(fmt.end)}", *rules,
                     f"WS: /{AROUND_CALL}/"]
            between = "WS "
        top = f"start: call ({between}call)*" if spec.parallel else "start: call"
        return "\n".join([top, *lines])

    def _marker(self, text: str) -> str:
        """`text` as Lark: a special token by id (llguidance matches special tokens
        only so; the model writes the marker as that token), the rest as a string."""
        tok = self.tokenizer
        ids = tok.encode(text, add_special_tokens=False) if text else []
        parts, run = [], []
        for i in [*ids, None]:
            if i is not None and not self.lltok.is_special_token(i):
                run.append(i)
                continue
            if run:
                parts.append(_quote(tok.decode(run)))
                run = []
            if i is not None:
                parts.append(f"<[{i}]>")
        return " ".join(parts) or '""'


@dataclass
class Grammar:
    """A compiled grammar: a matcher prototype that each sequence copies."""

    key: str
    source: str
    proto: Any  # llguidance.LLMatcher, never advanced
    vocab_size: int
    eos: list[int]

    def matcher(self, batch: MaskBatch | None = None) -> GrammarMatcher:
        return GrammarMatcher(self, batch)


class GrammarMatcher:
    """One sequence's place in its grammar, and mlx-lm's logits processor for it.

    mlx-lm calls it once per decode step with the row's tokens (prompt and reply so
    far; the first call's last token is the prompt's) and logits. It consumes the
    tokens added since its last call, then masks; with a `MaskBatch` it only queues
    the row, and `sampler` masks after the whole batch's masks are filled at once."""

    def __init__(self, grammar: Grammar, batch: MaskBatch | None = None):
        self.grammar = grammar
        self.batch = batch
        self._m = grammar.proto.deep_copy()
        self._seen: int | None = None  # tokens of the row already accounted for
        self._row = np.zeros((1, (grammar.vocab_size + 31) // 32), dtype=np.int32)
        self.error: str | None = None  # why the matcher stopped early, if it did

    @property
    def done(self) -> bool:
        """The answer is complete: only an end-of-sequence token may follow."""
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        """The answer so far is a whole one (it may still go on)."""
        return self._m.is_accepting()

    def advance(self, token: int) -> bool:
        """Consume a sampled token; False (and `error` set) when the grammar refuses it."""
        if token in self.grammar.eos or self.error is not None:
            return self.error is None
        if not self._m.consume_token(token):
            self.error = self._m.get_error() or f"token {token} does not fit the grammar"
            return False
        return True

    def allowed(self) -> np.ndarray:
        """The current mask: one bit per token id (int32 words, token 0 in bit 0)."""
        self.fill(self._row, 0)
        return self._row[0]

    def live(self) -> Any:
        """The library's matcher while it can still compute masks, else None."""
        if self.error is None and self._m.is_error():
            self.error = self._m.get_error()
        return self._m if self.error is None else None

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Write the mask into `bitmask[row]`. After an error only end-of-sequence
        tokens are allowed, so the sequence ends at once."""
        if (m := self.live()) is not None:
            target = bitmask[row]
            m.unsafe_compute_mask_ptr(target.ctypes.data, target.nbytes)
            return
        words = bitmask[row].view(np.uint32)
        words[:] = 0
        for t in self.grammar.eos:
            words[t // 32] |= np.uint32(1 << (t % 32))

    def _new_tokens(self, tokens: mx.array) -> mx.array | None:
        """The row's tokens added since the last call (lazy; None on the first call,
        whose tokens are the prompt)."""
        n = tokens.shape[0]
        seen, self._seen = self._seen, n
        return None if seen is None else tokens[seen:]

    def consume(self, new: mx.array | None) -> None:
        if new is not None:
            for t in new.tolist():
                self.advance(t)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        new = self._new_tokens(tokens)
        if self.batch is not None:
            # Read later, with every queued row's in one evaluation.
            self.batch.queue(self, new)
            return logits
        self.consume(new)
        mx.async_eval(logits)  # the model's step runs while the mask is computed
        return apply_bitmask(logits, self.allowed()[None])

    def sampler(self, inner: Callable[[mx.array], mx.array] | None = None) -> Callable:
        """This row's sampler when masks are filled by a `MaskBatch`: mask, then
        sample with `inner` (the request's own sampler; None: greedy)."""
        if self.batch is None:
            raise ValueError("sampler() is for matchers filled by a MaskBatch")

        def sample(logprobs: mx.array) -> mx.array:
            masked = apply_bitmask(logprobs, self.batch.mask(self, logprobs)[None])
            if inner is None:
                return mx.argmax(masked, axis=-1)
            return inner(masked - mx.logsumexp(masked, axis=-1, keepdims=True))

        return sample


class MaskBatch:
    """The masks of one decode step's constrained rows, filled together: queued by
    the rows' processors, filled on the first sampler call of the step, on
    llguidance's threads (the GIL released) while the model's step runs."""

    def __init__(self, vocab_size: int, threads: int | None = None):
        self.words = (vocab_size + 31) // 32
        self.executor = llguidance.LLExecutor(threads)
        self._queued: dict[int, tuple[GrammarMatcher, mx.array | None]] = {}
        self._rows: dict[int, int] = {}  # id(matcher) -> its row in the filled bitmask
        self._bitmask = np.zeros((0, self.words), dtype=np.int32)

    def queue(self, matcher: GrammarMatcher, new: mx.array | None = None) -> None:
        """Queue a row for this step's fill, with its tokens not yet consumed."""
        if self._rows:  # a new step began: last step's masks are spent
            self._rows.clear()
        self._queued[id(matcher)] = (matcher, new)

    def mask(self, matcher: GrammarMatcher, pending: mx.array | None = None) -> np.ndarray:
        """`matcher`'s mask for this step; the first call fills every queued row
        (`pending`: the step's arrays, set computing meanwhile)."""
        if id(matcher) not in self._rows:
            if pending is not None:
                mx.async_eval(pending)
            self._fill()
        if id(matcher) not in self._rows:  # not queued this step: alone
            return matcher.allowed()
        return self._bitmask[self._rows[id(matcher)]]

    def _fill(self) -> None:
        queued = list(self._queued.values())
        self._queued.clear()
        if not queued:
            return
        news = [new for _, new in queued if new is not None]
        mx.eval(news)  # every row's sampled token, in one evaluation
        matchers = [m for m, _ in queued]
        for m, new in queued:
            m.consume(new)
        if self._bitmask.shape[0] < len(matchers):
            self._bitmask = np.zeros((len(matchers), self.words), dtype=np.int32)
        self._rows = {id(m): i for i, m in enumerate(matchers)}
        live = [(lm, i) for i, m in enumerate(matchers) if (lm := m.live()) is not None]
        if live:
            self.executor.unsafe_compute_mask_ptr(live, self._bitmask.ctypes.data,
                                                  self.words * 4, self._bitmask.shape[0])
        for i, m in enumerate(matchers):
            if m.error is not None:  # only end-of-sequence
                m.fill(self._bitmask, i)


def apply_bitmask(logits: mx.array, bitmask: np.ndarray) -> mx.array:
    """`logits` (rows, vocab) with -inf where the int32 `bitmask` (rows, words) has
    a 0 bit. Only the mask crosses from host memory; the logits stay where they are."""
    n = logits.shape[-1]
    bits = np.unpackbits(bitmask.view(np.uint8), axis=-1, bitorder="little")
    if bits.shape[-1] < n:  # logits wider than the tokenizer: the rest is never allowed
        bits = np.pad(bits, ((0, 0), (0, n - bits.shape[-1])))
    return mx.where(mx.array(bits[:, :n].astype(bool)), logits, -mx.inf)


def _from_schema(schema: Any) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"The JSON schema is not valid JSON: {e}") from None


def _embedded(schema: Any) -> str:
    """A tool call's schema as a Lark `%json` block, on one line (an embedded schema
    takes its options from its own "x-guidance" key)."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise GrammarError("A tool's parameters must be a JSON schema object.", param="tools")
    return "%json " + json.dumps({**schema, "x-guidance": _TOOL_OPTIONS}, ensure_ascii=False)


def _call_object(name: str, params: Any) -> dict:
    """A call as one JSON object, `{"name": ..., "arguments": {...}}`, in that order."""
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def _quote(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _tool_format(tokenizer: Any) -> ToolFormat | None:
    parser = getattr(tokenizer, "tool_parser", None)
    if parser is None or not getattr(tokenizer, "tool_call_start", None):
        return None
    name = getattr(parser, "__module__", "").rpartition(".")[2]
    template = getattr(getattr(tokenizer, "_tokenizer", tokenizer), "chat_template", None) or ""
    return ToolFormat(name, tokenizer.tool_call_start, tokenizer.tool_call_end or "",
                      args_marker=name == "mistral" and "[ARGS]" in str(template))


_KEYS = re.compile(r'Unimplemented keys: \[(.*?)\]')


def _explain(message: str, spec: GrammarSpec) -> str:
    """llguidance's reason, with where in the schema the unsupported keys are."""
    first = message.strip().split("\n<state>")[0].strip()
    where = ""
    if (m := _KEYS.search(first)) and spec.kind == "json_schema":
        keys = {k.strip().strip('"') for k in m.group(1).split(",")}
        paths = [p for p, k in _paths(spec.schema, "#") if k in keys]
        if paths:
            where = f" (at {', '.join(paths[:5])})"
    what = "the tools' parameters" if spec.kind == "tool_call" else "the JSON schema"
    return f"Constrained decoding cannot use {what}: {first}{where}"


def _paths(node: Any, at: str) -> Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield f"{at}/{k}", k
            yield from _paths(v, f"{at}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, f"{at}/{i}")

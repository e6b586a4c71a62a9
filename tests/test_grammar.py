"""Grammar-constrained decoding (backend/grammar.py) with the demo model's real tokenizer
and weights, run through mlx-lm's own BatchGenerator: masks allow exactly the valid
continuations, decoding under the mask yields JSON valid against each schema of a
feature suite (and tool calls that mlx-lm's own parser reads back), constrained and
free rows share a batch, the cache is bounded, and schemas that cannot be compiled
fail with a GrammarError that names the unsupported part."""

from __future__ import annotations

import json

import jsonschema_rs
import mlx.core as mx
import numpy as np
import pydantic
import pytest
from mlx_lm import load
from mlx_lm.generate import BatchGenerator
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.tool_parsers import json_tools, mistral
from openai.lib._pydantic import to_strict_json_schema
from tokenizers import AddedToken

from kvroute.backend import grammar
from kvroute.backend.grammar import GrammarError, Grammars, MaskBatch
from kvroute.devtools import demo_model

SUITE: dict[str, dict] = {
    "nested_object": {
        "type": "object",
        "properties": {"name": {"type": "string"},
                       "address": {"type": "object",
                                   "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
                                   "required": ["street", "city"]}},
        "required": ["name", "address"],
    },
    "array_min_max": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                "minItems": 2, "maxItems": 4},
                       "scores": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
        "required": ["tags", "scores"], "additionalProperties": False,
    },
    "enum_const": {
        "type": "object",
        "properties": {"status": {"enum": ["active", "inactive", "pending"]},
                       "level": {"type": "integer", "enum": [1, 2, 3]},
                       "kind": {"const": "person"}},
        "required": ["status", "level", "kind"], "additionalProperties": False,
    },
    "anyOf": {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "number"},
                                           {"type": "null"}]}},
        "required": ["value"], "additionalProperties": False,
    },
    "oneOf_discriminated": {
        "type": "object",
        "properties": {"shape": {"oneOf": [
            {"type": "object", "properties": {"type": {"const": "circle"}, "r": {"type": "number"}},
             "required": ["type", "r"], "additionalProperties": False},
            {"type": "object", "properties": {"type": {"const": "square"}, "side": {"type": "number"}},
             "required": ["type", "side"], "additionalProperties": False}]}},
        "required": ["shape"], "additionalProperties": False,
    },
    "optional_no_additional": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "note": {"type": "string", "maxLength": 20},
                       "flag": {"type": "boolean"}},
        "required": ["id"], "additionalProperties": False,
    },
    "ref_defs_recursive": {
        "$defs": {"Node": {"type": "object",
                           "properties": {"v": {"type": "integer"},
                                          "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"},
                                                   "maxItems": 2}},
                           "required": ["v", "kids"], "additionalProperties": False}},
        "$ref": "#/$defs/Node",
    },
    "formats": {
        "type": "object",
        "properties": {"when": {"type": "string", "format": "date-time"},
                       "email": {"type": "string", "format": "email"},
                       "id": {"type": "string", "format": "uuid"}},
        "required": ["when", "email", "id"], "additionalProperties": False,
    },
    "pattern_and_lengths": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                       "s": {"type": "string", "minLength": 3, "maxLength": 6}},
        "required": ["code", "s"], "additionalProperties": False,
    },
    "number_bounds": {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99},
                       "ratio": {"type": "number", "minimum": 0, "maximum": 1},
                       "temp": {"type": "number", "exclusiveMinimum": -10, "exclusiveMaximum": 50}},
        "required": ["age", "ratio", "temp"], "additionalProperties": False,
    },
    "map_of_integers": {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 3},
    "tuple": {
        "type": "object",
        "properties": {"pair": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}],
                                "items": False, "minItems": 2, "maxItems": 2}},
        "required": ["pair"], "additionalProperties": False,
    },
}

# What a model likes to write next, for rows that sample from random logits: the
# characters that close strings, arrays and objects (and the email's '@' and '.'),
# so that a random walk through the grammar ends. The mask decides what is valid.
CLOSERS = set('"}],@.')


class Step(pydantic.BaseModel):
    explanation: str
    output: str


class MathReasoning(pydantic.BaseModel):
    steps: list[Step] = pydantic.Field(max_length=2)
    final_answer: str
    confidence: float | None


@pytest.fixture(scope="module")
def demo(text_model):
    model, tok = load(str(text_model))
    return model, tok, Grammars(tok, model.args.vocab_size)


@pytest.fixture(scope="module")
def tool_demo(tool_model):
    model, tok = load(str(tool_model))
    return model, tok, Grammars(tok, model.args.vocab_size)


def closers_bias(tok, vocab_size: int) -> mx.array:
    bias = np.zeros(vocab_size, np.float32)
    for i in range(len(tok._tokenizer)):
        if CLOSERS & set(tok.decode([i])):
            bias[i] = 4.0
    bias[sorted(tok.eos_token_ids)] = 4.0
    return mx.array(bias)


def random_sampler(seed: int, bias: mx.array):
    """A 'model' that samples from random logits (plus `bias`) among allowed tokens."""
    key = mx.random.key(seed)

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, sub = mx.random.split(key)
        noise = 2.0 * mx.random.normal(logprobs.shape, key=sub) + bias
        return mx.argmax(mx.where(logprobs > -mx.inf, noise, -mx.inf), axis=-1)

    return sample


def model_sampler(seed: int):
    key = mx.random.key(seed)

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, sub = mx.random.split(key)
        return mx.random.categorical(logprobs, key=sub)

    return sample


def decode(model, tok, rows, max_tokens: int, batch: MaskBatch | None = None):
    """Run `rows` ((grammar or None, sampler or None) each) as one batch through
    mlx-lm's BatchGenerator; each row's (tokens, finish_reason, matcher)."""
    prompt = tok.apply_chat_template([{"role": "user", "content": "Answer in JSON."}],
                                     add_generation_prompt=True)
    eos = [[t] for t in sorted(tok.eos_token_ids)]
    gen = BatchGenerator(model, stop_tokens=eos, completion_batch_size=len(rows))
    matchers, samplers, processors = [], [], []
    for g, sampler in rows:
        m = g.matcher(batch) if g is not None else None
        matchers.append(m)
        processors.append([m] if m is not None else [])
        samplers.append(m.sampler(sampler) if m is not None and batch is not None else sampler)
    uids = gen.insert([prompt] * len(rows), max_tokens=[max_tokens] * len(rows),
                      samplers=samplers, logits_processors=processors)
    out = {u: [] for u in uids}
    done: dict[int, str] = {}
    try:
        while len(done) < len(uids):
            for r in gen.next()[1]:
                if r.token not in tok.eos_token_ids:
                    out[r.uid].append(r.token)
                if r.finish_reason is not None:
                    done[r.uid] = r.finish_reason
    finally:
        gen.close()
    return [(out[u], done[u], m) for u, m in zip(uids, matchers)]


def allowed_ids(m) -> set[int]:
    return set(np.nonzero(np.unpackbits(m.allowed().view(np.uint8), bitorder="little"))[0].tolist())


def validator(schema):
    return jsonschema_rs.validator_for(schema, validate_formats=True)


def assert_valid(schema, text: str) -> None:
    errors = [e for e in validator(schema).iter_errors(json.loads(text)) if not known_gap(e)]
    assert not errors, f"{text!r}: {[e.message for e in errors]}"


def known_gap(error) -> bool:
    """llguidance's date-time takes a leap second (:60) at any minute and February 29
    in any year (docs/DESIGN.md, "Constrained decoding"); the validator, only where
    leap rules allow. Such a value is valid once that one field is made ordinary."""
    if not isinstance(error.instance, str) or "date-time" not in error.message:
        return False
    plain = error.instance.replace(":60", ":59").replace("-02-29", "-02-28")
    return plain != error.instance and validator({"format": "date-time"}).is_valid(plain)


# -- masks ------------------------------------------------------------------------

def test_masks_allow_exactly_the_valid_continuations(demo):
    """At every step the mask is exactly the set of tokens that keep the text a
    prefix of a valid answer (found by trying every token of the vocabulary), and
    end-of-sequence only once the answer is whole. Once the rest of the answer is
    forced, llguidance allows only the rest's own tokenization (what the model
    would have been trained on) rather than every way of spelling it."""
    model, tok, grammars = demo
    answers = ['"red"', '"green"', '"blue"', '"brown"', "7", "71"]
    m = grammars.compile(grammar.json_schema({"enum": ["red", "green", "blue", "brown", 7, 71]})).matcher()
    eos = set(tok.eos_token_ids)
    texts = {i: tok.decode([i]) for i in range(len(tok._tokenizer)) if i not in eos}
    prefix = ""
    for target in ('"', "b", "r", "own", '"'):
        left = [a for a in answers if a.startswith(prefix) and a != prefix]
        if len(left) == 1 and prefix not in answers:
            want = {tok.encode(left[0][len(prefix):], add_special_tokens=False)[0]}
        else:
            want = {i for i, t in texts.items() if any(a.startswith(prefix + t) for a in left)}
        if prefix in answers:
            want |= eos
        assert allowed_ids(m) == want, prefix
        token = next(i for i, t in texts.items() if t == target)
        assert m.advance(token)
        prefix += target
    assert prefix == '"brown"' and m.done and m.accepting
    assert allowed_ids(m) == eos
    # "7" is whole but may go on ("71"): both end-of-sequence and "1" are allowed.
    m = grammars.compile(grammar.json_schema({"enum": [7, 71]})).matcher()
    assert m.advance(next(i for i, t in texts.items() if t == "7"))
    assert m.accepting and not m.done
    assert {texts.get(i, "<eos>") for i in allowed_ids(m)} == {"1", "<eos>"}


def test_a_refused_token_ends_the_row_and_says_why(demo):
    model, tok, grammars = demo
    m = grammars.compile(grammar.json_object()).matcher()
    assert not m.advance(tok.encode("]", add_special_tokens=False)[0])
    assert m.error
    assert allowed_ids(m) == set(tok.eos_token_ids)  # the sequence ends at once


def test_bitmask_applies_to_logits_without_a_round_trip(demo):
    model, tok, grammars = demo
    v = model.args.vocab_size
    m = grammars.compile(grammar.json_schema({"enum": ["red", "blue"]})).matcher()
    row = m.allowed()
    for dtype in (mx.float32, mx.bfloat16):
        logits = mx.random.normal((1, v + 11)).astype(dtype)  # logits wider than the tokenizer
        out = grammar.apply_bitmask(logits, row[None])
        assert out.dtype == dtype and out.shape == logits.shape
        finite = set(np.nonzero(np.isfinite(np.array(out.astype(mx.float32))[0]))[0].tolist())
        assert finite == allowed_ids(m)


# -- decoding through mlx-lm's BatchGenerator ----------------------------------------

@pytest.mark.parametrize("name", list(SUITE))
def test_decoding_under_the_mask_yields_schema_valid_json(demo, name):
    """Greedy and sampled rows of the real demo model, and rows sampling random
    logits, share one batch with a free row: every constrained row that ends, ends
    with a stop (the grammar's end-of-sequence) and valid JSON; the random rows all
    end; the free row still says exactly what the demo model says."""
    model, tok, grammars = demo
    schema = SUITE[name]
    g = grammars.compile(grammar.json_schema(schema))
    bias = closers_bias(tok, model.args.vocab_size)
    rows = [(g, None), (g, model_sampler(1)), (g, model_sampler(2)),
            *[(g, random_sampler(seed, bias)) for seed in range(4)], (None, None)]
    results = decode(model, tok, rows, max_tokens=400)
    free, _, _ = results[-1]
    assert tok.decode(free) == demo_model.DEMO_REPLY
    for i, (tokens, reason, m) in enumerate(results[:-1]):
        text = tok.decode(tokens)
        if reason == "length":
            # The demo model's own chains (digits counting up, its reply looping
            # inside a string) never close; the random rows must.
            assert i < 3, f"random row {i} did not end: {text[:200]!r}"
            assert m.error is None
            continue
        assert reason == "stop" and m.done or m.accepting, (reason, text)
        assert m.error is None
        assert_valid(schema, text)


def test_json_object_and_the_openai_sdk_parse_schema(demo):
    """`json_object` gives an object; the strict schema the OpenAI SDK sends for
    `.parse(response_format=Model)` gives JSON the pydantic model accepts."""
    model, tok, grammars = demo
    bias = closers_bias(tok, model.args.vocab_size)
    obj = grammars.compile(grammar.json_object())
    parse = grammars.compile(grammar.json_schema(to_strict_json_schema(MathReasoning)))
    rows = [(g, random_sampler(seed, bias)) for g in (obj, parse) for seed in range(4)]
    results = decode(model, tok, rows, max_tokens=400)
    for (tokens, reason, _), (g, _) in zip(results, rows):
        text = tok.decode(tokens)
        assert reason == "stop", text
        if g is obj:
            assert isinstance(json.loads(text), dict)
        else:
            MathReasoning.model_validate_json(text)


def test_batched_masks_decode_exactly_as_per_row_masks(demo):
    """A MaskBatch (every row's mask filled at once, applied in the row's sampler)
    gives the same tokens as each matcher masking its own logits."""
    model, tok, grammars = demo
    bias = closers_bias(tok, model.args.vocab_size)
    schemas = [SUITE["nested_object"], SUITE["number_bounds"], SUITE["ref_defs_recursive"]]
    gs = [grammars.compile(grammar.json_schema(s)) for s in schemas]

    def rows():
        return [*[(g, random_sampler(i, bias)) for i, g in enumerate(gs)], (gs[0], None), (None, None)]

    alone = decode(model, tok, rows(), max_tokens=200)
    batched = decode(model, tok, rows(), max_tokens=200, batch=MaskBatch(model.args.vocab_size, 2))
    assert [(t, r) for t, r, _ in alone] == [(t, r) for t, r, _ in batched]
    for (tokens, reason, _), schema in zip(alone, schemas):
        assert reason == "stop"
        assert_valid(schema, tok.decode(tokens))


# -- tool calls -------------------------------------------------------------------

# Strict schemas, two tools (harness.TOOLS is the demo model's one): what a grammar constrains.
STRICT_TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                        "unit": {"enum": ["C", "F"]}},
                       "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"], "additionalProperties": False}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in STRICT_TOOLS}


def parsed_calls(tok, text: str, parse) -> list[dict]:
    """The calls in `text`, read the way the backend's output parser reads them:
    between the tokenizer's markers, through mlx-lm's parser for the template."""
    calls, rest = [], text
    while tok.tool_call_start in rest:
        body = rest.split(tok.tool_call_start, 1)[1]
        body, _, rest = body.partition(tok.tool_call_end) if tok.tool_call_end else (body, "", "")
        found = parse(body, STRICT_TOOLS)
        calls += found if isinstance(found, list) else [found]
    return calls


def test_forced_tool_calls_are_valid_calls_of_the_named_tool(tool_demo):
    """The tool variant of the demo model, forced to call a tool ('required'), or one
    named tool, or one or more calls: what mlx-lm's json_tools parser reads back are
    calls of allowed tools whose arguments validate, ended as a stop."""
    model, tok, grammars = tool_demo
    bias = closers_bias(tok, model.args.vocab_size)
    specs = {"required": grammar.tool_call(STRICT_TOOLS),
             "named": grammar.tool_call(STRICT_TOOLS, name="add"),
             "parallel": grammar.tool_call(STRICT_TOOLS, parallel=True)}
    compiled = {k: grammars.compile(s) for k, s in specs.items()}
    rows = [(compiled[k], random_sampler(seed, bias)) for k in specs for seed in range(3)]
    # The model's own greedy choice under the mask (a tool without integers: the demo
    # model counts digits forever).
    weather = grammars.compile(grammar.tool_call(STRICT_TOOLS, name="get_weather"))
    rows += [(weather, None)]
    results = decode(model, tok, rows, max_tokens=300)
    for (tokens, reason, m), (g, _) in zip(results, rows):
        text = tok.decode(tokens)
        assert reason == "stop" and m.error is None, text
        assert text.startswith(tok.tool_call_start) and text.endswith(tok.tool_call_end)
        calls = parsed_calls(tok, text, json_tools.parse_tool_call)
        assert calls and (len(calls) == 1 or g is compiled["parallel"])
        for call in calls:
            named = {id(compiled["named"]): ["add"], id(weather): ["get_weather"]}
            assert call["name"] in named.get(id(g), PARAMS)
            assert validator(PARAMS[call["name"]]).is_valid(call["arguments"]), call


@pytest.fixture(scope="module", params=["name[ARGS]", "json list"])
def mistral_tokenizer(request, tmp_path_factory):
    """The demo tokenizer with Mistral's tool-call tokens and a template naming them,
    which mlx-lm reads as its 'mistral' tool parser: newer templates write each call
    as `[TOOL_CALLS]name[ARGS]{...}`, older ones `[TOOL_CALLS][{"name": ..., ...}]`."""
    tok = demo_model.train_tokenizer()
    tok.add_special_tokens([AddedToken("[TOOL_CALLS]", special=True), AddedToken("[ARGS]", special=True)])
    path = tmp_path_factory.mktemp("mistral-tok")
    demo_model.write_tokenizer(path, tok)
    config = json.loads((path / "tokenizer_config.json").read_text())
    form = "[TOOL_CALLS]name[ARGS]{arguments}" if request.param == "name[ARGS]" else "[TOOL_CALLS][calls]"
    config["chat_template"] = "{% for m in messages %}{{ m.content }}{% endfor %}{# " + form + " #}"
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(path), request.param == "name[ARGS]"


def test_mistral_tool_calls_follow_its_markers(mistral_tokenizer):
    tok, args_marker = mistral_tokenizer
    grammars = Grammars(tok)
    assert grammars.tool_format.parser == "mistral" and grammars.tool_format.args_marker == args_marker
    g = grammars.compile(grammar.tool_call(STRICT_TOOLS, parallel=True))
    bias = closers_bias(tok, grammars.vocab_size)
    for seed in range(4):
        m, sample = g.matcher(), random_sampler(seed, bias)
        tokens = []
        while len(tokens) < 300:
            # A processor's call as mlx-lm makes it: the row's tokens so far (a one-token
            # prompt, then the reply), and the logits to mask.
            logits = m(mx.array([0] + tokens), mx.zeros((1, grammars.vocab_size)))
            t = sample(logits).item()
            if t in tok.eos_token_ids:
                break
            tokens.append(t)
        text = tok.decode(tokens)
        assert m.accepting and m.error is None, text
        assert text.startswith("[TOOL_CALLS]")
        calls = mistral.parse_tool_call(text.removeprefix("[TOOL_CALLS]"), STRICT_TOOLS)
        calls = calls if isinstance(calls, list) else [calls]
        assert calls and (not args_marker or text.count("[TOOL_CALLS]") == len(calls))
        for call in calls:
            assert validator(PARAMS[call["name"]]).is_valid(call["arguments"]), call


# -- the cache and the errors -----------------------------------------------------

def test_the_cache_is_bounded_and_keeps_the_recent(demo):
    model, tok, _ = demo
    grammars = Grammars(tok, model.args.vocab_size, capacity=3)
    specs = [grammar.json_schema({"type": "object", "properties": {f"k{i}": {"type": "integer"}}})
             for i in range(5)]
    first = grammars.compile(specs[0])
    assert grammars.compile(grammar.json_schema({"type": "object", "properties": {"k0": {"type": "integer"}}})) is first
    for s in specs[1:]:
        grammars.compile(s)
    assert len(grammars) == 3 and (grammars.hits, grammars.misses) == (1, 5)
    grammars.compile(specs[4])  # the most recent stays
    grammars.compile(specs[0])  # the oldest was evicted: compiled again
    assert (grammars.hits, grammars.misses) == (2, 6) and len(grammars) == 3
    # The order of properties is part of the grammar (answers keep it): another key.
    a = grammar.json_schema({"properties": {"x": {}, "y": {}}})
    b = grammar.json_schema({"properties": {"y": {}, "x": {}}})
    assert a.key != b.key and a.key == grammar.json_schema({"properties": {"x": {}, "y": {}}}).key


@pytest.mark.parametrize("schema, words", [
    ({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
     ["uniqueItems", "#/properties/tags/uniqueItems"]),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, ['"if"', '"then"']),
    ({"type": "string", "format": "credit-card"}, ["Unknown format: credit-card"]),
    ({"type": "string", "pattern": "^(?=.*[A-Z]).{8,}$"}, ["look-around"]),
    ({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}, ["oneOf"]),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}, ["/$defs/Missing"]),
    ({"type": "strnig"}, ["strnig"]),
    ({"enum": []}, ["Unsatisfiable"]),
    # Compiles, but admits no value: unrefused, the answer was empty text, not JSON.
    ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, ["admits no value"]),
])
def test_a_schema_that_cannot_compile_names_the_unsupported_part(demo, schema, words):
    _, _, grammars = demo
    with pytest.raises(GrammarError) as e:
        grammars.compile(grammar.json_schema(schema))
    assert e.value.param == "response_format"
    for w in words:
        assert w in str(e.value), str(e.value)
    assert "<state>" not in str(e.value)  # the library's parser dump stays out of answers


def test_tool_choice_errors_name_their_param(demo):
    _, tok, grammars = demo
    with pytest.raises(GrammarError) as e:
        grammar.tool_call(STRICT_TOOLS, name="nope")
    assert e.value.param == "tool_choice" and "'nope'" in str(e.value)
    with pytest.raises(GrammarError) as e:
        grammars.compile(grammar.tool_call([{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "not": {"required": ["a"]}}}}]))
    assert e.value.param == "tools" and '"not"' in str(e.value)
    with pytest.raises(GrammarError) as e:
        grammar.json_schema(["not", "a", "schema"])
    # A model whose tool-call format has no grammar here (XML-like parameters).
    other = Grammars(tok)
    other.tool_format = grammar.ToolFormat("qwen3_coder", "<tool_call>", "</tool_call>")
    with pytest.raises(GrammarError) as e:
        other.compile(grammar.tool_call(STRICT_TOOLS))
    assert e.value.param == "tool_choice" and "qwen3_coder" in str(e.value)

"""A tiny but real mlx-lm model, built locally in a second, for tests and demos.

kvroute needs a model that loads through ``mlx_lm.load`` like any checkpoint,
fills a real KV cache, and whose greedy output is known in advance. Nothing
may be downloaded, so ``build`` trains a small byte-level BPE tokenizer on the
corpus below and writes a two-layer ``llama`` checkpoint whose weights are
constructed rather than learned:

* The attention and MLP layers are random, so every prompt produces real,
  prompt-dependent keys and values, but their writes to the residual stream
  are scaled down until the residual is dominated by the token embedding.
* Each embedding is a "successor direction" shared by all tokens with the same
  successor, plus a per-token random part. The ``lm_head`` reads only the
  successor directions, so the next token is a function of the current token
  alone (a bigram map), with a top-1/top-2 logit margin of tens of nats: even
  sampling at temperature 1.0 follows the map.

The map makes the chat generation prompt answer ``DEMO_REPLY`` (or a tool call
for ``DEMO_TOOL_CALL``) and makes digits count ``7 -> 8 -> 9 -> 0 -> ...``
forever, which tests use for long decodes.

``arch_models`` builds random-weight models of other architectures around the
same tokenizer and chat template (``write_checkpoint``) and caches them the
same way (``cached_build``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models import llama

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

# Bump when the files ``build`` writes change, so ``ensure`` rebuilds its cache.
VERSION = 1

DEMO_REPLY = "Hello! I am the kvroute demo model, answering from a tiny local brain."
DEMO_TOOL_CALL: dict = {"name": "get_weather", "arguments": {"city": "Paris"}}
VARIANTS = ("text", "tool")

# The tool variant's reply is three tokens: <tool_call>, the JSON with its
# surrounding newlines as one added token, and </tool_call>. One token for the
# JSON keeps the successor chain free of repeated tokens.
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


def tool_call_json(call: dict) -> str:
    """The tool variant's middle token: a call's JSON on a line of its own."""
    return "\n" + json.dumps(call) + "\n"


TOOL_CALL_JSON = tool_call_json(DEMO_TOOL_CALL)
DEMO_TOOL_REPLY = TOOL_CALL_START + TOOL_CALL_JSON + TOOL_CALL_END

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # EOS
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]

# Sizes are set by mlx's CPU backend on Linux (reference BLAS, ~7 GFLOP/s,
# attention composed from ops): on two cores a 2048-token prefill takes about
# 0.9 s, enough to measure a cache hit, while a 50-token prompt takes ~10 ms
# and a decode step ~1 ms. Attention dominates, so heads and layers are few;
# 256 hidden and 4 layers would already take 9 s for the same prefill.
SEED = 0
# An upper bound for BPE: the corpus runs out of merges at 1154 tokens, and
# the 3 added tokens make 1157.
VOCAB_SIZE = 2048
HIDDEN_SIZE = 128
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 32
INTERMEDIATE_SIZE = 256
MAX_POSITIONS = 8192
RMS_NORM_EPS = 1e-6

# How the embedding of a token splits between its successor direction and its
# own random direction (unit norm overall). The random part makes keys and
# values differ per token; only the successor part is read by lm_head.
SUCCESSOR_WEIGHT = 0.8
IDENTITY_WEIGHT = 0.6
# Logit of the successor, in nats, before the layers' small perturbations.
SUCCESSOR_LOGIT = 48.0
# lm_head's small random read of the identity part, so that the other tokens
# do not all tie at logit 0 (log-probs look like a real distribution).
OTHER_LOGIT_SCALE = 1.0
# Scale on o_proj and down_proj: the layers' writes to the residual stream.
RESIDUAL_SCALE = 0.01
MIN_MARGIN = 30.0

CORPUS = """\
Hello! I am the kvroute demo model, answering from a tiny local brain.
Hello there. How are you today? I am fine, thank you for asking.
kvroute is a proxy that speaks the OpenAI protocol and routes each request to \
the backend that already holds the key and value cache for its prompt. When two \
requests share a long system prompt, the second one skips most of the prefill \
and the first token arrives much sooner.
A language model reads a prompt one token at a time. For every token it \
computes keys and values in each attention layer, and those tensors are kept \
in a cache so that the next token does not have to recompute them. The cache \
grows with the length of the conversation, so memory is the limiting resource \
on a small machine.
The weather in Paris is mild in spring and warm in summer. Tourists walk along \
the river, visit museums, and sit at small tables outside cafes. In winter the \
city is grey and wet, but the lights along the streets make the evenings bright.
What is the weather like in London, Berlin, Madrid, Rome, Tokyo or New York? \
Call the weather function with the name of the city, and it will return the \
temperature, the wind, and whether it is sunny, cloudy, rainy or snowing.
To bake simple bread, mix flour, water, salt and yeast in a large bowl. Knead \
the dough until it is smooth and elastic, then let it rise in a warm place. \
Shape the loaf, bake it in a hot oven, and let it cool before slicing.
The quick brown fox jumps over the lazy dog. A journey of a thousand miles \
begins with a single step. Every cloud has a silver lining, and the early bird \
catches the worm, but the second mouse gets the cheese.
Servers accept connections, parse headers, read the body, and write a \
response. A router keeps a table of which worker has seen which prefix, \
chooses the best match, and falls back to the least loaded worker when no \
prefix is known. Metrics count hits, misses, latency and throughput.
Please summarize the following document in three short sentences. Translate \
this paragraph into French. Write a short poem about the ocean at night. \
Explain why the sky is blue to a curious child.
The system message sets the behaviour of the assistant. The user asks a \
question, the assistant answers, and a tool may be called to fetch fresh \
information. The tool response is then given back to the assistant, which \
writes the final answer for the user.
Mountains rise above green valleys where farmers grow wheat, corn, apples and \
grapes. Rivers carry melting snow down to the sea, and fishing boats return to \
the harbour every evening with their catch.
Students learn mathematics, history, chemistry, biology, music and painting. \
Teachers prepare lessons, correct homework, and encourage everyone to think \
carefully, ask questions, and explain their reasoning clearly.
{"type": "function", "function": {"name": "get_weather", "description": "Get \
the current weather for a city", "parameters": {"type": "object", \
"properties": {"city": {"type": "string", "description": "The city name"}}, \
"required": ["city"]}}}
{"name": "get_weather", "arguments": {"city": "Paris"}}
{"role": "user", "content": "What is the weather in Paris?"}
{"role": "assistant", "content": null, "tool_calls": []}
[1, 2, 3], {"ok": true, "error": false, "items": [], "count": 0}
<tools></tools> <tool_response></tool_response> system user assistant tool
"""

# Qwen2.5-style ChatML. It names both "<tool_call>" and "tool_call.name", which
# is how mlx-lm's _infer_tool_parser picks its json_tools parser.
CHAT_TEMPLATE = r"""{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part is string -%}
                {{- part -}}
            {%- elif part is mapping and part.type == 'text' -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set has_system = messages and messages[0].role in ['system', 'developer'] -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if has_system -%}
        {{- render_content(messages[0].content) + '\n\n' -}}
    {%- endif -%}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif has_system -%}
    {{- '<|im_start|>system\n' + render_content(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- set content = render_content(message.content) -%}
    {%- if message.role in ['system', 'developer'] -%}
        {%- if not loop.first -%}
            {{- '<|im_start|>system\n' + content + '<|im_end|>\n' -}}
        {%- endif -%}
    {%- elif message.role == 'user' -%}
        {{- '<|im_start|>user\n' + content + '<|im_end|>\n' -}}
    {%- elif message.role == 'assistant' -%}
        {{- '<|im_start|>assistant' -}}
        {%- if content -%}
            {{- '\n' + content -}}
        {%- endif -%}
        {%- for tool_call in message.tool_calls or [] -%}
            {%- if tool_call.function is defined -%}
                {%- set tool_call = tool_call.function -%}
            {%- endif -%}
            {{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' -}}
            {%- if tool_call.arguments is string -%}
                {{- tool_call.arguments -}}
            {%- else -%}
                {{- tool_call.arguments | tojson -}}
            {%- endif -%}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}"""

# Files a complete model directory has; ``ensure`` reuses a directory with all.
MODEL_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


def train_tokenizer(tool_call: dict | None = None) -> Tokenizer:
    """Train the byte-level BPE tokenizer on ``CORPUS``; ``tool_call`` (default
    ``DEMO_TOOL_CALL``) is the call whose JSON becomes the tool variant's token."""
    tokenizer = Tokenizer(models.BPE())
    # Digits are split one by one (as in Qwen2) so that every number is a run
    # of single-digit tokens and the counting map applies to each of them.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    # mlx-lm picks its BPE streaming detokenizer for a ByteLevel decoder.
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[AddedToken(t, special=True) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer)
    # Not special, so decoding with skip_special_tokens keeps the tool call.
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False)
         for t in (TOOL_CALL_START, TOOL_CALL_END, tool_call_json(tool_call or DEMO_TOOL_CALL))]
    )
    return tokenizer


def _require(ok: bool, message: str) -> None:
    # Build-time checks that must survive `python -O`, unlike assert.
    if not ok:
        raise RuntimeError(f"Demo model check failed: {message}")


def _single_token(tokenizer: Tokenizer, text: str) -> int:
    ids = tokenizer.encode(text).ids
    _require(len(ids) == 1, f"{text!r} is not one token: {ids}")
    return ids[0]


def successor_map(tokenizer: Tokenizer, variant: str,
                  tool_call: dict | None = None) -> tuple[dict[int, int], int]:
    """The bigram map: explicit successors, and the successor of all others."""
    if variant == "text":
        reply = tokenizer.encode(DEMO_REPLY).ids
        text = DEMO_REPLY
    elif variant == "tool":
        parts = (TOOL_CALL_START, tool_call_json(tool_call or DEMO_TOOL_CALL), TOOL_CALL_END)
        reply = [_single_token(tokenizer, t) for t in parts]
        text = "".join(parts)
    else:
        raise ValueError(f"Unknown variant {variant!r}, expected one of {VARIANTS}")
    _require(tokenizer.decode(reply) == text, f"{text!r} does not round-trip")
    # Each reply token has one successor, so none may repeat.
    _require(len(set(reply)) == len(reply), f"reply tokens repeat: {reply}")

    eos = _single_token(tokenizer, IM_END)
    # The generation prompt "<|im_start|>assistant\n" ends in this token.
    newline = _single_token(tokenizer, "\n")
    prompt_end = tokenizer.encode(IM_START + "assistant\n").ids[-1]
    _require(prompt_end == newline, "the generation prompt ends in another token")
    digits = [_single_token(tokenizer, str(i)) for i in range(10)]
    _require(not set(reply) & {*digits, newline, eos}, "reply overlaps the map")

    # The newline would map to reply[0] by default anyway; naming it keeps the
    # chat answer independent of how the default is built.
    successors = {newline: reply[0]}
    successors.update(zip(reply, reply[1:] + [eos]))
    successors.update(zip(digits, digits[1:] + digits[:1]))
    return successors, reply[0]


def _model_args(vocab_size: int, context: int = MAX_POSITIONS) -> llama.ModelArgs:
    from mlx_lm.models import llama

    return llama.ModelArgs(
        model_type="llama",
        hidden_size=HIDDEN_SIZE,
        num_hidden_layers=NUM_LAYERS,
        intermediate_size=INTERMEDIATE_SIZE,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        rms_norm_eps=RMS_NORM_EPS,
        vocab_size=vocab_size,
        max_position_embeddings=context,
        tie_word_embeddings=False,
    )


def build_model(
    successors: dict[int, int], default: int, vocab_size: int, context: int = MAX_POSITIONS
) -> llama.Model:
    """Build the bigram model: real random layers over constructed embeddings.

    Seeds mlx's global random generator, which the layers' initializers use.
    """
    import mlx.core as mx
    from mlx_lm.models import llama

    mx.random.seed(SEED)
    model = llama.Model(_model_args(vocab_size, context))

    # Successor directions are the first hidden axes: axis 0 for the tokens
    # that follow the default map, one axis per explicit token after it. The
    # remaining axes hold each token's own random identity.
    explicit = sorted(successors)
    num_dirs = len(explicit) + 1
    _require(num_dirs < HIDDEN_SIZE // 2, "too many explicit successors")
    axis = mx.zeros((vocab_size,), dtype=mx.int32)
    axis[mx.array(explicit)] = mx.arange(1, num_dirs, dtype=mx.int32)
    successor_of = [default] * vocab_size
    for token, nxt in successors.items():
        successor_of[token] = nxt

    def unit_rows(n: int, dim: int) -> mx.array:
        x = mx.random.normal((n, dim))
        return x / mx.linalg.norm(x, axis=-1, keepdims=True)

    # RMSNorm rescales the residual to norm sqrt(d) anyway; starting from
    # there keeps the layers' perturbations small relative to the embedding.
    scale = HIDDEN_SIZE**0.5
    directions = mx.eye(num_dirs, HIDDEN_SIZE)[axis]
    identity = mx.concatenate(
        [
            mx.zeros((vocab_size, num_dirs)),
            unit_rows(vocab_size, HIDDEN_SIZE - num_dirs),
        ],
        axis=1,
    )
    embed = scale * (SUCCESSOR_WEIGHT * directions + IDENTITY_WEIGHT * identity)

    # lm_head row s reads the directions of every token whose successor is s.
    # After the final norm the direction has length SUCCESSOR_WEIGHT * sqrt(d).
    readout = mx.zeros((vocab_size, num_dirs))
    rows = mx.array(successor_of)
    readout[rows, axis] = SUCCESSOR_LOGIT / (SUCCESSOR_WEIGHT * scale)
    # Two random unit vectors in n dims have a dot product of std 1/sqrt(n).
    n = HIDDEN_SIZE - num_dirs
    noise = unit_rows(vocab_size, n) * OTHER_LOGIT_SCALE * n**0.5
    noise = noise / (IDENTITY_WEIGHT * scale)
    lm_head = mx.concatenate([readout, noise], axis=1)

    model.model.embed_tokens.weight = embed
    model.lm_head.weight = lm_head
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.o_proj.weight = RESIDUAL_SCALE * attn.o_proj.weight
        mlp.down_proj.weight = RESIDUAL_SCALE * mlp.down_proj.weight
    mx.eval(model.parameters())
    return model


def logit_margins(
    model: llama.Model, tokens: mx.array
) -> tuple[mx.array, mx.array]:
    """Greedy next tokens and their top-1 minus top-2 logit, for a (B, L) batch."""
    import mlx.core as mx

    logits = model(tokens).astype(mx.float32)
    top2 = mx.topk(logits, 2, axis=-1)
    margins = top2.max(axis=-1) - top2.min(axis=-1)
    return logits.argmax(axis=-1), margins


def _check_model(
    model: llama.Model, successors: dict[int, int], default: int, vocab_size: int
) -> None:
    """Check the bigram map and the margin for every token, in context."""
    import mlx.core as mx

    expected = mx.array([successors.get(t, default) for t in range(vocab_size)])
    # Every token once as a one-token prompt, and once inside a 256-token
    # context of shuffled tokens, where attention mixes in other tokens.
    order = mx.random.permutation(vocab_size, key=mx.random.key(SEED))
    chunk = 256
    pad = -vocab_size % chunk  # to a whole number of chunks
    padded = mx.concatenate([order, order[:pad]])
    batches = [mx.arange(vocab_size)[:, None], padded.reshape(-1, chunk)]
    for tokens in batches:
        greedy, margins = logit_margins(model, tokens)
        wrong = (greedy != expected[tokens]).sum().item()
        _require(wrong == 0, f"{wrong} tokens do not predict their successor")
        margin = margins.min().item()
        _require(margin >= MIN_MARGIN, f"logit margin {margin:.1f} < {MIN_MARGIN}")


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def token_ids(tokenizer: Tokenizer) -> dict:
    """The special token ids a config.json names."""
    return {
        "bos_token_id": None,
        "eos_token_id": tokenizer.token_to_id(IM_END),
        "pad_token_id": tokenizer.token_to_id(PAD_TOKEN),
    }


def write_tokenizer(out_dir: Path, tokenizer: Tokenizer, context: int = MAX_POSITIONS) -> None:
    """Write the tokenizer, its chat template and the generation config."""
    eos_id = tokenizer.token_to_id(IM_END)
    pad_id = tokenizer.token_to_id(PAD_TOKEN)
    _write_json(
        out_dir / "generation_config.json",
        {"eos_token_id": eos_id, "pad_token_id": pad_id, "do_sample": False},
    )
    tokenizer.save(str(out_dir / "tokenizer.json"))
    special_tokens = {
        "eos_token": IM_END,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [IM_START, IM_END],
    }
    _write_json(out_dir / "special_tokens_map.json", special_tokens)
    _write_json(
        out_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "unk_token": None,
            **special_tokens,
            "model_max_length": context,
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )


def write_checkpoint(
    out_dir: Path, model: nn.Module, config: dict, tokenizer: Tokenizer,
    context: int = MAX_POSITIONS,
) -> None:
    """Write everything ``mlx_lm.load`` reads: weights, config and tokenizer."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(
        str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"}
    )
    _write_json(out_dir / "config.json", config)
    write_tokenizer(out_dir, tokenizer, context)


def build(out_dir: str | Path, variant: str = "text", context: int = MAX_POSITIONS,
          tool_call: dict | None = None) -> Path:
    """Write the demo model of ``variant`` to ``out_dir`` and return the path.

    ``context`` is the context length it declares (coding agents send prompts of
    tens of thousands of tokens; the weights do not depend on it). ``tool_call``
    is the call the tool variant answers with (default ``DEMO_TOOL_CALL``): an
    agent's own tool, so that the agent really runs it.
    """
    if variant not in VARIANTS:
        raise ValueError(f"Unknown variant {variant!r}, expected one of {VARIANTS}")
    if not isinstance(context, int) or context < 256:
        raise ValueError(f"context must be an integer of at least 256, not {context!r}")
    if tool_call is not None and not (
            isinstance(tool_call, dict) and isinstance(tool_call.get("name"), str)
            and isinstance(tool_call.get("arguments"), dict)):
        raise ValueError('tool_call must be {"name": "...", "arguments": {...}}')
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer(tool_call)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    successors, default = successor_map(tokenizer, variant, tool_call)
    model = build_model(successors, default, vocab_size, context)
    _check_model(model, successors, default, vocab_size)

    config = {
        "architectures": ["LlamaForCausalLM"],
        **{k: v for k, v in vars(model.args).items() if v is not None},
        **token_ids(tokenizer),
        "torch_dtype": "float32",
        "kvroute_demo": {"variant": variant, "version": VERSION},
    }
    write_checkpoint(out_dir, model, config, tokenizer, context)
    return out_dir


def default_cache_dir() -> Path:
    """$KVROUTE_CACHE_DIR, else $XDG_CACHE_HOME/kvroute, else ~/.cache/kvroute."""
    if path := os.environ.get("KVROUTE_CACHE_DIR"):
        return Path(path)
    if path := os.environ.get("XDG_CACHE_HOME"):
        return Path(path) / "kvroute"
    return Path.home() / ".cache" / "kvroute"


def _is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in MODEL_FILES)


def cached_build(
    name: str, build_into: Callable[[Path], object], cache_dir: Path | None = None
) -> Path:
    """Return ``cache_dir / name``, calling ``build_into(path)`` on first use.

    Several processes may call this at once: each builds into its own
    temporary directory and renames it into place, which is atomic, so a
    reader never sees half a model. The first rename wins; the others find a
    complete directory there and discard their own copy.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / name
    if _is_complete(target):
        return target

    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=cache_dir))
    try:
        build_into(tmp)
        # mkdtemp makes the directory private; the cache may be shared.
        os.chmod(tmp, 0o755)
        try:
            # Atomic, and fails on a non-empty target, so the first wins.
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target):
                # Not ours: cached_build() only ever moves complete directories
                # in. Removing it here could race with a process that just
                # replaced it with a good one, so leave that to the user.
                raise RuntimeError(
                    f"{target} exists but is not a complete model; remove it"
                ) from None
        return target
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure(variant: str = "text", cache_dir: Path | None = None) -> Path:
    """Return the cached demo model of ``variant``, building it on first use."""
    return cached_build(_name(variant), lambda path: build(path, variant), cache_dir)


def ensure_apart(variant: str = "text") -> Path:
    """`ensure` for a process that must not load MLX (`kvroute serve`'s launcher): a
    process that does holds a context (~0.5 GiB) on a CUDA card its replicas share, so
    a first build runs in a child process."""
    target = default_cache_dir() / _name(variant)
    if _is_complete(target):
        return target
    code = "import sys; from kvroute.devtools import demo_model; print(demo_model.ensure(sys.argv[1]))"
    try:
        out = subprocess.run([sys.executable, "-c", code, variant], capture_output=True, text=True,
                             check=True).stdout
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"building the demo model failed: {exc.stderr.strip()[-500:]}") from None
    return Path(out.strip().splitlines()[-1])


def _name(variant: str) -> str:
    if variant not in VARIANTS:
        raise ValueError(f"Unknown variant {variant!r}, expected one of {VARIANTS}")
    return f"demo-model-{variant}-v{VERSION}"

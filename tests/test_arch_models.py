"""The random-weight models of each mlx-lm family load, decode, and cache exactly."""

import json
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import CacheList, RotatingKVCache, make_prompt_cache

from kvroute.devtools import arch_models
from kvroute import cli
from tests.harness import TOOLS

# What make_prompt_cache gives each family: the reason these models exist.
EXPECTED_CACHES = {
    "qwen3": ["KVCache", "KVCache"],
    "gemma3_text": ["RotatingKVCache", "KVCache"] * 2,
    "gpt_oss": ["RotatingKVCache", "KVCache"] * 2,
    "qwen3_next": ["ArraysCache", "KVCache", "ArraysCache"],
    "lfm2": ["ArraysCache", "KVCache", "ArraysCache"],
    "mamba2": ["ArraysCache", "ArraysCache"],
    "falcon_h1": ["CacheList(ArraysCache, KVCache)"] * 2,
}

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the weather in Paris?"},
]


def cache_name(cache) -> str:
    if isinstance(cache, CacheList):
        return f"CacheList({', '.join(cache_name(c) for c in cache.caches)})"
    return type(cache).__name__


@pytest.fixture(scope="module", params=arch_models.ARCHES)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def arch_dir(arch, model_cache) -> Path:
    return arch_models.ensure(arch, cache_dir=model_cache)


@pytest.fixture(scope="module")
def loaded(arch_dir):
    return mlx_lm.load(str(arch_dir))


@pytest.fixture(scope="module")
def chat_prompt(loaded) -> list[int]:
    # With the tools in the system prompt, a chat is long enough (~200 tokens)
    # to rotate the 32-token sliding windows several times.
    _, tokenizer = loaded
    return tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True)


def test_expected_cache_classes(arch, loaded, chat_prompt):
    model, _ = loaded
    cache = make_prompt_cache(model)
    assert [cache_name(c) for c in cache] == EXPECTED_CACHES[arch]
    model(mx.array([chat_prompt]), cache=cache)
    for c in cache:
        if isinstance(c, RotatingKVCache):
            # The prompt went past the window, so the window rotated.
            assert c.max_size == arch_models.SLIDING_WINDOW
            assert c.offset == len(chat_prompt) > 3 * c.max_size


def test_config_files(arch, arch_dir):
    config = json.loads((arch_dir / "config.json").read_text())
    assert config["model_type"] == arch
    assert config["max_position_embeddings"] >= 8192
    assert config["kvroute_arch"] == {"arch": arch, "version": arch_models.VERSION}
    assert config.get("sliding_window", arch_models.SLIDING_WINDOW) == 32
    assert 2 <= config["num_hidden_layers"] <= 4
    assert config["hidden_size"] <= 128
    weights = mx.load(str(arch_dir / "model.safetensors"))
    assert {w.dtype for w in weights.values()} == {mx.float32}


def test_chat_template_with_tools(loaded, chat_prompt):
    _, tokenizer = loaded
    assert tokenizer.has_tool_calling
    text = tokenizer.decode(chat_prompt)
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert 200 <= len(chat_prompt) <= 300  # the exactness test cuts it at 200


def test_greedy_decode_is_finite_and_varied(loaded, chat_prompt):
    model, _ = loaded
    steps = generate_step(mx.array(chat_prompt), model, max_tokens=20)
    tokens, logprobs = zip(*((int(t), lp) for t, lp in steps))
    assert len(tokens) == 20
    assert all(mx.isfinite(lp).all().item() for lp in logprobs)
    assert len(set(tokens)) >= 10, tokens


# Split points: the builder's one; many small chunks across the sliding
# window's edges; and a run of one-token steps, as in decoding.
SPLITS = [(120,), (1, 2, 31, 32, 33, 64, 100, 150), tuple(range(185, 200))]


@pytest.mark.parametrize("splits", SPLITS, ids=["one", "many", "steps"])
def test_chunked_prefill_is_exact(loaded, chat_prompt, splits):
    model, _ = loaded
    gap = arch_models.prefill_gap(model, chat_prompt[:200], splits)
    assert gap <= arch_models.GAP_TOLERANCE


def test_prefill_gap_notices_a_wrong_cache(model_cache):
    # A sliding cache smaller than the model's window loses keys the
    # whole-prompt pass still sees; the check must say so.
    model, tokenizer = mlx_lm.load(str(arch_models.ensure("gemma3_text", model_cache)))
    right = model.make_cache
    model.make_cache = lambda: [
        RotatingKVCache(max_size=8) if isinstance(c, RotatingKVCache) else c
        for c in right()
    ]
    tokens = tokenizer.encode(" ".join(["the weather in Paris"] * 40))[:200]
    assert arch_models.prefill_gap(model, tokens) > 1e-2


def test_build_is_deterministic(model_cache, tmp_path):
    # qwen3_next also draws its A_log from the global generator at init.
    first = arch_models.ensure("qwen3_next", model_cache)
    again = arch_models.build(tmp_path, "qwen3_next")
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (first / name).read_bytes() == (again / name).read_bytes(), name


def test_ensure_builds_once_and_reuses(tmp_path, monkeypatch):
    path = arch_models.ensure("mamba2", cache_dir=tmp_path)
    assert path == tmp_path / f"arch-model-mamba2-v{arch_models.VERSION}"
    assert list(tmp_path.iterdir()) == [path]

    def fail(*args, **kwargs):
        raise AssertionError("ensure() rebuilt a complete model")

    monkeypatch.setattr(arch_models, "build", fail)
    assert arch_models.ensure("mamba2", cache_dir=tmp_path) == path


def test_unknown_arch_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="Unknown arch"):
        arch_models.build(tmp_path, "llama4")
    with pytest.raises(ValueError, match="Unknown arch"):
        arch_models.ensure("llama4", cache_dir=tmp_path)


def test_cli_builds_an_arch(tmp_path, capsys):
    # The CLI offers the names of the mlx-free names module: the ones built here.
    assert tuple(arch_models.CONFIGS) == arch_models.ARCHES
    out = tmp_path / "lfm2"
    assert cli.main(["demo-model", "--arch", "lfm2", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert json.loads((out / "config.json").read_text())["model_type"] == "lfm2"
    with pytest.raises(SystemExit):
        cli.main(["demo-model", "--arch", "llama4", str(tmp_path / "x")])


@pytest.mark.parametrize("arch", sorted(arch_models.LARGE_CONFIGS))
def test_7b_shapes_are_7b_class_bf16(arch):
    # Counted without allocating: mlx initializes parameters lazily.
    import importlib

    from mlx.utils import tree_flatten

    config = arch_models.model_config(arch, arch_models.demo_model.train_tokenizer(), "7b")
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    model = module.Model(module.ModelArgs.from_dict(config))
    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    assert 6e9 < params < 8e9
    assert config["torch_dtype"] == "bfloat16"
    assert config["max_position_embeddings"] >= 32768


def test_7b_only_for_the_large_shapes(tmp_path):
    with pytest.raises(ValueError, match="No 7b shape"):
        arch_models.build(tmp_path, "mamba2", "7b")
    with pytest.raises(ValueError, match="Unknown size"):
        arch_models.ensure("qwen3", cache_dir=tmp_path, size="70b")

"""The demo model loads through mlx_lm.load and answers exactly as designed."""

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from kvroute.devtools import demo_model
from kvroute.devtools.demo_model import DEMO_REPLY, DEMO_TOOL_CALL, DEMO_TOOL_REPLY
from tests.harness import TOOLS

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": [{"type": "text", "text": "And 3 + 3?"}]},
    ],
    [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    ],
]


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory) -> Path:
    return demo_model.build(tmp_path_factory.mktemp("demo-text"))


@pytest.fixture(scope="module")
def tool_dir(tmp_path_factory) -> Path:
    return demo_model.build(tmp_path_factory.mktemp("demo-tool"), variant="tool")


@pytest.fixture(scope="module")
def text_model(text_dir):
    return mlx_lm.load(str(text_dir))


@pytest.fixture(scope="module")
def tool_model(tool_dir):
    return mlx_lm.load(str(tool_dir))


def generate(model, tokenizer, prompt, max_tokens=64, sampler=None):
    """Generate, returning the text and why it stopped ("stop" or "length")."""
    text = ""
    for response in mlx_lm.stream_generate(
        model, tokenizer, prompt, max_tokens=max_tokens, sampler=sampler
    ):
        text += response.text
    return text, response.finish_reason


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_replies_with_demo_reply(text_model, messages):
    model, tokenizer = text_model
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert generate(model, tokenizer, prompt) == (DEMO_REPLY, "stop")


def test_reply_survives_sampling_at_temperature_one(text_model):
    model, tokenizer = text_model
    prompt = tokenizer.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True)
    sampler = make_sampler(temp=1.0)
    for _ in range(3):
        reply = generate(model, tokenizer, prompt, sampler=sampler)
        assert reply == (DEMO_REPLY, "stop")


def test_reply_tokens_are_distinct(text_model):
    _, tokenizer = text_model
    tokens = tokenizer.encode(DEMO_REPLY, add_special_tokens=False)
    assert len(set(tokens)) == len(tokens)
    assert not any(c.isdigit() for c in DEMO_REPLY)


def test_tool_variant_calls_the_tool(tool_model):
    model, tokenizer = tool_model
    assert tokenizer.has_tool_calling
    assert tokenizer.tool_call_start == "<tool_call>"
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    prompt = tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True
    )
    text, finish_reason = generate(model, tokenizer, prompt)
    assert (text, finish_reason) == (DEMO_TOOL_REPLY, "stop")

    start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
    assert text.startswith(start) and text.endswith(end)
    inner = text[len(start) : -len(end)]
    assert tokenizer.tool_parser(inner, TOOLS) == DEMO_TOOL_CALL
    # <tool_call>, the JSON and </tool_call> are one token each.
    assert len(tokenizer.encode(text, add_special_tokens=False)) == 3


@pytest.mark.parametrize("fixture", ["text_model", "tool_model"])
def test_digits_count_until_max_tokens(request, fixture):
    model, tokenizer = request.getfixturevalue(fixture)
    text, finish_reason = generate(model, tokenizer, "count: 7", max_tokens=40)
    assert finish_reason == "length"
    assert text == ("8901234567" * 4)[:40]


@pytest.mark.parametrize("fixture", ["text_model", "tool_model"])
def test_other_last_tokens_answer_the_reply(request, fixture):
    model, tokenizer = request.getfixturevalue(fixture)
    expected = DEMO_REPLY if fixture == "text_model" else DEMO_TOOL_REPLY
    assert generate(model, tokenizer, "The quick brown fox") == (expected, "stop")


def test_logit_margin_at_every_position(text_model):
    model, tokenizer = text_model
    prompt = tokenizer.apply_chat_template(
        CONVERSATIONS[1], tools=TOOLS, add_generation_prompt=True
    )
    greedy, margins = demo_model.logit_margins(model, mx.array([prompt]))
    assert margins.shape == (1, len(prompt))
    assert margins.min().item() >= 30
    first_reply_token = tokenizer.encode(DEMO_REPLY, add_special_tokens=False)[0]
    assert greedy[0, -1].item() == first_reply_token


def test_kv_cache_is_real(text_model):
    model, tokenizer = text_model
    prompt = tokenizer.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True)
    cache = make_prompt_cache(model)
    model(mx.array([prompt]), cache=cache)
    assert len(cache) == demo_model.NUM_LAYERS
    for layer_cache in cache:
        # KVCache.state is (keys, values, offset) in this mlx-lm, with the
        # buffers allocated past the offset, so slice the filled part.
        assert layer_cache.offset == len(prompt)
        keys = layer_cache.keys[..., : layer_cache.offset, :]
        values = layer_cache.values[..., : layer_cache.offset, :]
        # Non-zero, and different from one position to the next.
        assert mx.std(keys, axis=2).min().item() > 1e-3
        assert mx.std(values, axis=2).min().item() > 1e-3


def test_build_is_deterministic(text_dir, tmp_path):
    again = demo_model.build(tmp_path / "again")
    first = mx.load(str(text_dir / "model.safetensors"))
    second = mx.load(str(again / "model.safetensors"))
    assert first.keys() == second.keys()
    for name in first:
        assert mx.array_equal(first[name], second[name]).item(), name
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (text_dir / name).read_bytes() == (again / name).read_bytes()


def test_variants_share_the_tokenizer(text_dir, tool_dir):
    text_tok = (text_dir / "tokenizer.json").read_bytes()
    assert text_tok == (tool_dir / "tokenizer.json").read_bytes()


def test_files_look_like_a_checkpoint(text_dir):
    config = json.loads((text_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is False
    assert config["max_position_embeddings"] == 8192
    assert 1000 <= config["vocab_size"] <= 2000

    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(text_dir)
    assert hf_tokenizer.eos_token == "<|im_end|>"
    assert hf_tokenizer.pad_token == "<|endoftext|>"
    assert hf_tokenizer.model_max_length == 8192
    assert len(hf_tokenizer) == config["vocab_size"]
    digits = hf_tokenizer.encode("2048", add_special_tokens=False)
    assert hf_tokenizer.convert_ids_to_tokens(digits) == ["2", "0", "4", "8"]


def test_chat_template_rendering(text_model):
    _, tokenizer = text_model

    def render(messages, **kwargs):
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)

    assert render(CONVERSATIONS[0], add_generation_prompt=True) == (
        "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render(CONVERSATIONS[1]).startswith(
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
    )
    assert "<|im_start|>user\nAnd 3 + 3?<|im_end|>" in render(CONVERSATIONS[1])

    # Arguments given as a JSON string or as a dict render the same.
    as_string = render(CONVERSATIONS[2])
    as_dict = json.loads(json.dumps(CONVERSATIONS[2]))
    call = as_dict[2]["tool_calls"][0]["function"]
    call["arguments"] = json.loads(call["arguments"])
    assert render(as_dict) == as_string
    assert (
        "<|im_start|>assistant\n" + DEMO_TOOL_REPLY + "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny, 21C\n</tool_response><|im_end|>\n"
    ) in as_string
    assert as_string.startswith("<|im_start|>system\nAnswer in French.<|im_end|>\n")

    with_tools = render(CONVERSATIONS[0], tools=TOOLS)
    assert with_tools.startswith("<|im_start|>system\n")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in with_tools


def test_unknown_variant_is_rejected(tmp_path):
    with pytest.raises(ValueError):
        demo_model.build(tmp_path, variant="poetry")


def test_ensure_builds_once_and_reuses(tmp_path, monkeypatch):
    monkeypatch.setenv("KVROUTE_CACHE_DIR", str(tmp_path))
    path = demo_model.ensure()
    assert path.parent == tmp_path
    assert path.name == f"demo-model-text-v{demo_model.VERSION}"
    # Only the model directory is left behind, no temporary ones.
    assert list(tmp_path.iterdir()) == [path]

    def fail(*args, **kwargs):
        raise AssertionError("ensure() rebuilt a complete model")

    monkeypatch.setattr(demo_model, "build", fail)
    assert demo_model.ensure("text", cache_dir=tmp_path) == path

    model, tokenizer = mlx_lm.load(str(path))
    prompt = tokenizer.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True)
    assert generate(model, tokenizer, prompt) == (DEMO_REPLY, "stop")


def test_ensure_is_safe_for_concurrent_processes(tmp_path):
    # Three builders race on an empty cache; each must get a complete model.
    script = (
        "import sys; from kvroute.devtools import demo_model;"
        "print(demo_model.ensure('tool', cache_dir=sys.argv[1]))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    paths = {proc.communicate(timeout=60)[0].strip() for proc in procs}
    assert all(proc.returncode == 0 for proc in procs)
    assert len(paths) == 1
    path = Path(paths.pop())
    assert list(tmp_path.iterdir()) == [path]

    model, tokenizer = mlx_lm.load(str(path))
    prompt = tokenizer.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True)
    assert generate(model, tokenizer, prompt) == (DEMO_TOOL_REPLY, "stop")


def test_demo_model_command_builds_a_long_context_copy_calling_another_tool(tmp_path):
    """`kvroute demo-model --context N --tool-call JSON`, as the coding-agent tests use it:
    the declared context is N and the tool variant answers with that call."""
    call = {"name": "Bash", "arguments": {"command": "echo hi"}}
    out = subprocess.run(
        [sys.executable, "-m", "kvroute.cli", "demo-model", str(tmp_path / "m"), "--variant",
         "tool", "--context", "131072", "--tool-call", json.dumps(call)],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    path = Path(out.stdout.strip())
    assert json.loads((path / "config.json").read_text())["max_position_embeddings"] == 131072
    assert json.loads((path / "tokenizer_config.json").read_text())["model_max_length"] == 131072
    model, tokenizer = mlx_lm.load(str(path))
    prompt = tokenizer.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True)
    text, finish = generate(model, tokenizer, prompt)
    assert finish == "stop"
    inner = text[len(tokenizer.tool_call_start):-len(tokenizer.tool_call_end)]
    assert json.loads(inner) == call


@pytest.mark.parametrize("args, message", [
    (["--tool-call", "not json"], "--tool-call is not JSON"),
    (["--tool-call", '{"name": "x"}'], "tool_call must be"),
    (["--context", "10"], "context must be"),
])
def test_demo_model_command_refuses_bad_options(tmp_path, args, message):
    out = subprocess.run([sys.executable, "-m", "kvroute.cli", "demo-model", str(tmp_path / "m"),
                          *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr

"""Template-dependent prefix chains on the backend.

- A chat template that drops the reasoning of past replies (Qwen3-style) never gets
  the reply advertised as the next turn's prefix.
- The layout of a template (where it renders the tools and the system prompt) is found
  by rendering probes, for the demo model's template and Qwen2.5-, Llama-3.1-,
  Mistral-v0.3- and Gemma-3-style ones (tests/data/templates); with it, two
  conversations' chains share exactly the messages and tools that their rendered token
  streams share.

Real tokenizers: the demo model's, and copies with other templates."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer
from tokenizers import AddedToken, Tokenizer

from kvroute.backend.prompt import Template, reasoning_marker
from kvroute.core import prefix
from kvroute.backend.requests import parse_chat

# Past assistant turns lose everything up to </think>; the last one keeps it.
DROPPING = r"""{%- set last_user = namespace(i=0) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set last_user.i = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
  {%- set content = m.content -%}
  {%- if m.role == 'assistant' and loop.index0 < last_user.i and '</think>' in content -%}
    {%- set content = content.split('</think>')[-1] -%}
  {%- endif -%}
  {{- '<|im_start|>' + m.role + '\n' + content + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"""


def thinking_tokenizer(src: Path, dst: Path, template: str | None):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(src / name, dst / name)
    tok = Tokenizer.from_file(str(dst / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tok.save(str(dst / "tokenizer.json"))
    if template is not None:
        cfg = json.loads((dst / "tokenizer_config.json").read_text())
        cfg["chat_template"] = template
        (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return load_tokenizer(dst)


def template(drops: str = "", layout: prefix.Layout = prefix.DEFAULT_LAYOUT) -> Template:
    # No tokenizer: chains() takes the prompt's tokens as given.
    return Template(None, secret="s", block_bytes=64, checkpointing=False, layout=layout,
                    drops_reasoning=drops)


BODY = {"model": "m", "messages": [{"role": "user", "content": "What is 2 + 2?"}]}


def extended(drops: str, reply: str, body: dict = BODY,
             layout: prefix.Layout = prefix.DEFAULT_LAYOUT) -> tuple[list[int], list[int]]:
    req = parse_chat(body)
    prompt = template(drops, layout).chains(req, body, None, [1, 2, 3], {})
    return prompt.chain, prompt.extend(reply, [])


def test_template_that_drops_past_reasoning_is_detected(text_model, tmp_path):
    assert reasoning_marker(load_tokenizer(text_model)) == ""  # no reasoning markers at all
    keeps = tmp_path / "keeps"
    keeps.mkdir()
    assert reasoning_marker(thinking_tokenizer(text_model, keeps, None)) == ""
    drops = tmp_path / "drops"
    drops.mkdir()
    assert reasoning_marker(thinking_tokenizer(text_model, drops, DROPPING)) == "<think>"


def test_reasoning_reply_is_not_advertised_as_next_prefix():
    chain, nxt = extended("<think>", "<think>add them</think>4")
    assert nxt == chain  # the next turn renders without the reasoning: no extension
    chain, nxt = extended("<think>", "4")  # no reasoning in this reply: extends as usual
    assert nxt[: len(chain)] == chain and len(nxt) > len(chain)
    expected = prefix.request_chain("chat", {**BODY, "messages": BODY["messages"] + [
        {"role": "assistant", "content": "<think>add them</think>4"}]},
        model="m", salt=prefix.make_salt("s"), block_bytes=64)
    assert extended("", "<think>add them</think>4")[1] == [k for k, _ in expected]


# -- layouts: where a template renders the tools and the system prompt ----------------

from transformers import AutoTokenizer  # noqa: E402

from kvroute.backend.prompt import chat_layout  # noqa: E402
from kvroute.devtools.demo_model import CHAT_TEMPLATE  # noqa: E402
from kvroute.core.prefix import Layout  # noqa: E402

TEMPLATES = {p.stem: p.read_text()
             for p in (Path(__file__).parent / "data" / "templates").glob("*.jinja")}
TEMPLATES["demo"] = CHAT_TEMPLATE  # the demo model's, which every arch model shares
LAYOUTS = {
    "demo": Layout("after_system"),
    "qwen2.5": Layout("after_system"),
    # "Environment: ipython" ahead of the system prompt when tools are given.
    "llama3.1": Layout("after_system", tools_mark=True),
    "mistral-v0.3": Layout("before_last_user", "last_user"),
    "gemma-3": Layout("none"),
}
SALT = prefix.make_salt("s")
WHOLE = 1 << 20  # one block per segment: chains then share whole messages or nothing


@pytest.fixture(scope="module")
def hf_tokenizer(text_model):
    return AutoTokenizer.from_pretrained(text_model)


def render(tok, name: str, messages: list[dict], tools: list[dict] | None) -> str:
    return tok.apply_chat_template(messages, tools=tools, chat_template=TEMPLATES[name],
                                   add_generation_prompt=True, tokenize=False)


def test_template_layouts_are_detected(hf_tokenizer):
    assert set(TEMPLATES) == set(LAYOUTS)
    for name, expected in LAYOUTS.items():
        found = prefix.detect_layout(lambda m, t: render(hf_tokenizer, name, m, t))
        assert found == (expected, ""), name


def test_backend_finds_its_models_layout(text_model, tool_model, tmp_path):
    assert chat_layout(load_tokenizer(text_model)) == Layout("after_system")
    assert chat_layout(load_tokenizer(tool_model)) == Layout("after_system")
    mistral = tmp_path / "mistral"
    mistral.mkdir()
    tok = thinking_tokenizer(text_model, mistral, TEMPLATES["mistral-v0.3"])
    assert chat_layout(tok) == LAYOUTS["mistral-v0.3"]


def tools(*names: str) -> list[dict]:
    # The last property name ends each tool's rendering: it marks where the tools end.
    return [{"type": "function", "function": {
        "name": f"lookup_{n}", "description": f"Looks up the {n} of a city.",
        "parameters": {"type": "object", "properties": {f"city_for_{n}": {"type": "string"}}}}}
        for n in names]


def items_ending(text: str, messages: list[dict], tool_list: list[dict] | None) -> set:
    """(item, end offset in `text`) for the messages and the tool list `text` renders."""
    out = {(i, m["content"], text.find(m["content"]) + len(m["content"]))
           for i, m in enumerate(messages) if m["content"] in text}
    if tool_list:
        last = next(iter(tool_list[-1]["function"]["parameters"]["properties"]))
        if last in text:
            out.add((prefix.TOOLS, json.dumps(tool_list), text.rfind(last) + len(last)))
    return out


def shared_by_tokens(tok, name: str, a: tuple, b: tuple) -> set:
    """The messages and tools two conversations' token streams share: those rendered
    ending at the same place in both, inside the streams' common token prefix."""
    texts = [render(tok, name, *conv) for conv in (a, b)]
    enc = [tok(t, add_special_tokens=False, return_offsets_mapping=True) for t in texts]
    n = prefix.common_prefix(enc[0]["input_ids"], enc[1]["input_ids"])
    chars = enc[0]["offset_mapping"][n - 1][1] if n else 0
    both = items_ending(texts[0], *a) & items_ending(texts[1], *b)
    return {item for item, _, end in both if end <= chars}


def body(conv: tuple) -> dict:
    messages, tool_list = conv
    return {"messages": messages, **({"tools": tool_list} if tool_list else {})}


def shared_by_chains(a: tuple, b: tuple, layout: Layout) -> set:
    """The messages and tools two conversations' chains claim to share."""
    chains = [prefix.chat_chain(body(c), model="m", salt=SALT, block_bytes=WHOLE, layout=layout)
              for c in (a, b)]
    n = prefix.common_prefix(*chains)
    roles = [m["role"] for m in a[0]]
    # Block 0 is the header; each further block is one item of a's arrangement.
    items = prefix.arrange(roles, bool(a[1]), layout)[:max(0, n - 1)]
    return {x for x in items if x != prefix.MARK}


def msg(role: str, content: str) -> dict:
    return {"role": role, "content": content}


S1 = msg("system", "You are the travel desk of a small airline; be brief.")
S2 = msg("system", "You answer questions about the weather for farmers.")
U = msg("user", "What will the weather be in Lyon tomorrow?")
U_OTHER = msg("user", "Which cities have direct flights to Oslo?")
A = msg("assistant", "Sunny, with a light wind from the north.")
U2 = msg("user", "And the day after that?")
T, T_OTHER = tools("weather", "flights"), tools("weather", "trains")

PAIRS = {
    "system prompts differ, same tools": (([S1, U], T), ([S2, U], T)),
    "user messages differ": (([S1, U], T), ([S1, U_OTHER], T)),
    "tools differ": (([S1, U], T), ([S1, U], T_OTHER)),
    "tools and no tools": (([S1, U], T), ([S1, U], None)),
    "next turn": (([S1, U], T), ([S1, U, A, U2], T)),
    "next turn, no system prompt": (([U], T), ([U, A, U2], T)),
    "next turn, no tools": (([S1, U], None), ([S1, U, A, U2], None)),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_chains_share_what_the_tokens_share(hf_tokenizer, name, pair):
    a, b = PAIRS[pair]
    truth = shared_by_tokens(hf_tokenizer, name, a, b)
    assert shared_by_chains(a, b, LAYOUTS[name]) == truth, truth


def test_tools_first_claims_a_prefix_that_qwen_style_tokens_lack(hf_tokenizer):
    # The bug this layout fixes: same tools, different system prompts.
    a, b = PAIRS["system prompts differ, same tools"]
    for name in ("demo", "qwen2.5", "llama3.1"):
        assert shared_by_tokens(hf_tokenizer, name, a, b) == set()
        assert shared_by_chains(a, b, prefix.DEFAULT_LAYOUT) == {prefix.TOOLS}


def test_next_turn_is_not_advertised_where_the_template_moves_the_system_prompt():
    with_system = {"model": "m", "messages": [S1, U], "tools": T}
    mistral = LAYOUTS["mistral-v0.3"]
    # Mistral renders the system prompt inside the last user turn: the next turn moves
    # it past this reply, so the reply extends nothing the next request will send.
    chain, nxt = extended("", "Sunny.", with_system, mistral)
    assert nxt == chain
    # Without a system prompt the tools stay before this turn's user message, and a
    # reply that calls a tool is followed by its result, not a new user turn.
    chain, nxt = extended("", "Sunny.", {**with_system, "messages": [U]}, mistral)
    assert nxt[:len(chain)] == chain and len(nxt) > len(chain)
    for layout in (LAYOUTS["demo"], LAYOUTS["llama3.1"], LAYOUTS["gemma-3"]):
        chain, nxt = extended("", "Sunny.", with_system, layout)
        assert nxt[:len(chain)] == chain and len(nxt) > len(chain)

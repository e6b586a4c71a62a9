"""Template-dependent prefix chains on the backend: a chat template that drops the
reasoning of past replies (Qwen3-style) never gets the reply advertised as the next
turn's prefix. Real tokenizers: the demo model's, and a copy with reasoning markers
and such a template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer
from tokenizers import AddedToken, Tokenizer

from backend.server import _chat_chains, _drops_reasoning
from kvroute import prefix
from kvroute.wire import parse_chat

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


def state(drops: str):
    return SimpleNamespace(config=SimpleNamespace(secret="s", block_bytes=64),
                           drops_reasoning=drops, bytes_per_token=0.0)


BODY = {"model": "m", "messages": [{"role": "user", "content": "What is 2 + 2?"}]}


def extended(drops: str, reply: str) -> tuple[list[int], list[int]]:
    req = parse_chat(BODY)
    chain, _, extend = _chat_chains(state(drops), BODY, req, None, {}, [1, 2, 3])
    return chain, extend(reply, [])


def test_template_that_drops_past_reasoning_is_detected(text_model, tmp_path):
    assert _drops_reasoning(load_tokenizer(text_model)) == ""  # no reasoning markers at all
    keeps = tmp_path / "keeps"
    keeps.mkdir()
    assert _drops_reasoning(thinking_tokenizer(text_model, keeps, None)) == ""
    drops = tmp_path / "drops"
    drops.mkdir()
    assert _drops_reasoning(thinking_tokenizer(text_model, drops, DROPPING)) == "<think>"


def test_reasoning_reply_is_not_advertised_as_next_prefix():
    chain, nxt = extended("<think>", "<think>add them</think>4")
    assert nxt == chain  # the next turn renders without the reasoning: no extension
    chain, nxt = extended("<think>", "4")  # no reasoning in this reply: extends as usual
    assert nxt[: len(chain)] == chain and len(nxt) > len(chain)
    expected = prefix.request_chain("chat", {**BODY, "messages": BODY["messages"] + [
        {"role": "assistant", "content": "<think>add them</think>4"}]},
        model="m", salt=prefix.make_salt("s"), block_bytes=64)
    assert extended("", "<think>add them</think>4")[1] == [k for k, _ in expected]

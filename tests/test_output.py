"""The output parser: stop strings and tool-call markup matched on decoded text."""

from __future__ import annotations

import json

from kvroute.backend.output import OutputParser

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def parser() -> OutputParser:
    return OutputParser([], "<tool_call>", "</tool_call>", lambda body, tools: json.loads(body), TOOLS)


def test_a_call_cut_by_max_tokens_is_neither_text_nor_a_call():
    p = parser()
    assert p.feed('Sure. <tool_call>{"name": "f", "argu').text == "Sure. "
    tail = p.finish("", cut=True)
    assert (tail.text, tail.tool_calls) == ("", [])


def test_unparseable_call_markup_at_the_models_own_end_stays_its_answer():
    p = parser()
    p.feed("<tool_call>not a call")
    assert p.finish("").text == "<tool_call>not a call"


def test_a_whole_call_whose_end_marker_never_came_is_a_call_even_when_cut():
    p = parser()
    p.feed('<tool_call>{"name": "f", "arguments": {}}')
    (call,) = p.finish("", cut=True).tool_calls
    assert call["function"] == {"name": "f", "arguments": "{}"}


def test_a_stop_string_across_segments_never_leaks():
    p = OutputParser(["END"])
    assert p.feed("abc E").text == "abc "
    out = p.feed("ND more")
    assert (out.text, out.stopped, out.stop) == ("", True, "END")

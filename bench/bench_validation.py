"""What validating one request body costs, per API, in this process (no HTTP).

Times `kvroute.backend.requests.parse_chat` / `parse_completion` (the backend's validation of
every chat and completion body) and the proxy's parsers of the agent APIs
(`proxy.agents.responses.parse`, `proxy.agents.messages.parse`) on the bodies
bench_proxy.py sends and on tool-calling agent turns, best of --repeat runs. It
counts this process's CPU time (`time.process_time`), not wall time, so a machine
shared with other work skews it less.

    python -m bench.bench_validation [--number 2000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
import timeit

from rich.console import Console
from rich.table import Table

from bench.command import command_line
from kvroute.backend import requests
from kvroute.proxy.agents import messages as messages_api
from kvroute.proxy.agents import responses as responses_api

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}

CHAT = {  # bench_proxy.py's conversation
    "model": "fake",
    "messages": [
        {"role": "system", "content": "You are a careful assistant for a team of engineers. " * 12},
        {"role": "user", "content": "Conversation 1: how do we ship this?"},
        {"role": "assistant", "content": "Step by step, with tests. " * 8},
        {"role": "user", "content": "And then?"},
    ],
}

CHAT_TOOLS = {
    "model": "fake", "tools": [TOOL] * 4, "temperature": 0.7, "max_tokens": 200,
    "stream": True, "stream_options": {"include_usage": True}, "stop": ["\n\n"],
    "messages": [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
    ] * 5,
}

COMPLETION = {"model": "fake", "prompt": "Once upon a time " * 20, "max_tokens": 16,
              "logprobs": 2}

RESPONSES = {
    "model": "fake", "instructions": "You are an agent.", "max_output_tokens": 200,
    "tools": [{"type": "function", "name": "get_weather", "parameters": TOOL["function"][
        "parameters"]}] * 4,
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
    ] * 5,
}

MESSAGES = {
    "model": "fake", "max_tokens": 200, "system": "You are an agent.",
    "tools": [{"name": "get_weather", "input_schema": TOOL["function"]["parameters"]}] * 4,
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"}]},
    ] * 5,
}

CASES = [
    ("chat (bench_proxy body)", requests.parse_chat, CHAT),
    ("chat (20 messages, tools)", requests.parse_chat, CHAT_TOOLS),
    ("completion", requests.parse_completion, COMPLETION),
    ("responses (15 items, tools)", responses_api.parse, RESPONSES),
    ("messages (15 messages, tools)", messages_api.parse, MESSAGES),
]


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_validation", description=__doc__.splitlines()[0])
    ap.add_argument("--number", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    table = Table(title="Validating one request body (CPU time, best of repeats)")
    table.add_column("body")
    table.add_column("µs per body", justify="right")
    for name, fn, body in CASES:
        best = min(timeit.repeat(lambda: fn(body), number=args.number, repeat=args.repeat,
                                 timer=time.process_time))
        table.add_row(name, f"{best / args.number * 1e6:.1f}")
    console = Console()
    console.print(f"command: {command_line()}")
    console.print(f"machine: {platform.machine()} {platform.system()}, {os.cpu_count()} cores, "
                  f"python {platform.python_version()}")
    console.print(table)


if __name__ == "__main__":
    main()

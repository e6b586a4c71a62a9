"""Conversations that share a tool list but not a system prompt, end to end: real
Redis, two real backends with the demo model, two proxies, the official `openai`
client.

The demo model's chat template renders, like Qwen's, the system prompt first and the
tools after it, so two such conversations share no more than the template's first
tokens. Prefix keys that hashed the tools first claimed a long shared prefix: every new
conversation went to the backend holding the tools, predicted to hit thousands of
tokens it did not have. With the template's layout (found by each backend at load,
published in its record) they spread, predicted about as much as they get, and their
follow-up turns stay where their prefix is.
"""

from __future__ import annotations

import json
import uuid

import pytest

from tests import harness
from tests.harness import BackendProcess, ProxyProcess, chat, request, tool, wait_until

SECRET = "tools-secret"
TOKEN = "tools-token"
MODEL = "tools-model"


@pytest.fixture(scope="module")
def fleet(text_model, tmp_path_factory, redis_server):
    logs = tmp_path_factory.mktemp("tools-spread")

    def backends(redis_url: str) -> list[BackendProcess]:
        common = ["--redis-url", redis_url, "--internal-token", TOKEN, "--secret", SECRET,
                  "--cache-bytes", "256MiB"]
        return [BackendProcess(text_model, MODEL, logs, backend_id=bid, extra=common)
                for bid in ("t1", "t2")]

    def proxies(redis_url: str) -> list[ProxyProcess]:
        return [ProxyProcess(redis_url, logs, ["--secret", SECRET, "--internal-token", TOKEN])
                for _ in range(2)]

    with harness.fleet(backends, proxies, redis_server.database()) as f:
        yield f


def team_tool(name: str, what: str) -> dict:
    return tool(name, f"{what} Answers in JSON; fails with an error message.",
                {"type": "object", "required": ["query"], "properties": {
                    "query": {"type": "string", "description": f"What to {name.split('_')[0]}."},
                    "limit": {"type": "integer", "description": "At most this many results."}}})


# A team's tools, the one thing its conversations share.
TEAM_TOOLS = [team_tool("search_docs", "Searches the team's documentation."),
              team_tool("read_file", "Reads a file of the repository."),
              team_tool("list_tickets", "Lists the open tickets of a project."),
              team_tool("create_ticket", "Opens a ticket in the tracker."),
              team_tool("run_query", "Runs a read-only SQL query on the warehouse."),
              team_tool("send_message", "Posts a message in a chat channel."),
              team_tool("get_weather", "Gives the weather forecast of a city."),
              team_tool("book_room", "Books a meeting room for a time slot.")]


def decisions(proxies: list[ProxyProcess]) -> list[dict]:
    return [d for p in proxies for d in json.loads(request(p.url + "/stats")[2])["decisions"]]


def test_conversations_sharing_only_tools_spread_and_follow_ups_stick(fleet):
    proxies = fleet["proxies"]
    for p in proxies:  # the proxies route by the layout the backends published
        wait_until(lambda: {b["tools_at"] for b in p.health()["backends"]} == {"after_system"},
                   10, what="the proxy to learn the template's layout")
    conversations = []
    for i in range(8):  # one after another: each answered before the next starts
        messages = [{"role": "system", "content": f"{uuid.uuid4().hex}: you are agent {i} "
                     "of a small team; use the tools when they help, and answer briefly."},
                    {"role": "user", "content": "Hello there."}]
        r = chat(proxies[i % 2], messages, MODEL, tools=TEAM_TOOLS, max_tokens=8)
        messages.append({"role": "assistant", "content": r.completion.choices[0].message.content})
        conversations.append((r.headers["x-kvroute-backend"], messages))
    homes = [bid for bid, _ in conversations]
    assert 3 <= homes.count("t1") <= 5, homes

    # Nothing but the template's first tokens is shared: nothing is predicted either.
    first = decisions(proxies)
    assert len(first) == 8
    for d in first:
        assert d["predicted_tokens"] <= max(2 * d["cached_tokens"], 16), d

    for i, (home, messages) in enumerate(conversations):
        for turn in range(2):
            messages.append({"role": "user", "content": f"And then ({turn})?"})
            r = chat(proxies[(i + turn + 1) % 2], messages, MODEL, tools=TEAM_TOOLS, max_tokens=8)
            assert r.headers["x-kvroute-backend"] == home, (i, turn, r.headers)
            assert r.headers["x-kvroute-route-reason"] == "cache-hit"
            usage = r.completion.usage
            assert usage.prompt_tokens_details.cached_tokens >= 0.8 * usage.prompt_tokens
            messages.append({"role": "assistant", "content": r.completion.choices[0].message.content})
    follow_ups = [d for d in decisions(proxies) if d not in first]
    assert len(follow_ups) == 16
    for d in follow_ups:
        assert 0.7 <= d["predicted_tokens"] / d["cached_tokens"] <= 1.3, d

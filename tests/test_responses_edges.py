"""Edges of the Responses API where kvroute must answer as OpenAI does: a truncated
answer's message item.

One fleet (Redis, a backend of each demo model, a proxy with two API keys) and the
official `openai` client.
"""

from __future__ import annotations

import uuid

import openai
import pytest

from tests import harness
from tests.harness import BackendProcess, ProxyProcess

from kvroute.devtools.demo_model import DEMO_REPLY

SECRET = "edges-secret"
TOKEN = "edges-internal-token"
KEY, OTHER_KEY = "sk-edges", "sk-edges-other"
TEXT, TOOL = "edges-text", "edges-tool"


@pytest.fixture(scope="module")
def fleet(text_model, tool_model, tmp_path_factory, redis_server):
    logs = tmp_path_factory.mktemp("edges")
    common = ["--secret", SECRET, "--internal-token", TOKEN]

    def backends(redis_url: str) -> list[BackendProcess]:
        return [BackendProcess(text_model, TEXT, logs, backend_id="edges-text",
                               extra=["--redis-url", redis_url, *common]),
                BackendProcess(tool_model, TOOL, logs, backend_id="edges-tool",
                               extra=["--redis-url", redis_url, *common])]

    def proxies(redis_url: str) -> list[ProxyProcess]:
        return [ProxyProcess(redis_url, logs, [*common, "--api-key", f"{KEY}:team-a",
                                               "--api-key", f"{OTHER_KEY}:team-b"])]

    with harness.fleet(backends, proxies, redis_server.database()) as f:
        yield f["proxies"][0].url


def oai(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def nonce() -> str:
    # Keeps a test's conversation apart from every other test's cache entries.
    return f"{uuid.uuid4().hex}: you help a team of engineers with their code."


# -- 1. a truncated answer's message item is incomplete ----------------------------------------


def test_truncated_message_item_is_incomplete_whole_streamed_and_stored(fleet):
    c = oai(fleet)
    r = c.responses.create(model=TEXT, instructions=nonce(), input="Hello there.",
                           max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [(o.type, o.status) for o in r.output] == [("message", "incomplete")]
    assert r.output_text and DEMO_REPLY.startswith(r.output_text)
    stored = c.responses.retrieve(r.id)
    assert stored.status == "incomplete" and stored.output[0].status == "incomplete"

    events = list(c.responses.create(model=TEXT, instructions=nonce(), input="Hello there.",
                                     max_output_tokens=3, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.type, i.status) for i in done] == [("message", "incomplete")]
    assert done[0].content[0].text == events[-1].response.output_text
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output[0].status == "incomplete"
    assert c.responses.retrieve(events[-1].response.id).output[0].status == "incomplete"

    # An answer that ended by itself stays completed.
    whole = c.responses.create(model=TEXT, instructions=nonce(), input="Hello there.")
    assert whole.status == "completed" and whole.output[0].status == "completed"

"""The real coding agents, set up exactly as docs/AGENTS.md says, against `kvroute serve`.

Claude Code and Codex CLI come from npm at the versions tests/agents/package.json pins
(scripts/install.sh --test installs them); an upgrade is a change of one version there.
Each is driven non-interactively (`claude -p`, `codex exec`) with its configuration taken
from the doc's own code blocks (only the port changed): a first turn, a second turn of
the same session that must come back >= 80% cached on the backend that served the
first, a turn with a tool call the agent really runs and its result, and a client
killed mid-request whose prompt must still be kept. No request of theirs may be
refused: the proxy's per-API counters must show no 4xx.

The models are demo-model copies (`kvroute demo-model --context 131072`) whose context
fits the agents' default prompts; the tool variants answer with a call of the agent's
own shell tool. On this CPU a full default prompt (~20-25k demo tokens) prefills in
about a minute, so the suite trims the agents' own options; each trim is listed in
docs/AGENTS.md ("Tested with"): Claude Code `--tools Bash` and `--system-prompt`
(a shorter system prompt), Codex `--disable multi_agent --disable goals` and
`model_instructions_file` (shorter base instructions).
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.harness import ROOT, ServeProcess, get_json, metric_sum, request, wait_until
from kvroute.devtools import demo_model
from kvroute.devtools.demo_model import DEMO_REPLY

BIN = ROOT / "tests" / "agents" / "node_modules" / ".bin"
CLAUDE, CODEX = BIN / "claude", BIN / "codex"
DOC = ROOT / "docs" / "AGENTS.md"
DOC_PORT = "127.0.0.1:8000"
KEY = "sk-team-a"
OPERATOR_KEY = "sk-ops"  # /stats needs an operator key once keys are set
CONTEXT = 131072
MARKER = "kvroute-tool-ok"

pytestmark = pytest.mark.skipif(
    not (CLAUDE.exists() and CODEX.exists()),
    reason="the coding agents are not installed (scripts/install.sh --test runs npm ci in "
           "tests/agents)")

# The suite's trims (docs/AGENTS.md "Tested with"): the same agents with less to prefill.
SHORT_PROMPT = ("You are a coding agent. Answer briefly. Use the Bash tool to run shell "
                "commands when asked to.")
CLAUDE_TRIMS = ["--tools", "Bash", "--system-prompt", SHORT_PROMPT]
CODEX_TRIMS = ["--disable", "multi_agent", "--disable", "goals"]


def doc_block(heading: str, lang: str) -> str:
    """The first ```lang block under `## heading` in docs/AGENTS.md."""
    text = DOC.read_text()
    section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(rf"```{lang}\n(.*?)```", section, re.S)
    assert match, f"no ```{lang} block under '## {heading}' in {DOC}"
    return match.group(1)


def doc_env(heading: str, port: int) -> tuple[dict[str, str], list[str]]:
    """The `export`/`unset` lines of a bash block, as variables to set and to remove."""
    env, unset = {}, []
    for line in doc_block(heading, "bash").splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("export "):
            name, value = line[len("export "):].split("=", 1)
            env[name] = value.strip().replace(DOC_PORT, f"127.0.0.1:{port}")
        elif line.startswith("unset "):
            unset += line.split()[1:]
    return env, unset


@pytest.fixture(scope="module")
def agent_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("agent-models")
    calls = {"bash": {"name": "Bash", "arguments": {"command": f"echo {MARKER}",
                                                    "description": "Print a marker"}},
             "exec": {"name": "exec_command", "arguments": {"cmd": f"echo {MARKER}"}}}
    out = {"text": demo_model.build(root / "text", "text", context=CONTEXT)}
    for name, call in calls.items():
        out[name] = demo_model.build(root / name, "tool", context=CONTEXT, tool_call=call)
    return out


@pytest.fixture(scope="module")
def serve(agent_models, tmp_path_factory):
    """`kvroute serve` with the doc's alias and key: qwen-coder on two backends, and the
    tool-calling copies on one each."""
    work = tmp_path_factory.mktemp("agents-serve")
    # A small batch: the memory check reserves running KV for max_batch sequences of the
    # whole 131k context, and four such replicas would not fit this machine.
    small = {"max_batch": 4, "cache_bytes": "1GiB"}
    config = {
        "proxy": {"api_keys": [f"{KEY}:team-a", f"{OPERATOR_KEY}:operator"]},
        "models": [
            {"path": str(agent_models["text"]), "alias": "qwen-coder", "replicas": 2, **small},
            {"path": str(agent_models["bash"]), "alias": "bash-coder", "replicas": 1, **small},
            {"path": str(agent_models["exec"]), "alias": "exec-coder", "replicas": 1, **small},
        ],
    }
    # A generous locality slack (serve's proxy reads it from the environment): on this
    # CPU a backend's measured prefill rate swings with the depth of the prompts it last
    # prefilled (attention dominates the tiny model), and the default second let that
    # noise send a retry away from its 9k-token hit. Routing's trade-offs are tested in
    # test_policy.py; here, the agents' hits.
    proc = ServeProcess(config, work, env={"KVROUTE_LOCALITY_SLACK": "600"})
    try:
        proc.wait_ready(lambda: len(healthy(proc)) == 4, 180)
        yield proc
    finally:
        proc.stop()


def stats(serve) -> dict:
    return get_json(f"{serve.url}/stats", headers={"Authorization": f"Bearer {OPERATOR_KEY}"})


def healthy(serve) -> list[dict]:
    body = get_json(f"{serve.url}/health")
    return [b for b in body.get("backends", []) if not b.get("suspect")]


def api_statuses(serve, api: str) -> collections.Counter:
    """kvroute_proxy_api_requests_total{api} by status."""
    text = request(f"{serve.url}/metrics")[2].decode()
    found = re.findall(r'^kvroute_proxy_api_requests_total\{([^}]*)\}\s+(\S+)', text, re.M)
    out: collections.Counter = collections.Counter()
    for labels, value in found:
        fields = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if fields.get("api") == api:
            out[fields["status"]] += int(float(value))
    return out


class Watch:
    """What the proxy routed and refused while an agent ran: its /stats decisions
    after a mark, and its per-API counters' growth by status."""

    def __init__(self, serve, api: str):
        self.serve, self.api = serve, api
        self.t0 = max((d["t"] for d in stats(serve)["decisions"]), default=0.0)
        self.statuses0 = api_statuses(serve, api)

    def decisions(self, model: str | None = None) -> list[dict]:
        out = [d for d in stats(self.serve)["decisions"] if d["t"] > self.t0]
        return sorted((d for d in out if model is None or d["model"] == model),
                      key=lambda d: d["t"])

    def api_counts(self) -> tuple[int, int]:
        """Requests since the mark, and those refused or failed: any status but 200 and
        499 (a client that went away, as a killed agent does)."""
        grown = api_statuses(self.serve, self.api) - self.statuses0
        return sum(grown.values()), sum(n for s, n in grown.items() if s not in ("200", "499"))

    def assert_nothing_refused(self, log: str = "") -> int:
        requests, errors = self.api_counts()
        assert requests > 0, f"the agent sent no {self.api} request\n{log[-3000:]}"
        assert errors == 0, f"{errors} of {requests} {self.api} requests refused\n{log[-3000:]}"
        assert all(d["status"] == 200 for d in self.decisions()), self.decisions()
        return requests


def half_prefilled(serve) -> int:
    """Tokens processed of a prompt whose prefill of what was not cached is at least
    half done, else 0: the backends' /health lists each job's progress. (The agent's
    own instructions and tools are cached by the module's earlier turns: a prompt counted
    half done from its start would be killed before any of its new tokens ran.)"""
    for backend in stats(serve)["backends"]:
        for job in get_json(f"{backend['url']}/health")["engine"]["jobs"]:
            new, done = job["prompt"] - job["cached"], job["processed"] - job["cached"]
            # Not a short side request, and not a prompt whose last chunk ran already.
            if job["phase"] == "prefill" and new >= 1024 and new // 2 <= done < new:
                return job["processed"]
    return 0


def partial_commits(serve) -> float:
    """Commits of prompts cut off mid-prefill, over the backends (a loaded machine may
    still be copying the prefilled part when the job has left the batch)."""
    return sum(metric_sum(request(f"{b['url']}/metrics")[2].decode(),
                          "kvroute_backend_commits_total", path="disconnect_prefill")
               for b in stats(serve)["backends"])


def registry_pending(serve) -> float:
    return sum(metric_sum(request(f"{b['url']}/metrics")[2].decode(),
                          "kvroute_backend_registry_pending")
               for b in stats(serve)["backends"])


def kill_mid_prefill(serve, proc: subprocess.Popen) -> int:
    """SIGKILL the agent once its prompt is half prefilled; the tokens processed by then."""
    try:
        return wait_until(lambda: half_prefilled(serve), 120, interval=0.02,
                          what="the agent's prompt to be half prefilled")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def main_request(decisions: list[dict]) -> dict:
    """The turn's main request: the longest prompt (agents also send short side requests)."""
    assert decisions, "no request was routed"
    return max(decisions, key=lambda d: d["prompt_tokens"])


# -- Claude Code -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def claude_env(serve, tmp_path_factory) -> dict[str, str]:
    env, unset = doc_env("Claude Code", serve.port)
    assert env["ANTHROPIC_BASE_URL"] == serve.url and env["ANTHROPIC_MODEL"] == "qwen-coder"
    home = tmp_path_factory.mktemp("claude-home")
    base = {k: v for k, v in os.environ.items() if k not in unset and not k.startswith("ANTHROPIC")}
    # A home of its own: the test never reads or writes the user's ~/.claude.
    return {**base, **env, "HOME": str(home), "CLAUDE_CONFIG_DIR": str(home / ".claude"),
            "DISABLE_AUTOUPDATER": "1"}


def claude(env: dict, cwd: Path, *args: str, timeout: float = 240) -> dict:
    out = subprocess.run([str(CLAUDE), "-p", "--output-format", "json", *CLAUDE_TRIMS, *args],
                         cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, f"claude exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_claude_code_first_turn_then_a_cached_second_turn(serve, claude_env, tmp_path):
    session = str(uuid.uuid4())
    watch = Watch(serve, "messages")
    first = claude(claude_env, tmp_path, "--session-id", session, "Say hello.")
    assert first["is_error"] is False and DEMO_REPLY in first["result"], first
    watch.assert_nothing_refused()
    turn1 = main_request(watch.decisions("qwen-coder"))

    watch = Watch(serve, "messages")
    second = claude(claude_env, tmp_path, "--resume", session, "Say hello again.")
    assert second["is_error"] is False and DEMO_REPLY in second["result"], second
    watch.assert_nothing_refused()
    turn2 = main_request(watch.decisions("qwen-coder"))
    assert turn2["prompt_tokens"] > turn1["prompt_tokens"]
    assert turn2["cached_tokens"] >= 0.8 * turn2["prompt_tokens"], (turn1, turn2)
    assert turn2["backend"] == turn1["backend"], (turn1, turn2)


def test_claude_code_runs_a_tool_call_and_sends_its_result(serve, claude_env, tmp_path):
    env = {**claude_env, **{k: "bash-coder" for k in claude_env if k.startswith("ANTHROPIC_")
                            and k.endswith("MODEL")}}
    watch = Watch(serve, "messages")
    out = subprocess.run(
        [str(CLAUDE), "-p", "--output-format", "stream-json", "--verbose", "--max-turns", "2",
         "--allowedTools", "Bash", *CLAUDE_TRIMS, "Run the marker command."],
        cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=240)
    events = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    calls = [b for e in events if e.get("type") == "assistant"
             for b in e["message"]["content"] if b.get("type") == "tool_use"]
    results = [b for e in events if e.get("type") == "user"
               for b in e["message"]["content"] if isinstance(b, dict)
               and b.get("type") == "tool_result"]
    assert calls and calls[0]["name"] == "Bash", out.stdout[-3000:]
    assert results and MARKER in json.dumps(results[0]["content"]), out.stdout[-3000:]
    # The model calls its tool every turn: Claude Code stops at --max-turns, by design.
    watch.assert_nothing_refused(out.stdout + out.stderr)
    turns = watch.decisions("bash-coder")
    assert len(turns) >= 2
    # The request that carried the tool result extends the one that made the call.
    after = main_request(turns)
    assert after["cached_tokens"] >= 0.8 * after["prompt_tokens"], turns


def test_claude_code_killed_mid_request_keeps_its_prompt(serve, claude_env, tmp_path):
    # A prompt of its own (a new long user message), so nothing of it is cached yet.
    ask = "Summarize these numbers: " + " ".join(str(i) for i in range(4000, 5000))
    watch = Watch(serve, "messages")
    commits_before = partial_commits(serve)
    proc = subprocess.Popen([str(CLAUDE), "-p", *CLAUDE_TRIMS, ask], cwd=tmp_path,
                            env=claude_env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    processed = kill_mid_prefill(serve, proc)
    # Gone from the backend and from the proxy's own count of requests in flight there,
    # which otherwise makes the retry avoid that backend as busy (route reason "load").
    wait_until(lambda: not any(b["running"] or b["inflight"] for b in stats(serve)["backends"]),
               60, what="the backend and the proxy to let the dropped request go")
    wait_until(lambda: partial_commits(serve) > commits_before, 60,
               what="the prefilled part committed")
    # And advertised: until its keys are in Redis the proxy sends the retry wherever the
    # shared instructions alone are cached.
    wait_until(lambda: registry_pending(serve) == 0, 60, what="the committed keys published")
    assert watch.api_counts()[1] == 0
    again = Watch(serve, "messages")
    claude(claude_env, tmp_path, ask)
    retry = main_request(again.decisions("qwen-coder"))
    # What was prefilled before the kill was committed: the retry starts from it.
    assert retry["cached_tokens"] >= processed, (processed, again.decisions())


# -- Codex CLI ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def codex_home(serve, tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("codex-home")
    config = doc_block("Codex CLI", "toml").replace(DOC_PORT, f"127.0.0.1:{serve.port}")
    assert 'model = "qwen-coder"' in config
    (home / "config.toml").write_text(config)
    (home / "instructions.md").write_text(SHORT_PROMPT + "\n")
    return home


def codex_env(serve, home: Path) -> dict[str, str]:
    env, _ = doc_env("Codex CLI", serve.port)
    assert env == {"KVROUTE_API_KEY": KEY}
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI", "CODEX"))}
    return {**base, **env, "CODEX_HOME": str(home), "HOME": str(home)}


def codex(serve, home: Path, cwd: Path, *args: str, model: str | None = None,
          timeout: float = 240) -> subprocess.CompletedProcess:
    trims = [*CODEX_TRIMS, "-c", f'model_instructions_file="{home / "instructions.md"}"']
    if model:
        trims += ["-m", model]
    return subprocess.run([str(CODEX), "exec", "--skip-git-repo-check", *trims, *args],
                          cwd=cwd, env=codex_env(serve, home), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)


def test_codex_first_turn_then_a_cached_second_turn(serve, codex_home, tmp_path):
    watch = Watch(serve, "responses")
    first = codex(serve, codex_home, tmp_path, "Say hello.")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert DEMO_REPLY in first.stdout, first.stdout[-3000:]
    watch.assert_nothing_refused(first.stderr)
    turn1 = main_request(watch.decisions("qwen-coder"))

    watch = Watch(serve, "responses")
    second = codex(serve, codex_home, tmp_path, "resume", "--last", "Say hello again.")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert DEMO_REPLY in second.stdout
    watch.assert_nothing_refused(second.stderr)
    turn2 = main_request(watch.decisions("qwen-coder"))
    assert turn2["prompt_tokens"] > turn1["prompt_tokens"]
    assert turn2["cached_tokens"] >= 0.8 * turn2["prompt_tokens"], (turn1, turn2)
    assert turn2["backend"] == turn1["backend"], (turn1, turn2)


def test_codex_runs_a_tool_call_and_sends_its_result(serve, codex_home, tmp_path):
    """The exec-coder model calls exec_command on every turn, so Codex would go on
    forever: the test stops it once the call's output has gone back to the model."""
    watch = Watch(serve, "responses")
    proc = subprocess.Popen(
        [str(CODEX), "exec", "--skip-git-repo-check", "--json", *CODEX_TRIMS,
         "-c", f'model_instructions_file="{codex_home / "instructions.md"}"',
         "--dangerously-bypass-approvals-and-sandbox", "-m", "exec-coder",
         "Run the marker command."],
        cwd=tmp_path, env=codex_env(serve, codex_home), stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    seen: list[dict] = []
    try:
        deadline = time.monotonic() + 240
        for line in proc.stdout:
            if line.startswith("{"):
                seen.append(json.loads(line))
            done = [e for e in seen if e.get("type") == "item.completed"
                    and e["item"].get("type") == "command_execution"]
            if (done and len(watch.decisions("exec-coder")) >= 2) or time.monotonic() > deadline:
                break
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    commands = [e["item"] for e in seen if e.get("type") == "item.completed"
                and e["item"].get("type") == "command_execution"]
    assert commands and MARKER in commands[0].get("aggregated_output", ""), seen[-10:]
    watch.assert_nothing_refused()
    turns = watch.decisions("exec-coder")
    assert len(turns) >= 2
    assert turns[1]["cached_tokens"] >= 0.8 * turns[1]["prompt_tokens"], turns


def test_codex_killed_mid_request_keeps_its_prompt(serve, codex_home, tmp_path):
    ask = "Summarize these numbers: " + " ".join(str(i) for i in range(7000, 8000))
    watch = Watch(serve, "responses")
    trims = [*CODEX_TRIMS, "-c", f'model_instructions_file="{codex_home / "instructions.md"}"']
    commits_before = partial_commits(serve)
    proc = subprocess.Popen([str(CODEX), "exec", "--skip-git-repo-check", *trims, ask],
                            cwd=tmp_path, env=codex_env(serve, codex_home),
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    processed = kill_mid_prefill(serve, proc)
    # Gone from the backend and from the proxy's own count of requests in flight there,
    # which otherwise makes the retry avoid that backend as busy (route reason "load").
    wait_until(lambda: not any(b["running"] or b["inflight"] for b in stats(serve)["backends"]),
               60, what="the backend and the proxy to let the dropped request go")
    wait_until(lambda: partial_commits(serve) > commits_before, 60,
               what="the prefilled part committed")
    # And advertised: until its keys are in Redis the proxy sends the retry wherever the
    # shared instructions alone are cached.
    wait_until(lambda: registry_pending(serve) == 0, 60, what="the committed keys published")
    assert watch.api_counts()[1] == 0
    again = Watch(serve, "responses")
    out = codex(serve, codex_home, tmp_path, ask)
    assert out.returncode == 0, out.stderr[-3000:]
    retry = main_request(again.decisions("qwen-coder"))
    assert retry["cached_tokens"] >= processed, (processed, again.decisions())

"""Coding-agent sessions against the real stack: cache-aware vs round-robin routing.

Replays sessions shaped like the two agent clients kvroute serves, through the official
`anthropic` and `openai` Python clients, streaming:

- Claude-Code-like, `POST /v1/messages`: system text blocks with cache_control (the
  billing line first), 22 client tools with JSON-schema `input_schema`, a user message
  of a reminder block and the task; each later turn sends back the model's answer
  with a `tool_use` block, then a user message of its `tool_result` and new text.
- Codex-like, `POST /v1/responses`: developer message items, 22 function tools, user
  items; each later turn sends the whole input again (`store: false`) grown by the
  answer's message item, a `function_call` and its `function_call_output`, and a user
  item.

Every session has a system prompt of its own; the sessions of one shape (a team) share
one tool list. The content is synthetic (seeded word salad of the clients' shapes and
sizes), the same for every policy. Each policy has its own proxy with its own API-key
scope, so no run starts from another's caches.

Per policy and turn index it reports the mean TTFT (client side, to the first content
event), the hit ratio (cached / prompt tokens, from each answer's usage), and the
proxy's predicted cached tokens against the actual ones (the `predicted_tokens` of
the proxy's `/stats` decisions, read after every turn: its ring holds the last 50),
then the cache-aware / round-robin ratios and how sessions spread over backends.
Round-robin predicts nothing (its decisions carry 0), so only cache-aware's
prediction is compared.

By default a session starts once the one before it has had its first answer (`--start
ramp`: a teammate opens a session while the others work, so the tool list is already
cached somewhere); `--start together` starts them all at once, `--stagger` apart.

    python -m bench.bench_agents [--sessions 4] [--shapes claude,codex] [--turns 6]
        [--backends 2] [--policies cache-aware,round-robin] [--start ramp|together]
        [--system-chars 1200] [--tool-chars 60] [--result-chars 400] [--stagger 0.5]
        [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import anthropic
import openai
import orjson
from rich.console import Console
from rich.table import Table

from bench.command import command_line
from kvroute.devtools import demo_model
from tests.harness import BackendProcess, ProxyProcess, fleet, get_json, metric_sum, request

SECRET = "agents"
MODEL = "demo"
SHAPES = ("claude", "codex")

# -- synthetic content ---------------------------------------------------------------
# Seeded word salad with the clients' structure: what matters to routing and caching is
# where the bytes sit (system, tools, history) and how many there are, not what they say.

WORDS = ("file", "path", "command", "output", "module", "test", "change", "branch", "commit",
         "shell", "process", "result", "error", "config", "directory", "project", "function",
         "argument", "value", "option", "request", "session", "buffer", "line", "search",
         "pattern", "edit", "review", "build", "package", "version", "worker", "queue",
         "cache", "token", "prompt", "model", "user", "task", "plan", "step", "tool", "call",
         "schema", "field", "type", "string", "number", "list", "object", "status", "report",
         "always", "never", "before", "after", "when", "only", "each", "every", "first",
         "last", "short", "exact", "careful", "absolute", "relative", "current", "remote",
         "local", "safe", "quickly", "clearly", "read", "write", "run", "check", "keep",
         "return", "send", "stop", "start", "wait", "ask", "show", "note", "prefer", "avoid")
CLAUDE_TOOLS = ("Agent", "Bash", "BashOutput", "Edit", "Glob", "Grep", "KillShell", "LS",
                "MultiEdit", "NotebookEdit", "Read", "SlashCommand", "Task", "TodoWrite",
                "WebFetch", "WebSearch", "Write", "ExitPlanMode", "AskUserQuestion", "Skill",
                "Monitor", "ScheduleWakeup")
CODEX_TOOLS = ("exec_command", "write_stdin", "apply_patch", "view_image", "update_plan",
               "read_file", "list_dir", "grep_files", "get_goal", "create_goal", "update_goal",
               "request_user_input", "spawn_agent", "send_input", "wait_agent", "close_agent",
               "list_mcp_resources", "read_mcp_resource", "search_tool_bm25", "web_fetch",
               "run_tests", "git_status")
PROPS = {"path": "string", "command": "string", "pattern": "string", "query": "string",
         "content": "string", "offset": "integer", "limit": "integer", "timeout": "number",
         "description": "string", "url": "string", "prompt": "string", "recursive": "boolean",
         "glob": "string", "mode": "enum", "target": "string", "message": "string",
         "items": "array", "workdir": "string"}


def sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(7, 15))]
    return words[0].capitalize() + " " + " ".join(words[1:]) + "."


def words(rng: random.Random, chars: int) -> str:
    """One sentence of about `chars` characters."""
    out = [rng.choice(WORDS).capitalize()]
    while sum(len(w) + 1 for w in out) < chars:
        out.append(rng.choice(WORDS))
    return " ".join(out) + "."


def prose(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    while sum(len(s) + 1 for s in out) < chars:
        out.append(sentence(rng))
    return " ".join(out)


def phrase(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))).capitalize()


def properties(rng: random.Random) -> tuple[dict, list[str]]:
    names = rng.sample(sorted(PROPS), rng.randint(1, 2))
    props = {}
    for name in names:
        kind = PROPS[name]
        prop: dict = {"description": phrase(rng, 3, 5)}
        if kind == "enum":
            prop.update(type="string", enum=["fast", "full", "dry-run"])
        elif kind == "array":
            prop.update(type="array", items={"type": "string"})
        else:
            prop["type"] = kind
        props[name] = prop
    return props, names[:1]


def claude_tools(seed: int, chars: int) -> list[dict]:
    rng = random.Random(seed)
    tools = []
    for name in CLAUDE_TOOLS:
        props, required = properties(rng)
        tools.append({"name": name, "description": words(rng, chars), "input_schema": {
            "type": "object", "properties": props, "required": required,
            "additionalProperties": False}})
    return tools


def codex_tools(seed: int, chars: int) -> list[dict]:
    rng = random.Random(seed)
    tools = []
    for name in CODEX_TOOLS:
        props, required = properties(rng)
        tools.append({"type": "function", "name": name, "description": words(rng, chars),
                      "strict": False, "parameters": {
                          "type": "object", "properties": props, "required": required,
                          "additionalProperties": False}})
    return tools


def tool_input(rng: random.Random, schema: dict) -> dict:
    """Arguments for a call: the required field, as a short path or command."""
    name = schema["required"][0]
    kind = schema["properties"][name]["type"]
    if kind == "string":
        return {name: f"src/{rng.choice(WORDS)}/{rng.choice(WORDS)}_{rng.randint(1, 99)}.py"}
    if kind == "array":
        return {name: [rng.choice(WORDS) for _ in range(3)]}
    if kind == "boolean":
        return {name: True}
    return {name: rng.randint(1, 500)}


def tool_output(rng: random.Random, chars: int) -> str:
    """What a tool prints: file lines and log lines."""
    lines: list[str] = []
    while sum(len(x) + 1 for x in lines) < chars:
        lines.append(f"src/{rng.choice(WORDS)}.py:{rng.randint(1, 900)}: "
                     + " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10))))
    return "\n".join(lines)


# -- sessions --------------------------------------------------------------------------


@dataclass
class Turn:
    policy: str
    session: str
    index: int
    started: float  # wall clock, to find the proxy's decision
    backend: str = ""
    reason: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft: float | None = None
    predicted: int | None = None  # the proxy's predicted cached tokens (None: no decision found)
    error: str | None = None


class Session:
    """One agent conversation. `send` streams one turn; `grow` appends what the client
    sends back after it: the answer, a tool call, its result and new user text."""

    shape = ""

    def __init__(self, name: str, seed: int, tools: list[dict], args):
        self.name = name
        self.rng = random.Random(seed)
        self.tools = tools
        self.args = args
        self.id = f"{self.rng.getrandbits(128):032x}"
        self.project = f"{self.rng.choice(WORDS)}-{self.rng.choice(WORDS)}-{self.rng.randint(1, 99)}"

    def task(self, turn: int) -> str:
        return (f"Step {turn}: {sentence(self.rng)} Then {sentence(self.rng).lower()}")

    def call(self, id_prefix: str) -> tuple[str, str, dict]:
        tool = self.rng.choice(self.tools)
        schema = tool.get("input_schema") or tool.get("parameters")
        return (f"{id_prefix}{self.rng.getrandbits(64):016x}", tool["name"],
                tool_input(self.rng, schema))


class ClaudeSession(Session):
    shape = "claude"

    def __init__(self, *a):
        super().__init__(*a)
        self.system = [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.0; "
                                     "cc_entrypoint=cli;"},
            {"type": "text", "text": "You are a coding agent working in the user's terminal.",
             "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": prose(self.rng, self.args.system_chars),
             "cache_control": {"type": "ephemeral"}},
        ]
        reminder = (f"<system-reminder>\nWorking directory: /home/dev/{self.project}\n"
                    f"{prose(self.rng, 200)}\n</system-reminder>")
        self.messages: list[dict] = [{"role": "user", "content": [
            {"type": "text", "text": reminder}, {"type": "text", "text": self.task(0)}]}]

    def body_messages(self) -> list[dict]:
        # Claude Code marks the last block of the conversation for caching, every turn.
        last = self.messages[-1]
        marked = [*last["content"][:-1], {**last["content"][-1],
                                          "cache_control": {"type": "ephemeral"}}]
        return [*self.messages[:-1], {**last, "content": marked}]

    async def send(self, client: anthropic.AsyncAnthropic, turn: Turn) -> str:
        t0 = time.perf_counter()
        stream = await client.messages.create(
            model=MODEL, max_tokens=self.args.max_tokens, system=self.system, tools=self.tools,
            messages=self.body_messages(), stream=True, metadata={"user_id": self.id})
        read_headers(turn, stream.response.headers)
        text = []
        async for event in stream:
            if event.type == "content_block_delta":
                if turn.ttft is None:
                    turn.ttft = time.perf_counter() - t0
                if event.delta.type == "text_delta":
                    text.append(event.delta.text)
            elif event.type == "message_delta":
                u = event.usage
                turn.cached_tokens = u.cache_read_input_tokens or 0
                turn.prompt_tokens = (u.input_tokens or 0) + turn.cached_tokens
        return "".join(text)

    def grow(self, answer: str, turn: int) -> None:
        call_id, name, args = self.call("toolu_")
        content = [{"type": "text", "text": answer}] if answer else []
        self.messages.append({"role": "assistant", "content": [
            *content, {"type": "tool_use", "id": call_id, "name": name, "input": args}]})
        self.messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call_id,
             "content": tool_output(self.rng, self.args.result_chars)},
            {"type": "text", "text": self.task(turn)}]})


class CodexSession(Session):
    shape = "codex"

    def __init__(self, *a):
        super().__init__(*a)
        self.input: list[dict] = [
            developer("You are a coding agent running in a terminal. "
                      + prose(self.rng, self.args.system_chars)),
            developer("<permissions instructions>\nThe sandbox permits reading files; network "
                      "access is restricted. Approval policy: never.\n</permissions instructions>"),
            user(f"<environment_context>\n  <cwd>/home/dev/{self.project}</cwd>\n  <shell>bash"
                 "</shell>\n</environment_context>"),
            user(self.task(0)),
        ]

    async def send(self, client: openai.AsyncOpenAI, turn: Turn) -> str:
        t0 = time.perf_counter()
        stream = await client.responses.create(
            model=MODEL, input=self.input, tools=self.tools, tool_choice="auto",
            parallel_tool_calls=True, store=False, stream=True, reasoning={"summary": "auto"},
            include=["reasoning.encrypted_content"], prompt_cache_key=self.id,
            max_output_tokens=self.args.max_tokens)
        read_headers(turn, stream.response.headers)
        text = []
        async for event in stream:
            if event.type in ("response.output_text.delta",
                              "response.function_call_arguments.delta"):
                if turn.ttft is None:
                    turn.ttft = time.perf_counter() - t0
                if event.type == "response.output_text.delta":
                    text.append(event.delta)
            elif event.type in ("response.completed", "response.incomplete"):
                u = event.response.usage
                turn.prompt_tokens = u.input_tokens
                turn.cached_tokens = u.input_tokens_details.cached_tokens or 0
        return "".join(text)

    def grow(self, answer: str, turn: int) -> None:
        call_id, name, args = self.call("call_")
        self.input += [
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": answer}]},
            {"type": "function_call", "call_id": call_id, "name": name,
             "arguments": orjson.dumps(args).decode()},
            {"type": "function_call_output", "call_id": call_id,
             "output": tool_output(self.rng, self.args.result_chars)},
            user(self.task(turn)),
        ]


def developer(text: str) -> dict:
    return {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": text}]}


def user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def read_headers(turn: Turn, headers) -> None:
    turn.backend = headers.get("x-kvroute-backend", "")
    turn.reason = headers.get("x-kvroute-route-reason", "")


def make_sessions(args) -> list[Session]:
    """Shapes cycle in the order given; seeds are fixed, so every policy replays the same
    sessions."""
    shapes = args.shapes.split(",")
    tools = {"claude": claude_tools(1, args.tool_chars), "codex": codex_tools(2, args.tool_chars)}
    out: list[Session] = []
    for i in range(args.sessions):
        shape = shapes[i % len(shapes)]
        cls = ClaudeSession if shape == "claude" else CodexSession
        out.append(cls(f"{shape}-{i // len(shapes)}", 100 + i, tools[shape], args))
    return out


# -- one policy's run -------------------------------------------------------------------


class Decisions:
    """The proxy's routing decisions, read from /stats after every turn (its ring holds
    the last 50; at most `sessions` turns end between two reads)."""

    def __init__(self, url: str):
        self.url = url
        self.seen: dict[tuple, dict] = {}
        self.lock = asyncio.Lock()

    async def poll(self) -> None:
        async with self.lock:
            stats = await asyncio.to_thread(get_json, self.url + "/stats")
        for d in stats["decisions"]:
            self.seen[(d["t"], d["backend"], d["prompt_tokens"], d["cached_tokens"])] = d

    def match(self, turns: list[Turn]) -> None:
        """Each turn's decision: same backend, prompt and cached tokens, nearest in time."""
        free = list(self.seen.values())
        for turn in sorted(turns, key=lambda t: t.started):
            same = [d for d in free if d["backend"] == turn.backend
                    and d["prompt_tokens"] == turn.prompt_tokens
                    and d["cached_tokens"] == turn.cached_tokens]
            if same:
                d = min(same, key=lambda d: abs(d["t"] - turn.started))
                free.remove(d)
                turn.predicted = d["predicted_tokens"]


async def run_session(s: Session, client, policy: str, after: asyncio.Event | None,
                      delay: float, started: asyncio.Event, args, decisions: Decisions,
                      turns: list[Turn]) -> None:
    """Starts `delay` s after `after` (the previous session's first answer) is set, or
    after the start when None; sets `started` once its own first turn has ended."""
    if after is not None:
        await after.wait()
    await asyncio.sleep(delay)
    try:
        for i in range(args.turns):
            turn = Turn(policy, s.name, i, time.time())
            turns.append(turn)
            try:
                answer = await s.send(client, turn)
            except (anthropic.APIError, openai.APIError) as exc:
                turn.error = f"{type(exc).__name__}: {exc}"[:300]
                return
            started.set()
            await decisions.poll()
            s.grow(answer, i + 1)
    finally:
        started.set()


async def run_policy(proxy: ProxyProcess, policy: str, key: str, args) -> tuple[list[Turn], float, dict]:
    decisions = Decisions(proxy.url)
    clients = {
        "claude": anthropic.AsyncAnthropic(base_url=proxy.url, api_key=key, max_retries=0,
                                           timeout=600),
        "codex": openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=key, max_retries=0,
                                    timeout=600),
    }
    turns: list[Turn] = []
    sessions = make_sessions(args)
    firsts = [asyncio.Event() for _ in sessions]
    ramp = args.start == "ramp"
    t0 = time.perf_counter()
    # Ramp: a session starts once the one before it has had its first answer, as a
    # teammate opens a session while the others work (its prefix is advertised by then).
    # Together: all at once, `stagger` apart.
    await asyncio.gather(*(
        run_session(s, clients[s.shape], policy,
                    firsts[i - 1] if ramp and i else None,
                    args.stagger if ramp else i * args.stagger, firsts[i], args, decisions, turns)
        for i, s in enumerate(sessions)))
    seconds = time.perf_counter() - t0
    await decisions.poll()
    decisions.match(turns)
    for c in clients.values():
        await c.close()
    text = request(proxy.url + "/metrics")[2].decode()
    metrics = {name: metric_sum(text, f"kvroute_proxy_{name}_total", model=MODEL)
               for name in ("predicted_cached_tokens", "cached_tokens", "prompt_tokens")}
    return turns, seconds, metrics


# -- report -----------------------------------------------------------------------------


def ok(turns: list[Turn]) -> list[Turn]:
    return [t for t in turns if t.error is None and t.ttft is not None]


def hit_ratio(turns: list[Turn]) -> float:
    prompt = sum(t.prompt_tokens for t in turns)
    return sum(t.cached_tokens for t in turns) / prompt if prompt else 0.0


def pred_ratio(turns: list[Turn]) -> str:
    known = [t for t in turns if t.predicted is not None]
    actual, predicted = sum(t.cached_tokens for t in known), sum(t.predicted for t in known)
    if not actual:
        return "inf" if predicted else "-"
    return f"{predicted / actual:.2f}"


def mean_ms(turns: list[Turn]) -> float:
    return statistics.mean(t.ttft for t in turns) * 1000 if turns else 0.0


def table(title: str, headers: list[str], rows: list[list[str]]) -> tuple[Table, str]:
    t = Table(title=title)
    for h in headers:
        t.add_column(h, justify="right")
    for r in rows:
        t.add_row(*r)
    md = "\n".join(["| " + " | ".join(headers) + " |", "|" + "---:|" * len(headers),
                    *("| " + " | ".join(r) + " |" for r in rows)])
    return t, md


def per_turn_rows(policy: str, turns: list[Turn], n_turns: int) -> list[list[str]]:
    rows = []
    for i in range(n_turns):
        ts = [t for t in ok(turns) if t.index == i]
        if not ts:
            continue
        predicted = sum(t.predicted or 0 for t in ts) if policy == "cache-aware" else None
        rows.append([policy, str(i), str(len(ts)),
                     f"{statistics.mean(t.prompt_tokens for t in ts):.0f}",
                     f"{mean_ms(ts):.0f}", f"{hit_ratio(ts):.3f}",
                     str(predicted) if predicted is not None else "-",
                     str(sum(t.cached_tokens for t in ts)),
                     pred_ratio(ts) if policy == "cache-aware" else "-"])
    return rows


def spread(turns: list[Turn], backends: list[str]) -> dict[str, tuple[str, str]]:
    """Session -> the backend (index) of each turn, e.g. '0 0 1 1 1 1', and the proxy's
    route reasons with their counts."""
    out: dict[str, list[Turn]] = {}
    for t in sorted(turns, key=lambda t: (t.session, t.index)):
        out.setdefault(t.session, []).append(t)
    return {s: (" ".join(str(backends.index(t.backend)) if t.backend in backends else "x"
                         for t in ts), reasons(ts)) for s, ts in out.items()}


def reasons(turns: list[Turn]) -> str:
    counts = collections.Counter(t.reason or "error" for t in turns)
    return ", ".join(f"{r} {n}" for r, n in sorted(counts.items()))


def report(console: Console, runs: dict, args, backends: list[str]) -> None:
    mds = []
    rows = []
    for policy, (turns, _, _) in runs.items():
        rows += per_turn_rows(policy, turns, args.turns)
    t, md = table("per turn index (over sessions)", [
        "policy", "turn", "requests", "prompt tok", "TTFT ms", "hit ratio", "predicted",
        "actual cached", "pred/actual"], rows)
    console.print(t)
    mds.append(md)

    rows = []
    for policy, (turns, seconds, metrics) in runs.items():
        good = ok(turns)
        later = [t for t in good if t.index > 0]
        per_backend = "/".join(str(sum(t.backend == b for t in good)) for b in backends)
        ca = policy == "cache-aware"
        rows.append([
            policy, str(len(good)), str(len(turns) - len(good)), f"{mean_ms(good):.0f}",
            f"{statistics.median(t.ttft for t in good) * 1000:.0f}" if good else "-",
            f"{mean_ms(later):.0f}", f"{hit_ratio(good):.3f}", f"{hit_ratio(later):.3f}",
            pred_ratio(good) if ca else "-", pred_ratio(later) if ca else "-",
            (f"{metrics['predicted_cached_tokens'] / metrics['cached_tokens']:.2f}"
             if ca and metrics["cached_tokens"] else "-"),
            per_backend, f"{seconds:.0f}"])
    t, md = table("per policy", [
        "policy", "requests", "errors", "TTFT mean ms", "TTFT p50 ms", "TTFT mean ms (turns>=1)",
        "hit ratio", "hit ratio (turns>=1)", "pred/actual", "pred/actual (turns>=1)",
        "pred/actual (/metrics)", "requests per backend", "wall s"], rows)
    console.print(t)
    mds.append(md)

    rows = []
    for policy, (turns, _, _) in runs.items():
        for shape in sorted({t.session.split("-")[0] for t in turns}):
            ts = [t for t in ok(turns) if t.session.startswith(shape + "-")]
            later = [t for t in ts if t.index > 0]
            ca = policy == "cache-aware"
            rows.append([policy, shape, str(len(ts)), f"{mean_ms(ts):.0f}",
                         f"{hit_ratio(ts):.3f}", f"{hit_ratio(later):.3f}",
                         pred_ratio(ts) if ca else "-"])
    t, md = table("per policy and session shape", [
        "policy", "shape", "requests", "TTFT mean ms", "hit ratio", "hit ratio (turns>=1)",
        "pred/actual"], rows)
    console.print(t)
    mds.append(md)

    if "cache-aware" in runs and "round-robin" in runs:
        ca, rr = ok(runs["cache-aware"][0]), ok(runs["round-robin"][0])
        rows = []
        for i in [*range(args.turns), None]:
            a = [t for t in ca if i is None or t.index == i]
            b = [t for t in rr if i is None or t.index == i]
            if a and b:
                rows.append(["all" if i is None else str(i),
                             f"{mean_ms(a) / mean_ms(b):.2f}",
                             f"{hit_ratio(a):.3f}", f"{hit_ratio(b):.3f}"])
        t, md = table("cache-aware / round-robin", [
            "turn", "TTFT ratio (CA/RR)", "hit ratio CA", "hit ratio RR"], rows)
        console.print(t)
        mds.append(md)

    rows = []
    for policy, (turns, _, _) in runs.items():
        for s, (line, why) in spread(turns, backends).items():
            rows.append([policy, s, line, why])
    t, md = table("backend of each turn, per session (backend index)",
                  ["policy", "session", "turns 0..", "route reasons"], rows)
    console.print(t)
    mds.append(md)
    for policy, (turns, _, _) in runs.items():
        for t in turns:
            if t.error:
                console.print(f"[red]{policy} {t.session} turn {t.index}: {t.error}")
        missing = [t for t in ok(turns) if t.predicted is None]
        if missing:
            console.print(f"[yellow]{policy}: {len(missing)} turns without a matching "
                          "/stats decision")
    print("\n\n".join(mds))


# -- the fleet --------------------------------------------------------------------------


def warm_up(backends: list[BackendProcess]) -> None:
    """One prompt per backend, straight to it: the first prefill of a process pays for
    its kernels and allocations, which would land on whichever policy ran first."""
    rng = random.Random(0)
    for b in backends:
        status, _, data = request(b.url + "/v1/completions", "POST", {
            "model": MODEL, "prompt": prose(rng, 3000), "max_tokens": 4}, timeout=120)
        assert status == 200, data[:300]


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_agents", description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="cache-aware,round-robin")
    ap.add_argument("--backends", type=int, default=2)
    ap.add_argument("--sessions", type=int, default=4, help="concurrent sessions, shapes cycled")
    ap.add_argument("--turns", type=int, default=6,
                    help="turns per session (each adds ~380 tokens at the default sizes)")
    ap.add_argument("--system-chars", type=int, default=1200, help="each session's system prompt")
    ap.add_argument("--tool-chars", type=int, default=60, help="description of each of 22 tools")
    ap.add_argument("--result-chars", type=int, default=400, help="each tool result")
    ap.add_argument("--shapes", default="claude,codex",
                    help="session shapes, cycled (claude: /v1/messages, codex: /v1/responses)")
    ap.add_argument("--start", choices=("ramp", "together"), default="ramp",
                    help="ramp: each session after the previous one's first answer; "
                         "together: all at once")
    ap.add_argument("--stagger", type=float, default=0.5,
                    help="seconds between session starts (ramp: after that first answer)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--cache-bytes", default="2GiB")
    ap.add_argument("--context", type=int, default=0,
                    help="context length of the demo model (0: its default, 8192 tokens: "
                         "enough for ~10 turns at the default sizes)")
    args = ap.parse_args()
    if not set(args.shapes.split(",")) <= set(SHAPES):
        ap.error(f"--shapes takes {', '.join(SHAPES)}")
    console = Console(width=None if sys.stdout.isatty() else 200)
    policies = args.policies.split(",")
    keys = {p: f"sk-bench-{p}" for p in policies}
    runs: dict = {}
    with tempfile.TemporaryDirectory(prefix="kvroute-agents-") as tmp:
        work = Path(tmp)
        model = (demo_model.build(work / "model", "text", context=args.context) if args.context
                 else demo_model.ensure("text", cache_dir=work / "models"))

        def backends(redis_url: str) -> list[BackendProcess]:
            return [BackendProcess(model, MODEL, work, backend_id=f"agents-{i}", extra=[
                "--redis-url", redis_url, "--secret", SECRET, "--cache-bytes", args.cache_bytes,
                "--log-level", "warning"]) for i in range(args.backends)]

        def proxies(redis_url: str) -> list[ProxyProcess]:
            # A scope per policy: its sessions never meet another run's caches.
            return [ProxyProcess(redis_url, work, ["--secret", SECRET, "--policy", p,
                                                   "--api-key", f"{keys[p]}:{p}",
                                                   "--log-level", "warning"])
                    for p in policies]

        with fleet(backends, proxies) as f:
            ids = sorted(f["backends"])
            warm_up(list(f["backends"].values()))
            for policy, proxy in zip(policies, f["proxies"]):
                runs[policy] = asyncio.run(run_policy(proxy, policy, keys[policy], args))
                turns = runs[policy][0]
                console.print(f"{policy}: {len(ok(turns))}/{len(turns)} turns in "
                              f"{runs[policy][1]:.0f} s")
    console.print(f"command: {command_line()}")
    console.print(f"machine: {platform.machine()} {platform.system()} {platform.release()}, "
                  f"{os.cpu_count()} cores, python {platform.python_version()}; "
                  f"{args.backends} backends of the demo model, {args.sessions} sessions x "
                  f"{args.turns} turns")
    report(console, runs, args, ids)
    return 0


if __name__ == "__main__":
    sys.exit(main())

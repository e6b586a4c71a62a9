"""Prompt-cache capacity with shared prefixes: a team of agent sessions on one backend.

`sessions` conversations send one long system prompt (the team's agent prompt) and a
question of their own, then a second turn. Measured on one backend with the demo
model: the bytes its store holds after turn 1 (and what the entries would hold
unshared), per conversation, and the turn-2 hit ratio (turns whose turn-1 prompt was
still cached whole) under a RAM budget of `budget` whole conversations. With `--disk`
the backend has a disk tier too: its bytes after turn 1, and the hit ratio then
counts restores.

`--code DIR` runs the backend from another kvroute checkout (e.g. one before the paged
store) for a "before" row; `--mlx-lm-server` adds a row for mlx_lm.server's prompt
cache under the same budget.

    python -m bench.bench_sharing --sessions 10 --system-tokens 3000 --budget 2 \
        --code /path/to/older/checkout --mlx-lm-server
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.command import command_line

SENTENCE = ("You are one of the team's coding agents. Follow the plan, cite files by path, keep "
            "answers short, and never invent an API; the repository uses Python and MLX. ")


def ask(backend, messages: list[dict], model: str = "demo") -> dict:
    from tests.harness import post_json

    status, body = post_json(backend.url + "/v1/chat/completions",
                             {"model": model, "messages": messages, "max_tokens": 16,
                              "temperature": 0})
    assert status == 200, body
    return body


def sessions_of(args) -> list[list[dict]]:
    system = SENTENCE * max(1, args.system_tokens // 75)  # ~75 demo tokens a sentence
    return [[{"role": "system", "content": system},
             {"role": "user", "content": f"Session {i}: what is step {i} of the plan?"}]
            for i in range(args.sessions)]


def two_turns(server, sessions: list[list[dict]], model: str = "demo",
              between: Any = None) -> tuple[list[dict], list[dict]]:
    """Turn 1 of every session, `between()`, then turn 2 of every session."""
    firsts = []
    for messages in sessions:
        firsts.append(ask(server, messages, model))
        messages += [{"role": "assistant", "content": firsts[-1]["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "And who reviews it?"}]
    if between is not None:
        between()
    return firsts, [ask(server, messages, model) for messages in sessions]


def hit_ratio(firsts: list[dict], seconds: list[dict]) -> float:
    return sum(s["usage"]["prompt_tokens_details"]["cached_tokens"] >= f["usage"]["prompt_tokens"] - 1
               for f, s in zip(firsts, seconds)) / len(firsts)


class MlxLmServer:
    """mlx_lm.server on the same model, for its prompt cache (LRUPromptCache)."""

    def __init__(self, model: str, cache_bytes: int, tmp: Path):
        from tests.harness import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(tmp / "mlx_lm_server.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlx_lm.server", "--model", model, "--port", str(self.port),
             "--prompt-cache-bytes", str(cache_bytes)], stdout=self.log, stderr=subprocess.STDOUT)

    def start(self) -> None:
        from tests.harness import request, wait_until

        wait_until(lambda: request(self.url + "/v1/models", timeout=2)[0] == 200, 90,
                   what="mlx_lm.server")

    def rss(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def run_mlx_lm_server(model: str, args, tmp: Path, budget: int) -> list[str]:
    """The same two turns against mlx_lm.server with `--prompt-cache-bytes` = the budget;
    what it holds from its own process memory (RSS after turn 1 minus RSS after one
    unrelated warm-up request)."""
    server = MlxLmServer(model, budget, tmp)
    server.start()
    try:
        ask(server, [{"role": "user", "content": "Warm up."}], "default_model")
        before, held = server.rss(), {}
        firsts, seconds = two_turns(server, sessions_of(args), "default_model",
                                    lambda: held.setdefault("rss", server.rss()))
    finally:
        server.stop()
    grown = held["rss"] - before
    return [str(firsts[0]["usage"]["prompt_tokens"]), "", f"{budget / 1e6:.2f}", "",
            f"{grown / 1e6:.2f} (RSS)", "", "", f"{hit_ratio(firsts, seconds):.2f}", "—"]


def run(model: str, code: str | None, args, tmp: Path) -> list[str]:
    from tests.harness import BackendProcess, wait_until

    # PYTHONSAFEPATH: `-m` would put the working folder (this checkout) first on the path.
    env = {"PYTHONPATH": code, "PYTHONSAFEPATH": "1"} if code else {}
    sessions = sessions_of(args)
    # One whole conversation's bytes, alone on a backend, sets the budget.
    one = BackendProcess(model, "demo", tmp, ["--prefill-step", "256"], env=env, backend_id="one")
    one.start()
    try:
        ask(one, sessions[0])
        per_conversation = one.health()["cache"]["bytes"]
    finally:
        one.stop()
    budget = args.budget * per_conversation
    disk_flags = ["--disk-cache-dir", str(tmp / "disk")] if args.disk else []
    backend = BackendProcess(model, "demo", tmp, ["--prefill-step", "256", "--cache-bytes",
                                                  str(budget), *disk_flags], env=env,
                             backend_id="team")
    backend.start()
    held: dict = {"disk": {"bytes": 0}}

    def after_turn_1() -> None:
        held["cache"] = backend.health()["cache"]
        if args.disk:
            wait_until(lambda: backend.health()["disk"]["write_queue"] == 0, 60, what="disk writes")
            time.sleep(1)  # the last write leaves the queue before its file is in place
            held["disk"] = backend.health()["disk"]

    try:
        firsts, seconds = two_turns(backend, sessions, between=after_turn_1)
    finally:
        backend.stop()
    cache, disk = held["cache"], held["disk"]
    prompt = firsts[0]["usage"]["prompt_tokens"]
    unshared = cache.get("bytes_unshared", cache["bytes"])
    return [str(prompt), f"{per_conversation / 1e6:.2f}", f"{budget / 1e6:.2f}",
            str(cache["entries"]), f"{cache['bytes'] / 1e6:.2f}", f"{unshared / 1e6:.2f}",
            f"{cache['bytes'] / max(cache['entries'], 1) / 1e6:.3f}",
            f"{hit_ratio(firsts, seconds):.2f}", f"{disk['bytes'] / 1e6:.2f}" if args.disk else "—"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=10)
    ap.add_argument("--system-tokens", type=int, default=3000, help="about; the demo tokenizer's")
    ap.add_argument("--budget", type=float, default=2.0, help="RAM budget in whole conversations")
    ap.add_argument("--disk", action="store_true", help="give the backend a disk tier")
    ap.add_argument("--mlx-lm-server", action="store_true",
                    help="a row for mlx_lm.server (--prompt-cache-bytes = the budget)")
    ap.add_argument("--code", action="append", default=[],
                    help="another kvroute checkout to run as a row (repeatable)")
    args = ap.parse_args()
    from kvroute.devtools import demo_model

    model = str(demo_model.ensure("text"))
    console = Console(width=200)
    console.print(f"{command_line()} · {platform.machine()}, {os.cpu_count()} cores")
    table = Table(title=f"{args.sessions} sessions sharing a system prompt, one backend, budget "
                        f"{args.budget:g} whole conversations")
    for col in ("code", "prompt tokens", "one conversation MB", "budget MB", "entries after turn 1",
                "held MB", "unshared MB", "held MB / entry", "turn-2 hit ratio", "disk MB"):
        table.add_column(col, justify="right")
    budget = 0
    for code in [None, *args.code]:
        with tempfile.TemporaryDirectory(prefix="kvr-share-") as tmp:
            row = run(model, code, args, Path(tmp))
            budget = budget or int(float(row[2]) * 1e6)
            table.add_row(code or "this checkout", *row)
    if args.mlx_lm_server:
        with tempfile.TemporaryDirectory(prefix="kvr-share-") as tmp:
            table.add_row("mlx_lm.server", *run_mlx_lm_server(model, args, Path(tmp), budget))
    console.print(table)


if __name__ == "__main__":
    main()

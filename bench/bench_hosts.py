"""Routing across machines: 2 hosts x 2 backends against 1 host x 4 backends.

Each host is a network namespace of this machine (its own address, ports and
processes) running its own `kvroute serve` with the demo model, behind one
three-master Redis Cluster on the bridge between them: the set-up of
tests/test_two_hosts.py (tests/harness/netns.py). Needs root and iproute2.

The same workload runs on both layouts: C conversations in G groups (a group's
conversations share a long system prompt, as a team's do), T turns each. Turns go in
waves: a wave sends every conversation's next turn at once, each to a proxy picked at
random (with 2 hosts, either host's; with 1, its own), so the first turns of a group
arrive together, through both proxies, before any of them is cached. After each wave
every proxy's `/stats` gives its routing decisions (`predicted_tokens`: what the
proxy expected the backend to hold of the prompt; `cached_tokens`: what the backend
reported).

Per layout it reports the hit ratio (cached / prompt tokens, from each answer's
usage; all turns, and turns after the first) and routing precision: predicted /
actual cached tokens (each answer matched to its proxy's decision; all turns, turns
after the first, and from the proxies' /metrics counters), the share of requests
predicted within 10 % of their prompt, and how many were off by more, on first and
on later turns; then the routing reasons, the requests per backend and, with 2 hosts,
the share of turns served by a backend on the other host than the proxy that took
them.

    python -m bench.bench_hosts [--conversations 16] [--groups 4] [--turns 5] [--repeat 1]
        [--show-misses]
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import openai
from rich.console import Console
from rich.table import Table

from bench.command import command_line
from kvroute.devtools import demo_model
from tests.harness import get_json, metric_sum, request
from tests.harness.netns import Machines, machines, unavailable

LAYOUTS = {"2 hosts x 2": {"hosta": 2, "hostb": 2}, "1 host x 4": {"solo": 4}}
TOPICS = ["the harbour", "the orchard", "the library", "the workshop", "the station", "the market"]


@dataclass
class Answer:
    conversation: int
    turn: int
    proxy: str  # the host whose proxy took it
    backend: str = ""
    prompt: int = 0
    cached: int = 0
    reply: str = ""
    error: str = ""
    predicted: int | None = None  # the proxy's decision (None: not found in its /stats)
    reason: str = ""


@dataclass
class Run:
    layout: str
    answers: list[Answer] = field(default_factory=list)
    predicted_metric: float = 0.0
    cached_metric: float = 0.0
    seconds: float = 0.0


def system_prompt(group: int, nonce: str, chars: int) -> str:
    text = (f"[{nonce}] You are the assistant of team {group}. Their handbook follows. "
            + " ".join(f"Rule {i}: keep {TOPICS[(group + i) % len(TOPICS)]} tidy and note every "
                       f"change in the log book before the end of the day." for i in range(200)))
    return text[:chars]


def send(base: str, messages: list[dict], answer: Answer) -> Answer:
    try:
        with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                           timeout=300) as client:
            raw = client.chat.completions.with_raw_response.create(
                model="demo", messages=messages, max_tokens=16, temperature=0)
        parsed = raw.parse()
        answer.backend = raw.headers["x-kvroute-backend"]
        answer.prompt = parsed.usage.prompt_tokens
        answer.cached = parsed.usage.prompt_tokens_details.cached_tokens
        answer.reply = parsed.choices[0].message.content
    except openai.APIError as exc:
        answer.error = repr(exc)
    return answer


def new_decisions(fleet: Machines, seen: dict[str, float]) -> list[dict]:
    """Each proxy's decisions since the last call (its /stats keeps the newest 50)."""
    out = []
    for host in fleet.serves:
        got = [d for d in get_json(fleet.proxy(host) + "/stats")["decisions"]
               if d["t"] > seen.get(host, 0.0)]
        if got:
            seen[host] = max(d["t"] for d in got)
        out += [{**d, "proxy": host} for d in got]
    return out


def match(answers: list[Answer], decisions: list[dict]) -> None:
    """Each answer's routing decision: the one of its proxy with its backend and token
    counts (a wave's answers differ in those)."""
    for a in answers:
        for d in decisions:
            if (d["proxy"], d["backend"], d["prompt_tokens"], d["cached_tokens"]) == \
                    (a.proxy, a.backend, a.prompt, a.cached):
                a.predicted, a.reason = d["predicted_tokens"], d["reason"]
                decisions.remove(d)
                break


def workload(fleet: Machines, run: Run, args, rng: random.Random) -> None:
    nonce = f"{run.layout}-{rng.random():.6f}"
    conversations = []
    for c in range(args.conversations):
        conversations.append([{"role": "system",
                               "content": system_prompt(c % args.groups, nonce, args.system_chars)}])
    hosts = list(fleet.serves)
    seen: dict[str, float] = {}
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.conversations) as pool:
        for turn in range(args.turns):
            jobs = []
            for c, messages in enumerate(conversations):
                messages.append({"role": "user", "content": f"Member {c}, question {turn}: what "
                                 f"about {TOPICS[(c + turn) % len(TOPICS)]} this week?"})
                host = rng.choice(hosts)
                jobs.append(pool.submit(send, fleet.proxy(host), list(messages),
                                        Answer(c, turn, host)))
            wave = [job.result() for job in jobs]
            for c, answer in enumerate(wave):
                conversations[c].append({"role": "assistant", "content": answer.reply or "..."})
            match(wave, new_decisions(fleet, seen))
            run.answers += wave
    run.seconds = time.perf_counter() - t0
    for host in hosts:
        text = request(fleet.proxy(host) + "/metrics")[2].decode()
        run.predicted_metric += metric_sum(text, "kvroute_proxy_predicted_cached_tokens_total")
        run.cached_metric += metric_sum(text, "kvroute_proxy_cached_tokens_total")


def ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b else "-"


def off(a: Answer) -> bool:
    return abs(a.predicted - a.cached) > 0.1 * a.prompt


def row(run: Run) -> list[str]:
    ok = [a for a in run.answers if not a.error]
    known = [a for a in ok if a.predicted is not None]
    later = [a for a in known if a.turn > 0]

    def hit(answers: list[Answer]) -> str:
        return ratio(sum(a.cached for a in answers), sum(a.prompt for a in answers))

    def precision(answers: list[Answer]) -> str:
        return ratio(sum(a.predicted for a in answers), sum(a.cached for a in answers))

    reasons = collections.Counter(a.reason for a in known)
    per_backend = collections.Counter(a.backend for a in ok)
    crossed = sum(a.backend.split("-", 1)[0] != a.proxy for a in ok)
    return [run.layout, str(len(run.answers)), str(len(run.answers) - len(ok)), hit(ok),
            hit([a for a in ok if a.turn > 0]), precision(known), precision(later),
            ratio(run.predicted_metric, run.cached_metric),
            f"{sum(not off(a) for a in known) / len(known):.3f}" if known else "-",
            f"{sum(off(a) for a in known if a.turn == 0)} / {sum(off(a) for a in later)}",
            f"{len(known)}/{len(ok)}", ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())),
            "/".join(str(v) for _, v in sorted(per_backend.items())),
            f"{crossed / len(ok):.2f}" if len(LAYOUTS[run.layout]) > 1 and ok else "-"]


HEADERS = ["layout", "requests", "errors", "hit ratio", "hit ratio (turns>=1)", "pred/actual",
           "pred/actual (turns>=1)", "pred/actual (/metrics)", "within 10% of the prompt",
           "off by more: turn 0 / later", "decisions matched", "route reasons",
           "requests per backend", "served across hosts"]


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_hosts", description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--system-chars", type=int, default=3000)
    ap.add_argument("--cache-bytes", default="512MiB")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each layout, alternating")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--show-misses", action="store_true",
                    help="list each decision predicted more than 10%% of its prompt off")
    args = ap.parse_args()
    reason = unavailable()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    console = Console(width=250)
    workdir = Path(tempfile.mkdtemp(prefix="kvr-bench-hosts-"))
    model = str(demo_model.ensure("text", cache_dir=workdir / "models"))
    rng = random.Random(args.seed)
    runs = []
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for i in range(args.repeat):
        for layout, replicas in LAYOUTS.items():
            configs = {host: {"models": [{"path": model, "alias": "demo", "replicas": n,
                                          "cache_bytes": args.cache_bytes,
                                          "disk_cache_dir": str(workdir / f"{i}-{host}-disk")}]}
                       for host, n in replicas.items()}
            logs = workdir / f"{i}-{layout.replace(' ', '')}"
            logs.mkdir()
            with machines(configs, logs, backends=sum(replicas.values())) as fleet:
                run = Run(layout)
                workload(fleet, run, args, random.Random(rng.random()))
                runs.append(run)
                console.print(f"{layout}: {len(run.answers)} requests in {run.seconds:.1f}s")
    table = Table(title="2 hosts x 2 backends vs 1 host x 4 backends (cache-aware)")
    for h in HEADERS:
        table.add_column(h)
    for run in runs:
        table.add_row(*row(run))
        for a in run.answers if args.show_misses else []:
            if a.predicted is not None and off(a):
                console.print(f"{run.layout}: turn {a.turn} of {a.conversation}: {a.proxy} -> "
                              f"{a.backend} {a.reason}: predicted {a.predicted}, cached {a.cached} "
                              f"of {a.prompt}", highlight=False)
    console.print(table)
    console.print("| " + " | ".join(HEADERS) + " |\n|" + "---|" * len(HEADERS))
    for run in runs:
        console.print("| " + " | ".join(row(run)) + " |", soft_wrap=True)
    console.print(f"command: {command_line()}")
    console.print(f"machine: {platform.machine()} {platform.system()} {platform.release()}, "
                  f"{os.cpu_count()} cores, python {platform.python_version()}, "
                  f"load average {os.getloadavg()[0]:.1f} at the end; started {started}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a backend's threads spent their time: a summary of `bench_hw --profile` files.

`bench_hw --profile DIR` leaves, per backend and part, py-spy's raw (collapsed) stacks
of every thread (`*-all.txt`, idle threads too) and of the GIL's holder only
(`*-gil.txt`). This prints, for each file, each thread's share of the samples (by its
role: the engine thread, the disk writer and readers, the event loop) and the
functions where most of it was spent, the deepest kvroute or mlx-lm frame of each
sample (a stack's leaf is often a C call with no name of ours):

    python -m bench.profile_summary DIR [--top 12] [--match decodes]

A thread's samples in the `all` file but not in the `gil` file at a line of Python are
its waits for the GIL.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict
from pathlib import Path

# A thread's role by its name (py-spy writes `thread (TID): NAME` first in each stack).
ROLES = (
    ("engine", "kvroute-engine"),
    ("disk writer", "kvroute-disk-write"),
    ("disk reader", "kvroute-disk-"),
    ("event loop", "MainThread"),
    ("worker", "uvloop_"),
)
OURS = re.compile(r"\((?:.*/)?(kvroute/[^:)]+|mlx_lm/[^:)]+):(\d+)\)")


def parse(path: Path) -> list[tuple[str, list[str], int]]:
    """(thread id, frames outermost first, samples) per line of a py-spy raw file."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread = next((f for f in frames if f.startswith("thread ")), "?")
        frames = [f for f in frames if not f.startswith(("thread ", "process "))]
        out.append((thread, frames, int(count)))
    return out


def role(thread: str) -> str:
    name = thread.partition(": ")[2]
    return next((role for role, prefix in ROLES if name.startswith(prefix)), "other")


def ours(frames: list[str]) -> str:
    """The deepest frame of kvroute or mlx-lm, with the leaf's name where it is not ours."""
    for i in range(len(frames) - 1, -1, -1):
        m = OURS.search(frames[i])
        if m:
            name = frames[i].split(" (")[0]
            leaf = "" if i == len(frames) - 1 else " > " + frames[-1].split(" (")[0]
            return f"{name} ({m.group(1)}:{m.group(2)}){leaf}"
    return frames[-1] if frames else "?"


def summary(path: Path, top: int) -> str:
    rows = parse(path)
    total = sum(n for _, _, n in rows)
    threads: dict[str, Counter] = defaultdict(Counter)
    for thread, frames, n in rows:
        threads[thread][ours(frames)] += n
    lines = [f"## {path.name}: {total} samples"]
    for thread, where in sorted(threads.items(), key=lambda kv: -sum(kv[1].values())):
        n = sum(where.values())
        lines.append(f"- {role(thread)}, {thread}: {n} samples ({n / max(total, 1):.0%})")
        for name, k in where.most_common(top):
            lines.append(f"    {k / n:6.1%}  {name}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder")
    ap.add_argument("--top", type=int, default=12, help="functions listed per thread")
    ap.add_argument("--match", default="", help="only files whose names hold this")
    args = ap.parse_args()
    files = sorted(p for p in Path(args.folder).glob("*.txt") if args.match in p.name)
    if not files:
        raise SystemExit(f"no profile files in {args.folder}")
    print("\n\n".join(summary(p, args.top) for p in files))


if __name__ == "__main__":
    main()

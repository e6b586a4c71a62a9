"""`python -m bench.reliability`: the reliability run in full, and its report."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from bench import reliability
from bench.reliability.profiles import PROFILES, soak_profile
from bench.reliability.report import markdown, print_report
from bench.reliability.run import run


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.reliability",
                                 description=reliability.__doc__.splitlines()[0])
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="the CI variant (~60-90 s)")
    group.add_argument("--soak", type=float, metavar="SECONDS",
                       help="repeat load rounds for this long, with longer fault windows")
    ap.add_argument("--clients", type=int, help="clients per load round (default 200; --quick 60)")
    ap.add_argument("--markdown", metavar="FILE", help="also write the tables as markdown")
    ap.add_argument("--workdir", help="keep logs here (default: a temporary directory)")
    ap.add_argument("--faults-only", action="store_true", help="skip the load rounds (debugging)")
    args = ap.parse_args()
    profile = soak_profile(args.soak) if args.soak else PROFILES["quick" if args.quick else "full"]
    profile = dataclasses.replace(profile)  # a copy: the flags below change it
    if args.clients:
        profile.clients = profile.warmup_clients = args.clients
    if args.faults_only:
        profile.load_rounds = profile.clients = profile.warmup_clients = 0
    from rich.console import Console

    console = Console()
    workdir = Path(args.workdir) if args.workdir else None
    if workdir:
        workdir.mkdir(parents=True, exist_ok=True)
    report = run(profile, workdir, log=lambda m: console.print(m, highlight=False))
    print_report(report, console)
    if args.markdown:
        command = "python -m bench.reliability " + " ".join(sys.argv[1:])
        Path(args.markdown).write_text(markdown(report, command.strip()) + "\n")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())

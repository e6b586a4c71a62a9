"""The run's results, as tables: on the terminal and as markdown."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field

from bench.reliability.checks import Check
from bench.reliability.faults import FaultResult
from bench.reliability.load import LoadResult
from bench.reliability.profiles import Profile


@dataclass
class Report:
    profile: Profile
    load: list[LoadResult] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    faults: list[FaultResult] = field(default_factory=list)
    workload_requests: int = 0
    workload_errors: int = 0
    shutdown_s: float | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return (all(c.ok for c in self.checks)
                and all(not f.errors and f.recovery_s is not None and f.registry.ok
                        for f in self.faults))


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def tables(report: Report) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) for the load checks, the load rounds and the faults."""
    out = []
    rows = []
    for r in report.load:
        rows.append([str(r.clients), str(r.requests), str(r.ok), str(r.disconnects),
                     str(r.rejected_429), str(len(r.errors)), f"{_pct(r.ttft, 0.5) * 1000:.0f}",
                     f"{_pct(r.ttft, 0.99) * 1000:.0f}", f"{r.seconds:.1f}",
                     ", ".join(f"{k} {v}" for k, v in sorted(r.reasons.items()))])
    out.append(("Load: streaming clients through one proxy to two backends",
                ["clients", "requests", "ok", "disconnects (1 in 5 clients)", "429 (retried)",
                 "errors", "TTFT p50 ms", "TTFT p99 ms", "seconds", "route reasons"], rows))
    out.append(("Checks", ["check", "result", "detail"],
                [[c.name, "ok" if c.ok else "FAIL", c.detail] for c in report.checks]))
    rows = []
    for f in report.faults:
        rows.append([f.name + (f" ({f.victim})" if f.victim else ""), f"{f.window_s:.1f}",
                     str(f.requests), str(len(f.errors)), str(f.victim_errors),
                     f"{f.max_latency_s:.1f}",
                     "not within the watch" if f.recovery_s is None else f"{f.recovery_s:.1f}",
                     ", ".join(f"{k} {v}" for k, v in sorted(f.reasons.items())),
                     _registry_cell(f.registry), f.note])
    p = report.profile
    out.append((f"Faults under a steady workload ({p.rate:g} req/s, {p.conversations} conversations, "
                f"streaming)",
                ["fault", "fault lasted s", "requests", "client errors", "errors in flight on failed backend",
                 "max turn latency s", "back to cache hits s", "route reasons", "Redis = stores",
                 "note"], rows))
    return out


def _registry_cell(check: Check | None) -> str:
    if check is None:
        return ""
    if check.ok:
        return "yes" + check.detail[check.detail.rindex(" after"):].replace(" after", ", after")
    return "NO: " + check.detail


def print_report(report: Report, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    for title, header, rows in tables(report):
        table = Table(title=title)
        for col in header:
            table.add_column(col)
        for row in rows:
            table.add_row(*row)
        console.print(table)
    console.print(f"total {report.seconds:.0f}s; verdict: {'PASS' if report.ok else 'FAIL'}")


def markdown(report: Report, command: str) -> str:
    lines = [f"```\n{command}\n```", "",
             f"Machine: {platform.machine()} {platform.system()}, {os.cpu_count()} cores, "
             f"Python {platform.python_version()}; profile `{report.profile.name}`, "
             f"{report.seconds:.0f} s in total; verdict **{'PASS' if report.ok else 'FAIL'}**.", ""]
    for title, header, rows in tables(report):
        lines += [f"**{title}**", "", "| " + " | ".join(header) + " |",
                  "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(cell.replace("|", "\\|").replace("\n", " ") for cell in row) + " |"
                  for row in rows]
        lines.append("")
    errors = [e for f in report.faults for e in f.errors]
    if errors:
        lines += ["Client errors:", ""] + [f"- {e}" for e in errors[:20]] + [""]
    return "\n".join(lines)

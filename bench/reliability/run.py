"""The whole run: the deployment, warm-up and load rounds with their checks, the faults,
a clean shutdown."""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path

import orjson

from bench.reliability.checks import (Check, check_log, check_registry, check_rss, check_slots_free,
                                      measure_rss)
from bench.reliability.deployment import Deployment
from bench.reliability.faults import run_faults
from bench.reliability.load import load_checks, run_load
from bench.reliability.profiles import Profile
from bench.reliability.report import Report


def load_phase(dep: Deployment, profile: Profile, report: Report, t0: float, log=print) -> None:
    """Warm-up, then load rounds, each followed by the checks."""
    log(f"warm-up: {profile.warmup_clients} clients ...")
    warm = run_load(dep.url, profile.warmup_clients, profile.disconnect_share, seed=1)
    if warm.errors:
        report.checks.append(Check("warm-up errors", False, str(warm.errors[:3])))
    slots = check_slots_free(dep)
    slots.name = "after the warm-up: " + slots.name
    report.checks.append(slots)
    warm_rss = measure_rss(dep)
    rounds = 0
    while True:
        rounds += 1
        log(f"load round {rounds}: {profile.clients} clients ...")
        mark = dep.log_mark()
        res = run_load(dep.url, profile.clients, profile.disconnect_share, seed=100 + rounds)
        report.load.append(res)
        round_checks = load_checks(res) + [check_slots_free(dep), check_rss(dep, warm_rss),
                                           check_registry(dep), check_log(dep, mark, "load")]
        for c in round_checks:
            c.name = f"round {rounds}: {c.name}"
            log(f"  {'ok ' if c.ok else 'FAIL'} {c.name}: {c.detail}")
        report.checks.extend(round_checks)
        if rounds >= profile.load_rounds and (time.monotonic() - t0 >= profile.soak_seconds
                                              or rounds >= 1000):
            return


def run(profile: Profile, workdir: Path | None = None, model_cache: str | None = None,
        log=print) -> Report:
    t0 = time.monotonic()
    report = Report(profile)
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvroute-rel-")))
        dep = Deployment(workdir, profile.cache_bytes, model_cache)
        try:
            log("starting kvroute serve ...")
            dep.start()
            if profile.clients:
                load_phase(dep, profile, report, t0, log)
            results, wl = run_faults(dep, profile, log)
            report.faults = results
            outs = wl.snapshot()
            with open(dep.workdir / "outcomes.jsonl", "wb") as f:
                for o in outs:
                    f.write(orjson.dumps(o) + b"\n")
                for r in results:
                    f.write(orjson.dumps({"fault": r.name, "t_inject": r.t_inject, "t_lift": r.t_lift})
                            + b"\n")
            report.workload_requests = len(outs)
            report.workload_errors = sum(1 for o in outs if not o.ok)
            after = [check_slots_free(dep), check_registry(dep)]
            for c in after:
                c.name = f"after the faults: {c.name}"
            report.checks.extend(after)
        finally:
            report.shutdown_s = dep.stop()
            if report.shutdown_s is None or report.shutdown_s >= 10:
                report.checks.append(Check("clean shutdown < 10 s", False,
                                           f"took {report.shutdown_s}\n{dep.log_tail(2000)}"))
            else:
                report.checks.append(Check("clean shutdown < 10 s", True, f"{report.shutdown_s:.1f}s"))
    report.seconds = time.monotonic() - t0
    return report

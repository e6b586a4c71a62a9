"""Reliability under load and faults, on the whole system as `kvroute serve` runs it.

Starts an external redis-server (so it can be restarted, stopped and paused) and
`kvroute serve` with a TOML config (2 replicas of the demo model), then:

1. Load: N concurrent streaming clients through the proxy (multi-turn chats and
   counting completions with modest max_tokens), one in five disconnecting at a
   random point (mostly mid-stream, some while still queued). A warm-up round of
   the same shape comes first. Afterwards it checks: no errors other than proper
   429s (OpenAI envelope + Retry-After; clients retry those), every batch slot free
   (each backend's engine and the proxy's in-flight counts back to 0), each
   process's RSS back within max(10%, 50 MiB) of its level after the warm-up, and
   the Redis advertisements equal to what each backend's store holds.
2. Faults, under a steady workload of multi-turn conversations at a fixed rate:
   SIGKILL of a backend (the launcher restarts it), SIGSTOP of a backend for longer
   than the heartbeat TTL then SIGCONT, Redis restarted empty, Redis unreachable
   (SIGSTOP) for a while. For each: requests, client-visible errors (apart: those
   in flight on the failed backend), the worst latency and the seconds until
   follow-up turns are routed as cache hits again.

The backends' /debug/cache needs the launcher's internal token: it is read from
the backend process's environment (KVROUTE_INTERNAL_TOKEN, read with psutil),
which the same user may read; nothing else is started outside `kvroute serve`.

    python -m bench.reliability [--quick | --soak SECONDS] [--markdown FILE]

tests/test_reliability.py runs the quick variant with these same checks. The
modules, in the order of a run:

    profiles     how big a run is (full, quick, soak)
    deployment   redis-server and `kvroute serve`, and what they run
    checks       what must hold after load and after each fault
    load         streaming clients, some disconnecting
    faults       the steady workload and each fault injected under it
    run          the whole run: deployment, load rounds, faults, shutdown
    report       its tables, on the terminal and as markdown
"""

from bench.reliability.checks import Check, check_registry, check_slots_free
from bench.reliability.deployment import MODEL, SECRET, Deployment
from bench.reliability.faults import FAULTS, FaultResult, SteadyWorkload, inject, run_faults
from bench.reliability.load import LoadResult, run_load
from bench.reliability.profiles import PROFILES, Profile, soak_profile
from bench.reliability.report import Report, markdown, print_report
from bench.reliability.run import load_phase, run

__all__ = ["FAULTS", "MODEL", "PROFILES", "SECRET", "Check", "Deployment", "FaultResult",
           "LoadResult", "Profile", "Report", "SteadyWorkload", "check_registry",
           "check_slots_free", "inject", "load_phase", "markdown", "print_report", "run",
           "run_faults", "run_load", "soak_profile"]

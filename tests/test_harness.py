"""The harness keeps its promises: tests importable as packages (no `sys.path` edits),
and the session's one redis-server giving each user a database of its own, empty."""

from __future__ import annotations

import re

import redis as redis_py

from tests.harness import ROOT, SharedRedis


def test_no_sys_path_edits_in_tests_or_benchmarks():
    """`tests` and `bench` are packages run from the repository root (pyproject's
    pytest `pythonpath`, `python -m bench.X`): nothing may edit sys.path to find them."""
    edits = [f"{path.relative_to(ROOT)}:{n}"
             for folder in ("tests", "bench") for path in sorted((ROOT / folder).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"sys\.path\.(insert|append)|sys\.path \+?=", line)]
    assert not edits, edits


def test_each_database_starts_empty_and_sees_no_other(redis_server):
    a, b = redis_server.database(), redis_server.database()
    assert a.port == b.port and a.number != b.number
    with redis_py.Redis.from_url(a.url) as ra, redis_py.Redis.from_url(b.url) as rb:
        ra.set("kvr:probe", "a")
        assert rb.get("kvr:probe") is None and rb.dbsize() == 0
        # Handed out again, after a full round of the others, a's database is emptied first.
        numbers = [redis_server.database().number for _ in range(SharedRedis.DATABASES - 2)]
        assert numbers[-1] == a.number and b.number not in numbers, numbers
        assert ra.dbsize() == 0

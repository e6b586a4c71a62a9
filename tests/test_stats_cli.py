"""`kvroute stats` at 100 columns: the proxy's /stats (a real `Stats`, fed as the proxy
feeds it) rendered as a terminal 100 characters wide. Backends named alike stay apart
(wrapped where needed, never cut), and every cache reason, team and refusal shows.
The command itself, against a live proxy, runs in tests/test_cache_reasons.py."""

from __future__ import annotations

import re

from rich.console import Console

from kvroute.core.misses import REASONS
from kvroute.devtools.stats_cli import render
from kvroute.proxy.misses import Miss
from kvroute.proxy.observe.stats import Stats, TeamCounts

NAMES = ["machine-east-kvroute-demo-1", "machine-east-kvroute-demo-2"]


def backend(name: str) -> dict:
    return {"id": name, "url": "http://10.0.0.1:8100", "models": ["kvroute-demo"],
            "queue_depth": 3, "waiting": 1, "running": 2, "inflight": 1, "suspect": True,
            "prefill_tps": 5123.0, "cache_bytes": 1 << 30, "cache_budget": 8 << 30,
            "cache_bytes_unshared": 5 << 30, "cache_blocks": 4096,
            "decoding": 2, "max_batch": 32, "bytes_per_token": 3.5, "mismatch": None,
            "disk_bytes": 3 << 30, "disk_budget": 200 << 30, "restore_tps": 9000.0,
            "ram_hits": 1234, "disk_hits": 56}


def snapshot() -> dict:
    stats = Stats(["team-alpha", "team-beta", "other"])
    for i, reason in enumerate(REASONS):
        stats.record(model="kvroute-demo", backend=NAMES[i % 2], reason="cache-hit",
                     prefix_blocks=12, predicted_tokens=12345, status=200, prompt_tokens=23456,
                     cached_tokens=12000, ttft_ms=123.4, prefill_tps=5000.0, team="team-alpha",
                     miss=Miss(reason, 1000, 17 if reason == "template_drift" else None),
                     seconds_lost=0.2)
    stats.count_team("team-alpha", "kvroute-demo", TeamCounts(
        requests=12, errors=1, prompt_tokens=123456, cached_tokens=98765, seconds_saved=12.3,
        generated_tokens=4321, seconds_lost=1.2))
    stats.count_limited("team-beta", "tokens_per_minute")
    for status in (200, 429, 401, 502):
        stats.count_api("chat", status)
    stats.note_drift("kvroute-demo", NAMES[0], 17, 12345, 17)
    return stats.snapshot([backend(n) for n in NAMES])


def test_readable_at_100_columns():
    console = Console(width=100, record=True, color_system=None)
    console.print(render(snapshot(), decisions=len(REASONS)))
    text = console.export_text()
    assert max(map(len, text.splitlines())) <= 100, text
    flat = re.sub(r"[\s│┃]+", "", text)  # what a cell wraps onto the next line joins up
    for name in NAMES:
        assert name.replace("-", "") in flat.replace("-", ""), text
        assert name in text, f"{name} is wrapped although 100 columns hold it:\n{text}"
    assert "…" not in text, text  # nothing cut
    for reason in REASONS:
        assert reason in text, reason
    assert "team-alpha" in text and "team-beta" in text and "tokensperminute1" in flat
    assert "3 (4xx 2, 5xx 1)" in text  # every non-2xx, by class
    assert "template drift on kvroute-demo" in text and "token 17" in text
    assert text.count("x5.0") == len(NAMES)  # each backend's sharing ratio


def test_every_column_shows_at_80_columns():
    # 80 columns: what `kvroute stats` gets when its output is not a terminal. The
    # models table's name column and the top table's last column were squeezed to nothing.
    console = Console(width=80, record=True, color_system=None)
    console.print(render(snapshot(), decisions=3))
    text = console.export_text()
    assert max(map(len, text.splitlines())) <= 80, text
    models = text[text.index("models"):text.index("backends")]
    assert "kvroute-demo" in models, models
    assert "non-2xx" in text and "3 (4xx 2, 5xx 1)" in text, text
    assert "…" not in text, text


def test_the_fleets_cache_sharing_in_stats():
    cache = snapshot()["cache"]
    assert cache == {"bytes": 2 << 30, "bytes_unshared": 10 << 30, "sharing_ratio": 5.0,
                     "blocks": 8192}

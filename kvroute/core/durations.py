"""Human durations for flags and config: `30m`, `1h30m`, `90s`, `2.5`, `0` (never)."""

from __future__ import annotations

import argparse
import re

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PART = re.compile(r"([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)")


def parse_duration(text: str | int | float) -> float:
    """Seconds. A bare number is seconds; units s, m, h, d may be chained (`1h30m`)."""
    if isinstance(text, bool):
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (try 30m or 90s)")
    if isinstance(text, (int, float)):
        if text < 0:
            raise argparse.ArgumentTypeError(f"a duration cannot be negative: {text!r}")
        return float(text)
    s = str(text).strip().lower().replace(" ", "")
    total, pos = 0.0, 0
    for m in _PART.finditer(s):
        if m.start() != pos or m.group(2) not in _UNITS:
            break
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if not s or pos != len(s):
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (try 30m, 1h30m or 90s)")
    return total


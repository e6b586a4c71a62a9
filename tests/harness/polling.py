"""Waiting for a condition: poll with a deadline, never sleep and hope."""

from __future__ import annotations

import http.client
import time
from typing import Any, Callable


def wait_until(predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.02,
               what: str = "condition") -> Any:
    """Poll `predicate` until it returns something truthy, or fail at the deadline."""
    deadline = time.monotonic() + timeout
    last_exc = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except (OSError, http.client.HTTPException, ValueError) as exc:
            last_exc = exc
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last error: {last_exc})")


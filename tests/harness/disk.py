"""A full disk on demand."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `path` (a full disk on demand; needs root), unmounted
    after; skips the test where it cannot be mounted."""
    import pytest  # here: the benchmarks import this module without the test extras

    path.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
    if subprocess.run(mount).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)])


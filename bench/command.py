"""How a benchmark was started, printed with its results so that a reader can run it again."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path


def command_line() -> str:
    """`python -m bench.X ARGS` for the module run as __main__ (`sys.argv[0]` is its file)."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    name = spec.name if spec is not None else f"bench.{Path(sys.argv[0]).stem}"
    return shlex.join(["python", "-m", name, *sys.argv[1:]])


def machine(detail: str = "") -> str:
    """The `machine:` line every benchmark prints under its command."""
    import platform

    line = (f"machine: {platform.machine()} {platform.system()} {platform.release()}, "
            f"python {platform.python_version()}")
    return f"{line}, {detail}" if detail else line

"""Reliability under load and faults, on the whole system as `kvroute serve` runs it.

The run and its checks are tests/reliability.py (the test suite runs its quick
variant); this is the command that runs it in full and prints the report:

    python bench/reliability.py [--quick | --soak SECONDS] [--markdown FILE]
"""

import sys
from pathlib import Path

# Ahead of this script's own folder: `reliability` is the tests' module, not this file.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from reliability import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

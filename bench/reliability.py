"""Reliability under load and faults, on the whole system as `kvroute serve` runs it.

The run and its checks are tests/reliability.py (the test suite runs its quick
variant); this is the command that runs it in full and prints the report:

    python -m bench.reliability [--quick | --soak SECONDS] [--markdown FILE]
"""

import sys

from tests.reliability import main

if __name__ == "__main__":
    sys.exit(main())

"""Where the repository is: processes start from it and tests read its files."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

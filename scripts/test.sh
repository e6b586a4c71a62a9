#!/usr/bin/env bash
# Installs everything the suite needs, then runs it: scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/install.sh --test
exec .venv/bin/python -m pytest "$@"

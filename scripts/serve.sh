#!/usr/bin/env bash
# Installs kvroute, then serves: scripts/serve.sh [kvroute backend args]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/install.sh
exec .venv/bin/kvroute backend "$@"

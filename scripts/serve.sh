#!/usr/bin/env bash
# Installs kvroute, then serves everything: scripts/serve.sh [kvroute serve args]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/install.sh
exec .venv/bin/kvroute serve "$@"

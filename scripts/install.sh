#!/usr/bin/env bash
# Installs kvroute into ./.venv (and redis-server when missing). Sourced by serve.sh and test.sh.
# Usage: scripts/install.sh [--test]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

extras=""
[ "${1:-}" = "--test" ] && extras="[test]"

py=${PYTHON:-python3}
if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "kvroute needs Python 3.10 or newer (found: $("$py" --version 2>&1))" >&2
  exit 1
fi
[ -x .venv/bin/python ] || "$py" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".${extras}"

if ! command -v redis-server >/dev/null 2>&1; then
  echo "installing redis-server ..." >&2
  if command -v apt-get >/dev/null 2>&1; then
    sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
    $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq redis-server >/dev/null
  elif command -v brew >/dev/null 2>&1; then
    brew install redis
  else
    echo "redis-server not found: install Redis (apt-get install redis-server / brew install redis)" >&2
    exit 1
  fi
fi

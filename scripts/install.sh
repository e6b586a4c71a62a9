#!/usr/bin/env bash
# Installs kvroute into ./.venv, and redis-server when missing. With --test, also
# the test extras and a headless Chromium for the dashboard test.
# Usage: scripts/install.sh [--test]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

test_mode=""
[ "${1:-}" = "--test" ] && test_mode=1

py=${PYTHON:-python3}
if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "kvroute needs Python 3.11 or newer (found: $("$py" --version 2>&1))" >&2
  exit 1
fi

apt_updated=""
apt_install() {
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  if [ -z "$apt_updated" ]; then $sudo apt-get update -qq; apt_updated=1; fi
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null
}

# Debian and Ubuntu ship venv (ensurepip) apart from python3: bring it when it is missing.
if ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
  rm -rf .venv
  if ! "$py" -m venv .venv >/dev/null 2>&1; then
    rm -rf .venv
    if command -v apt-get >/dev/null 2>&1; then
      minor=$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
      echo "installing python${minor}-venv ..." >&2
      apt_install "python${minor}-venv" || apt_install python3-venv
      "$py" -m venv .venv
    else
      echo "'$py -m venv' failed: install Python's venv module" >&2
      exit 1
    fi
  fi
fi
# -q twice: pip's own progress and the build backend's notices stay out of the way;
# errors still show.
pip_install() { .venv/bin/python -m pip install -qq --disable-pip-version-check "$@"; }
pip_install --upgrade pip
pip_install -e ".${test_mode:+[test]}"
# Images (pyproject's `vision` extra): mlx-vlm without its dependencies, which would
# move mlx and transformers off the versions kvroute runs with.
vision_pin=$(sed -n 's/^vision = \["\(mlx-vlm==[^"]*\)".*/\1/p' pyproject.toml)
pip_install "Pillow>=10.3.0" "requests>=2.31.0"
pip_install --no-deps "$vision_pin"

if ! command -v redis-server >/dev/null 2>&1; then
  echo "installing redis-server ..." >&2
  if command -v apt-get >/dev/null 2>&1; then
    apt_install redis-server
  elif command -v brew >/dev/null 2>&1; then
    brew install redis
  else
    echo "redis-server not found: install Redis (apt-get install redis-server / brew install redis)" >&2
    exit 1
  fi
fi

# The coding agents the suite drives (Claude Code, Codex CLI), at the versions
# tests/agents/package-lock.json pins; npm's cache keeps a re-run quick.
if [ -n "$test_mode" ]; then
  if ! command -v npm >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    echo "installing nodejs and npm (coding-agent tests) ..." >&2
    apt_install nodejs npm
  fi
  if command -v npm >/dev/null 2>&1; then
    (cd tests/agents && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
  else
    echo "npm not found: the coding-agent tests will be skipped" >&2
  fi
fi

if [ -n "$test_mode" ] && command -v apt-get >/dev/null 2>&1 \
   && ! command -v chromium >/dev/null 2>&1 && ! command -v google-chrome >/dev/null 2>&1; then
  echo "installing chromium (dashboard test) ..." >&2
  apt_install chromium fonts-dejavu-core
fi

# promtool tests the alerting rules of docker/kvroute-alerts.yml (Debian ships it in
# the prometheus package; its service is not started by this).
if [ -n "$test_mode" ] && command -v apt-get >/dev/null 2>&1 && ! command -v promtool >/dev/null 2>&1; then
  echo "installing promtool (alerting-rules test) ..." >&2
  apt_install --no-install-recommends prometheus
fi

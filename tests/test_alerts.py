"""The alerting rules in docker/ (kvroute-alerts.yml) against recorded series, with
Prometheus's own `promtool test rules` (tests/data/kvroute-alerts.test.yml): each alert
fires on the series that should page and stays quiet on those that should not; and
docker/prometheus.yml, which loads them, is a valid configuration.

`scripts/install.sh --test` installs promtool (Debian's `prometheus` package); the test
is skipped only where it is not installed."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from tests.harness import ROOT

PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool not found: scripts/install.sh "
                                "--test installs it (the prometheus package) where apt exists")


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_every_alert_fires_when_it_should_and_only_then():
    out = promtool("test", "rules", "tests/data/kvroute-alerts.test.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    # Every rule of the file has a test.
    rules = set(re.findall(r"- alert: (\w+)", (ROOT / "docker/kvroute-alerts.yml").read_text()))
    tested = set(re.findall(r"alertname: (\w+)",
                            (ROOT / "tests/data/kvroute-alerts.test.yml").read_text()))
    assert rules and rules == tested, (rules, tested)


def test_the_prometheus_configuration_loads_the_rules():
    out = promtool("check", "config", "docker/prometheus.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "kvroute-alerts.yml" in out.stdout + out.stderr

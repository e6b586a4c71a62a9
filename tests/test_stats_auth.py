"""/stats lists every tenant's recent routing decisions: with API keys set, only an
operator key (`--api-key KEY:operator`) reads it, whoever else asks gets 401 (no key)
or 403 (a tenant's key) in OpenAI's error envelope. /health, /metrics, /openapi.json
and the dashboard's page stay open; without keys, /stats is open as before. Real Redis,
real proxy processes, real HTTP, and `kvroute stats` as a user runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests import harness
from tests.harness import ProxyProcess, request

TENANT, UNSCOPED, OPERATOR = "sk-tenant", "sk-plain", "sk-ops"


@pytest.fixture(scope="module")
def proxies(tmp_path_factory, redis_server):
    logs = tmp_path_factory.mktemp("stats-auth")
    keys = ["--api-key", f"{TENANT}:team-a", "--api-key", UNSCOPED,
            "--api-key", f"{OPERATOR}:operator"]

    def proxies(redis_url: str) -> list[ProxyProcess]:
        return [ProxyProcess(redis_url, logs, ["--secret", "s", *keys]),
                ProxyProcess(redis_url, logs, ["--secret", "s"])]

    with harness.fleet(lambda redis_url: [], proxies, redis_server.database()) as f:
        yield {"keyed": f["proxies"][0], "open": f["proxies"][1]}


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def error(data: bytes) -> dict:
    body = json.loads(data)
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]


def test_stats_needs_an_operator_key(proxies):
    url = proxies["keyed"].url + "/stats"
    status, _, data = request(url)
    assert status == 401 and error(data)["code"] == "invalid_api_key"
    assert request(url, headers=bearer("sk-wrong"))[0] == 401
    for key in (TENANT, UNSCOPED):
        status, _, data = request(url, headers=bearer(key))
        assert status == 403, key
        err = error(data)
        assert err["type"] == "permission_error" and err["code"] == "operator_key_required"
        assert request(url, headers={"x-api-key": key})[0] == 403
    for headers in (bearer(OPERATOR), {"x-api-key": OPERATOR}):
        status, _, data = request(url, headers=headers)
        assert status == 200 and "decisions" in json.loads(data)


def test_the_operator_key_is_also_a_client_key(proxies):
    url = proxies["keyed"].url + "/v1/models"
    assert request(url)[0] == 401
    assert request(url, headers=bearer(OPERATOR))[0] == 200
    assert request(url, headers=bearer(TENANT))[0] == 200


def test_health_metrics_openapi_and_the_dashboard_page_stay_open(proxies):
    base = proxies["keyed"].url
    for path in ("/health", "/metrics", "/openapi.json", "/dashboard"):
        assert request(base + path)[0] == 200, path
    # The page reads its data with the key it was opened with (?key=), kept in the page.
    page = request(base + "/dashboard?key=" + OPERATOR)[2].decode()
    assert 'get("key")' in page and '"Bearer " + KEY' in page


def test_without_keys_stats_is_open(proxies):
    status, _, data = request(proxies["open"].url + "/stats")
    assert status == 200 and "decisions" in json.loads(data)


def _kvroute_stats(url: str, key: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    if key is not None:
        env["KVROUTE_API_KEY"] = key
    return subprocess.run([sys.executable, "-m", "kvroute.cli", "stats", "--url", url],
                          capture_output=True, text=True, timeout=60, env=env)


def test_kvroute_stats_sends_the_key_from_its_variable(proxies):
    url = proxies["keyed"].url
    out = _kvroute_stats(url, OPERATOR)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "latest routing decisions" in out.stdout
    for key in (None, TENANT):
        out = _kvroute_stats(url, key)
        assert out.returncode == 1, out.stdout
        assert "KVROUTE_API_KEY" in out.stdout + out.stderr
    assert _kvroute_stats(proxies["open"].url, None).returncode == 0

"""The dashboard end to end: real Redis, a backend, the proxy, a workload through the
official `openai` client, then headless Chromium rendering GET /dashboard.

The hit ratio the page shows (from GET /stats) must equal the one the proxy's
Prometheus counters give, and the page must say its charts are drawn
(body[data-ready="1"]). A screenshot lands in the test's tmp_path; with
KVROUTE_SAVE_SCREENSHOT set it is also copied to tests/output/dashboard.png.

Skipped only when no Chromium / Chrome binary is installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from html.parser import HTMLParser
from pathlib import Path

import openai
import pytest
from tests.harness import BackendProcess, free_port, metric_sum, request, terminate, wait_until


SECRET = "s"
MODEL = "demo"
MAC_CHROME = "/Applications/Google Chrome.app/Contents/MacOS/Google Chrome"


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    if sys.platform == "darwin" and os.path.exists(MAC_CHROME):
        return MAC_CHROME
    return None


CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium, chromium-browser or google-chrome binary found: "
                             "rendering the dashboard needs a headless browser")


def chromium_cmd(binary: str, profile: Path, *args: str) -> list[str]:
    return [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--no-default-browser-check", "--disable-extensions", "--hide-scrollbars",
            f"--user-data-dir={profile}", *args]


def run_chromium(cmd: list[str], timeout: float = 90) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"chromium did not finish within {timeout}s: {exc.cmd}")


class _DomProbe(HTMLParser):
    """Finds body's attributes and #hit-ratio's attributes and text."""

    def __init__(self) -> None:
        super().__init__()
        self.body: dict = {}
        self.hit: dict | None = None
        self.hit_text = ""
        self._in_hit = 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "body":
            self.body = attrs
        if self._in_hit:
            self._in_hit += 1
        elif attrs.get("id") == "hit-ratio":
            self.hit, self._in_hit = attrs, 1

    def handle_endtag(self, tag):
        if self._in_hit:
            self._in_hit -= 1

    def handle_data(self, data):
        if self._in_hit:
            self.hit_text += data


class ProxyProcess:
    def __init__(self, redis_url: str, log_dir: Path):
        self.port = free_port()
        self.log_path = log_dir / "proxy.log"
        self._log = open(self.log_path, "ab")
        cmd = [sys.executable, "-m", "kvroute.cli", "proxy", "--redis-url", redis_url,
               "--secret", SECRET, "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str) -> tuple[int, bytes]:
        if self.proc.poll() is not None:
            raise RuntimeError(f"proxy exited with {self.proc.returncode}:\n{self.log()}")
        status, _, data = request(self.url + path, timeout=10)
        return status, data

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def stop(self) -> None:
        terminate(self.proc, 10)
        self._log.close()


@pytest.fixture
def stack(text_model, tmp_path, redis_db):
    logs = tmp_path / "logs"
    logs.mkdir()
    redis = redis_db
    backend = proxy = None
    try:
        backend = BackendProcess(text_model, MODEL, logs, backend_id="dash-1",
                                 extra=["--redis-url", redis.url, "--secret", SECRET])
        backend.start()
        proxy = ProxyProcess(redis.url, logs)
        wait_until(lambda: any(b["id"] == "dash-1"
                               for b in json.loads(proxy.get("/health")[1])["backends"]),
                   30, interval=0.1, what="the proxy's /health to list the backend")
        yield proxy
    finally:
        if proxy:
            proxy.stop()
        if backend:
            backend.stop()


def drive_workload(proxy: ProxyProcess, conversations: int = 2, turns: int = 3) -> None:
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    for c in range(conversations):
        messages = [{"role": "system", "content": f"{uuid.uuid4().hex}: you help engineers. " * 4},
                    {"role": "user", "content": f"Hello, conversation {c}."}]
        for t in range(turns):
            r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16)
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": f"Tell me more ({t})."}]


def test_dashboard_shows_the_proxy_hit_ratio(stack, tmp_path):
    chromium, proxy = CHROMIUM, stack
    drive_workload(proxy)

    metrics = proxy.get("/metrics")[1].decode()
    cached = metric_sum(metrics, "kvroute_proxy_cached_tokens_total")
    prompt = metric_sum(metrics, "kvroute_proxy_prompt_tokens_total")
    assert prompt > 0, metrics
    ratio = cached / prompt
    assert 0 < ratio < 1, (cached, prompt)

    # Let the 2 s series sampler catch up with the workload, so the charts include it.
    def caught_up():
        status, data = proxy.get("/stats")
        assert status == 200, (status, data[:300])
        stats = json.loads(data)
        series = stats["series"]
        return series and sum(m["cached_tokens"] for m in series[-1]["models"].values()) == cached

    wait_until(caught_up, 15, interval=0.2, what="/stats series to include the workload")

    page = proxy.url + "/dashboard"
    status, html = proxy.get("/dashboard")
    assert status == 200 and b'id="hit-ratio"' in html, (status, html[:300])

    dom = run_chromium(chromium_cmd(chromium, tmp_path / "profile-dom",
                                    "--virtual-time-budget=6000", "--dump-dom", page))
    assert dom.returncode == 0, dom.stderr.decode(errors="replace")[-3000:]
    probe = _DomProbe()
    probe.feed(dom.stdout.decode(errors="replace"))
    assert probe.hit is not None, dom.stdout[:2000]
    assert probe.body.get("data-ready") == "1", (probe.body, proxy.log())
    value = probe.hit.get("data-value")
    assert value is not None and re.fullmatch(r"\d\.\d{4}", value), probe.hit
    # Equal to 4 decimals (a tolerance, not string equality: JS and Python round ties apart).
    assert abs(float(value) - ratio) <= 0.5e-4 + 1e-12, (value, ratio, cached, prompt)
    text = probe.hit_text.strip()
    assert re.fullmatch(r"\d{1,3}\.\d%", text), text
    assert abs(float(text[:-1]) - ratio * 100) <= 0.05 + 1e-9, (text, ratio)

    # Each backend's cache blocks and sharing ratio (these conversations share nothing).
    assert re.search(r"blocks <b>[1-9][\d,]*</b> · shared <b class=\"ratio\">×1\.\d</b>",
                     dom.stdout.decode(errors="replace")), dom.stdout[-3000:]

    shot = tmp_path / "dashboard.png"
    run = run_chromium(chromium_cmd(chromium, tmp_path / "profile-shot",
                                    "--virtual-time-budget=6000", "--window-size=1400,1000",
                                    f"--screenshot={shot}", page))
    assert run.returncode == 0, run.stderr.decode(errors="replace")[-3000:]
    assert shot.exists(), run.stderr.decode(errors="replace")[-3000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, len(data)
    if os.environ.get("KVROUTE_SAVE_SCREENSHOT"):
        out = Path(__file__).parent / "output"
        out.mkdir(exist_ok=True)
        shutil.copyfile(shot, out / "dashboard.png")

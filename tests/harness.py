"""Test harness: real processes, real sockets, polling with deadlines (no sleeps)."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.02,
               what: str = "condition") -> Any:
    """Poll `predicate` until it returns something truthy, or fail at the deadline."""
    deadline = time.monotonic() + timeout
    last_exc = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except (OSError, http.client.HTTPException, ValueError) as exc:
            last_exc = exc
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last error: {last_exc})")


def request(url: str, method: str = "GET", body: Any = None, headers: dict | None = None,
            raw: bytes | None = None, timeout: float = 60.0) -> tuple[int, dict, bytes]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    hdrs = {"Content-Type": "application/json"} if data is not None else {}
    hdrs.update(headers or {})
    try:
        conn.request(method, parts.path + (f"?{parts.query}" if parts.query else ""), body=data,
                     headers=hdrs)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def post_json(url: str, body: Any, **kw) -> tuple[int, dict]:
    status, _, data = request(url, "POST", body, **kw)
    return status, json.loads(data)


def get_json(url: str, **kw) -> dict:
    status, _, data = request(url, **kw)
    assert status == 200, (status, data[:500])
    return json.loads(data)


class SSEStream:
    """A streaming POST whose connection the test can drop at any point."""

    def __init__(self, url: str, body: dict, headers: dict | None = None, timeout: float = 60.0):
        parts = urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
        hdrs = {"Content-Type": "application/json"}
        hdrs.update(headers or {})
        self.conn.request("POST", parts.path, body=json.dumps({**body, "stream": True}), headers=hdrs)
        self._resp: http.client.HTTPResponse | None = None

    @property
    def resp(self) -> http.client.HTTPResponse:
        # Read lazily: a backend sends its headers with the first token, and a test
        # may want to act (e.g. disconnect) before that.
        if self._resp is None:
            self._resp = self.conn.getresponse()
        return self._resp

    @property
    def status(self) -> int:
        return self.resp.status

    @property
    def headers(self) -> dict:
        return dict(self.resp.getheaders())

    def events(self) -> Iterator[dict | str]:
        """Parsed `data:` payloads; the string "[DONE]" ends the stream."""
        while True:
            line = self.resp.readline()
            if not line:
                return
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            payload = line[6:]
            if payload == b"[DONE]":
                yield "[DONE]"
                return
            yield json.loads(payload)

    def close(self) -> None:
        # Shut the socket down hard, as a client that crashed or gave up would.
        sock = self.conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.conn.close()


class BackendProcess:
    def __init__(self, model: Path | str, model_id: str, log_dir: Path, extra: list[str] | None = None,
                 port: int | None = None, backend_id: str | None = None, env: dict | None = None):
        self.model = str(model)
        self.model_id = model_id
        self.port = port or free_port()
        self.backend_id = backend_id or f"test-{self.port}"
        self.extra = extra or []
        self.log_path = Path(log_dir) / f"{self.backend_id}.log"
        self.env = env or {}
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 90.0) -> None:
        cmd = [sys.executable, "-m", "kvroute.cli", "backend", "--model", self.model,
               "--model-id", self.model_id, "--port", str(self.port), "--id", self.backend_id,
               *self.extra]
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **self.env})
        wait_until(self._ready, timeout, interval=0.05, what=f"backend {self.backend_id} health")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"backend exited with {self.proc.returncode}; log:\n{self.log()}")
        return request(self.url + "/health", timeout=2)[0] == 200

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def health(self) -> dict:
        return get_json(self.url + "/health")

    def cache(self) -> list[dict]:
        return get_json(self.url + "/debug/cache")["entries"]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if getattr(self, "_log", None):
            self._log.close()

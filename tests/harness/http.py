"""Real HTTP to real processes: plain requests, JSON, streams a test can drop, metrics."""

from __future__ import annotations

import http.client
import json
import re
import socket
from typing import Any, Iterator
from urllib.parse import urlsplit


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of one sample name over its label sets that carry `labels`, from Prometheus text."""
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)", re.M)
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(v) for found, v in pattern.findall(text) if all(w in found for w in want))


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


"""A streamed answer's usage comment (kvroute/core/usage.py): the proxy reads the
generated tokens and cuts the comment out, whatever the pieces the bytes arrive in."""

from __future__ import annotations

import json

from kvroute.core.usage import StreamTail, usage_comment


def stream(reply: str) -> bytes:
    events = [b"data: " + json.dumps({"choices": [{"delta": {"content": reply}}]}).encode()
              + b"\n\n", usage_comment(42), b"data: [DONE]\n\n"]
    return b"".join(events)


def relay(data: bytes, size: int) -> tuple[bytes, int | None]:
    tail, out = StreamTail(), b""
    for i in range(0, len(data), size):
        out += tail.feed(data[i:i + size])
    return out + tail.flush(), tail.completion_tokens


def test_the_comment_is_read_and_cut_out_in_any_pieces():
    # A reply that says the comment's words is the reply's own text, kept as it is.
    for reply in ("Hello", ": kvroute-usage 7\n\n"):
        data = stream(reply)
        expected = data.replace(usage_comment(42), b"")
        for size in (1, 2, 3, 7, 64, len(data)):
            assert relay(data, size) == (expected, 42), (reply, size)


def test_a_stream_without_the_comment_passes_unchanged():
    data = b"data: {}\n\ndata: [DONE]\n\n"
    assert relay(data, 5) == (data, None)
    assert relay(b"data: {}\n\npartial", 4) == (b"data: {}\n\npartial", None)  # cut short

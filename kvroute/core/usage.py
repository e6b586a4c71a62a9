"""The generated tokens of a streamed answer, for the proxy that counts each team's tokens.

A streamed chat or completion tells its usage only when the client asks for it
(`stream_options.include_usage`). So a proxy asks the backend (`USAGE_HEADER`), which
then ends the stream with one SSE comment carrying the count before `data: [DONE]`;
the proxy reads it and cuts it out (`StreamTail`), so clients see the backend's stream
as before. SSE clients ignore comments anyway; cutting it keeps the bytes unchanged.
"""

from __future__ import annotations

USAGE_HEADER = "x-kvroute-usage"  # proxy -> backend: "1" asks for the comment
COMMENT = b": kvroute-usage "
EVENT_END = b"\n\n"


def usage_comment(completion_tokens: int) -> bytes:
    return COMMENT + str(int(completion_tokens)).encode() + EVENT_END


class StreamTail:
    """Relays a backend's SSE bytes in whole events, cutting out the usage comment.

    Bytes arrive in pieces of any size; an event split across two pieces waits for its
    end (a part of an event is of no use to a client), so the comment, one whole event,
    is always found whole."""

    def __init__(self) -> None:
        self.pending = b""
        self.completion_tokens: int | None = None

    def feed(self, piece: bytes) -> bytes:
        data = self.pending + piece if self.pending else piece
        end = data.rfind(EVENT_END)
        if end < 0:
            self.pending = data
            return b""
        out, self.pending = data[: end + 2], data[end + 2:]
        start = out.find(COMMENT)
        # Only at the start of an event: inside a data line it is a reply's own text.
        while start >= 0 and start != 0 and out[start - 2:start] != EVENT_END:
            start = out.find(COMMENT, start + 1)
        if start >= 0:
            stop = out.index(EVENT_END, start)
            try:
                self.completion_tokens = int(out[start + len(COMMENT):stop])
            except ValueError:
                pass
            out = out[:start] + out[stop + 2:]
        return out

    def flush(self) -> bytes:
        out, self.pending = self.pending, b""
        return out

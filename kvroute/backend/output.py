"""From generated tokens to what the client sees: text, stop strings, tool calls.

Stop strings and tool-call markers are matched on decoded text, not tokens, so
they are found even when they straddle token boundaries; text that might be the
start of a marker is held back until it is known not to be, so a stop string
never leaks into the output.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import orjson

log = logging.getLogger("kvroute.backend.output")


@dataclass
class Chunk:
    text: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    stopped: bool = False  # a stop string was found: generation must end here
    stop: str | None = None  # which one (the Messages API reports it as stop_sequence)


def _earliest(text: str, markers: list[str]) -> tuple[int, str] | None:
    best = None
    for marker in markers:
        i = text.find(marker)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, marker)
    return best


def _partial_suffix(text: str, markers: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a marker."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


def format_tool_call(parsed: dict) -> dict:
    args = parsed.get("arguments", {})
    if not isinstance(args, str):
        args = orjson.dumps(args).decode()
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": str(parsed.get("name", "")), "arguments": args},
    }


class OutputParser:
    """Feeds on decoded text segments; yields client-visible chunks."""

    def __init__(
        self,
        stop: list[str],
        tool_start: str | None = None,
        tool_end: str | None = None,
        tool_parser: Callable[[str, Any], Any] | None = None,
        tools: list[dict] | None = None,
    ):
        self.stop = stop
        tools_on = bool(tools and tool_start and tool_end and tool_parser)
        self.tool_start = tool_start if tools_on else None
        self.tool_end = tool_end
        self.tool_parser = tool_parser
        self.tools = tools
        self.pending = ""
        self.in_tool = False
        self.n_tool_calls = 0
        # Positions in the text fed so far, so the engine can tell which tokens' text
        # the client got (their logprobs go with it): how much was fed, where the call
        # being read began, the spans of calls (not text), where a stop string began.
        self.fed = 0
        self._call_start = 0
        self.call_spans: list[tuple[int, int]] = []
        self.stop_at: int | None = None

    @property
    def consumed(self) -> int:
        """Text fed and decided: sent as text, as a call, or dropped (not held back)."""
        return self.fed - len(self.pending) - (len(self.tool_start) if self.in_tool else 0)

    def in_call(self, start: int, end: int) -> bool:
        """Whether the text from `start` to `end` (a token's) lies wholly in a tool
        call's markup: a token that holds some of the text beside it is the text's."""
        return any(a <= start and end <= b for a, b in self.call_spans)

    def _markers(self) -> list[str]:
        return self.stop + ([self.tool_start] if self.tool_start else [])

    def feed(self, text: str) -> Chunk:
        self.pending += text
        self.fed += len(text)
        out = Chunk()
        while True:
            base = self.fed - len(self.pending)  # where pending begins in the text fed
            if self.in_tool:
                end = self.pending.find(self.tool_end)
                if end < 0:
                    return out
                body = self.pending[:end]
                calls = self._parse_tool(body)
                if calls:
                    out.tool_calls += calls
                    self.call_spans.append((self._call_start, base + end + len(self.tool_end)))
                else:  # keep the model's words when they do not parse
                    out.text += self.tool_start + body + self.tool_end
                self.pending = self.pending[end + len(self.tool_end) :]
                self.in_tool = False
                continue
            found = _earliest(self.pending, self._markers())
            if found is None:
                keep = _partial_suffix(self.pending, self._markers())
                cut = len(self.pending) - keep
                out.text += self.pending[:cut]
                self.pending = self.pending[cut:]
                return out
            i, marker = found
            out.text += self.pending[:i]
            self.pending = self.pending[i + len(marker) :]
            if marker == self.tool_start:
                self.in_tool, self._call_start = True, base + i
                continue
            out.stopped, out.stop, self.stop_at = True, marker, base + i
            self.pending = ""
            return out

    def finish(self, text: str = "", cut: bool = False) -> Chunk:
        """The stream ended, at EOS or cut by max tokens (`cut`): release whatever was
        held back."""
        out = self.feed(text) if text else Chunk()
        if out.stopped:
            return out
        if self.in_tool:
            calls = self._parse_tool(self.pending)
            if calls:  # whole, though its end marker never came
                out.tool_calls += calls
            elif not cut:
                # The model ended on words that do not parse as a call: they are its answer.
                out.text += self.tool_start + self.pending
            # Cut by max tokens inside a call: half a call is neither an answer nor a
            # call; the finish reason ("length") says so, the markup stays out of the text.
            if calls or cut:
                self.call_spans.append((self._call_start, self.fed))
        else:
            out.text += self.pending
        self.pending = ""
        self.in_tool = False
        return out

    def _parse_tool(self, body: str) -> list[dict]:
        try:
            parsed = self.tool_parser(body, self.tools)
        except Exception as exc:  # a model may emit malformed calls
            # Debug only: the exception quotes model output, which stays out of default logs.
            log.debug("unparseable tool call (%s); returned as text", exc)
            return []
        if isinstance(parsed, dict):
            parsed = [parsed]
        if not isinstance(parsed, list) or not all(isinstance(p, dict) and p.get("name") for p in parsed):
            return []
        calls = [format_tool_call(p) for p in parsed]
        self.n_tool_calls += len(calls)
        return calls

"""The hermes tool-call syntax (Hermes 2 Pro, Qwen2.5, Qwen3): each call is a JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`."""

from __future__ import annotations

from inflight.server.parsers.calls import CallSpan
from inflight.server.parsers.markers import held_back

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesSyntax:
    arguments_key = "arguments"

    def split(self, text: str, final: bool) -> list[str | CallSpan]:
        return split_marked(text, final, OPEN, CLOSE)


def split_marked(text: str, final: bool, open_: str, close: str) -> list[str | CallSpan]:
    """`text` cut into content and the call objects between `open_` and `close`; unless
    `final`, text that may be the start of `open_` is left out."""
    pieces: list[str | CallSpan] = []
    i = 0
    while True:
        start = text.find(open_, i)
        if start < 0:
            tail = text[i:]
            pieces.append(tail if final else tail[: len(tail) - held_back(tail, open_)])
            return pieces
        pieces.append(text[i:start])
        body_start = start + len(open_)
        end = text.find(close, body_start)
        if end < 0:
            # Unterminated: the call runs to the end (a model may stop right after the JSON).
            pieces.append(CallSpan(text[start:], text[body_start:]))
            return pieces
        pieces.append(CallSpan(text[start : end + len(close)], text[body_start:end]))
        i = end + len(close)

"""The Llama 3 JSON tool-call syntax: the reply is one call object `{"name": ...,
"parameters": {...}}`, or several separated by semicolons, optionally after `<|python_tag|>`.
A reply that starts with anything else is content."""

from __future__ import annotations

from inflight.server.parsers.calls import CallSpan
from inflight.server.parsers.json_scan import skip_whitespace, value_end

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonSyntax:
    arguments_key = "parameters"

    def split(self, text: str, final: bool) -> list[str | CallSpan]:
        head = text.lstrip()
        if not final and (not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG)):
            return []  # nothing yet says whether this is a call or prose
        i = len(text) - len(head)
        if head.startswith(PYTHON_TAG):
            i = skip_whitespace(text, i + len(PYTHON_TAG))
        elif not head.startswith("{"):
            return [text]
        pieces: list[str | CallSpan] = []
        while i < len(text) and text[i] == "{":
            end = value_end(text, i)
            if end is None:
                pieces.append(CallSpan(text[i:], text[i:]))
                return pieces
            pieces.append(CallSpan(text[i:end], text[i:end]))
            i = skip_whitespace(text, end)
            if i < len(text) and text[i] == ";":
                i = skip_whitespace(text, i + 1)
        pieces.append(text[i:])
        return pieces

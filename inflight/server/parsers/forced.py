"""The output of a forced tool choice: a JSON constraint makes the model write one call object
(a named function) or an array of them (`required`), with no text around them. Where the choice
leaves one function to call (a named one, or `required` with one tool), every call is that
function's from its first character, as OpenAI sends a forced call's name before its arguments:
a reply cut by `max_tokens` inside the name is still the call."""

from __future__ import annotations

from inflight.server.parsers.calls import CallSpan
from inflight.server.parsers.json_scan import skip_whitespace, value_end


class ForcedCallsSyntax:
    def __init__(self, arguments_key: str, array: bool, function: str | None = None) -> None:
        self.arguments_key = arguments_key
        self.array = array
        self.function = function  # the one function the choice leaves, if one

    def split(self, text: str, final: bool) -> list[str | CallSpan]:
        i = skip_whitespace(text, 0)
        if self.array:
            if i >= len(text) or text[i] != "[":
                return [text[i:]]
            i = skip_whitespace(text, i + 1)
        pieces: list[str | CallSpan] = []
        while i < len(text) and text[i] == "{":
            end = value_end(text, i)
            if end is None:
                pieces.append(CallSpan(text[i:], text[i:], self.function))
                break
            pieces.append(CallSpan(text[i:end], text[i:end], self.function))
            if not self.array:
                break
            i = skip_whitespace(text, end)
            if i < len(text) and text[i] == ",":
                i = skip_whitespace(text, i + 1)
        if final and self.array and not pieces and self.function and i == len(text):
            pieces.append(CallSpan("", "", self.function))  # cut right after the array opened
        return pieces

"""Scanning JSON that may still be arriving.

`json.loads` judges whole documents only; a stream of tool calls needs to know, while the model is
still writing, where a value ends and which members of an object are already written. The scan
trusts the structure (braces, brackets, quotes) and leaves the judgement of a finished value to
`json.loads`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_WHITESPACE = " \t\r\n"
_SCALAR_END = ",}]" + _WHITESPACE
# A stream re-scans a call at every delta: regular expressions keep that scan out of Python's
# per-character loop (a long argument string is crossed in one match).
_STRING_REST = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_STRUCTURE = re.compile(r'["{}\[\]]')


def skip_whitespace(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """The index after the string that opens at `text[i]` (a quote); None while unfinished."""
    match = _STRING_REST.match(text, i + 1)
    return match.end() if match else None


def value_end(text: str, i: int) -> int | None:
    """The index after the value that starts at `text[i]`; None while it may still grow."""
    if text[i] == '"':
        return string_end(text, i)
    if text[i] in "{[":
        depth, at = 0, i
        while (match := _STRUCTURE.search(text, at)) is not None:
            if match.group() == '"':
                end = string_end(text, match.start())
                if end is None:
                    return None
                at = end
                continue
            depth += 1 if match.group() in "{[" else -1
            if depth == 0:
                return match.end()
            at = match.end()
        return None
    j = i
    while j < len(text) and text[j] not in _SCALAR_END:
        j += 1
    # A number or literal at the very end may have more characters coming.
    return j if j < len(text) else None


@dataclass(frozen=True)
class Member:
    raw: str  # the value's text as written so far
    complete: bool


@dataclass(frozen=True)
class ObjectScan:
    members: dict[str, Member]
    end: int | None  # the index after the closing brace; None while the object is open
    malformed: bool  # the text stopped being a JSON object somewhere


def scan_object(text: str, start: int = 0) -> ObjectScan:
    """The members of the object that opens at `text[start]` (a brace), as far as written."""
    members: dict[str, Member] = {}
    i = start + 1
    while True:
        i = skip_whitespace(text, i)
        if i >= len(text):
            return ObjectScan(members, None, False)
        if text[i] == "}":
            return ObjectScan(members, i + 1, False)
        if text[i] == "," and members:
            i = skip_whitespace(text, i + 1)
            if i >= len(text):
                return ObjectScan(members, None, False)
        if text[i] != '"':
            return ObjectScan(members, None, True)
        key_end = string_end(text, i)
        if key_end is None:
            return ObjectScan(members, None, False)
        key = _string(text[i:key_end])
        i = skip_whitespace(text, key_end)
        if i >= len(text):
            return ObjectScan(members, None, False)
        if text[i] != ":" or key is None:
            return ObjectScan(members, None, True)
        i = skip_whitespace(text, i + 1)
        if i >= len(text):
            members[key] = Member("", False)
            return ObjectScan(members, None, False)
        end = value_end(text, i)
        members[key] = Member(text[i : len(text) if end is None else end], end is not None)
        if end is None:
            return ObjectScan(members, None, False)
        i = end


def _string(quoted: str) -> str | None:
    try:
        value = json.loads(quoted)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


_MISSING = object()
# An escape cut short at the end of a string: a lone backslash, or \u with under 4 digits.
_CUT_ESCAPE = re.compile(r"\\(u[0-9a-fA-F]{0,3})?$")


def partial_value(text: str) -> Any:
    """The value a JSON text holds as far as it is written (a reply cut by max_tokens): open
    strings, arrays and objects closed where the text ends, a member or element whose value has
    not begun (or is a literal or number cut short) left out; None where no value has begun.
    A complete text gives what `json.loads` gives. Malformed text: ValueError."""
    value, _ = _partial(text, 0)
    return None if value is _MISSING else value


def arguments_object(text: str) -> dict[str, Any]:
    """The object a tool call's arguments hold: whole, or as far as written where they were cut
    short (max_tokens); an empty one where they hold no object (malformed text, another JSON
    value), which chat templates could not render as a call's arguments. Conversations that
    send such a call back (the model's own, cut by max_tokens) are served, not refused: OpenAI
    takes arguments as opaque text, and the clients that tell the model its JSON was broken
    replay the call on every later turn, so a 400 would end the conversation for good."""
    try:
        value = partial_value(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _partial(text: str, i: int) -> tuple[Any, int]:
    i = skip_whitespace(text, i)
    if i >= len(text):
        return _MISSING, i
    if text[i] == '"':
        end = string_end(text, i)
        if end is not None:
            return json.loads(text[i:end]), end
        rest = text[i + 1 :]
        cut = _CUT_ESCAPE.search(rest)
        if cut is not None:
            before = rest[: cut.start()]
            # The backslash begins an escape unless an odd run of them ends before it.
            if (len(before) - len(before.rstrip("\\"))) % 2 == 0:
                rest = before
        return json.loads(f'"{rest}"'), len(text)
    if text[i] in "{[":
        return _container(text, i)
    end = i
    while end < len(text) and text[end] not in _SCALAR_END:
        end += 1
    try:
        return json.loads(text[i:end]), end
    except ValueError:
        if end == len(text):
            return _MISSING, end  # a literal or number cut short
        raise


def _container(text: str, i: int) -> tuple[Any, int]:
    is_object = text[i] == "{"
    out: Any = {} if is_object else []
    close = "}" if is_object else "]"
    i += 1
    while True:
        i = skip_whitespace(text, i)
        if i >= len(text):
            return out, i
        if text[i] == close:
            return out, i + 1
        if text[i] == ",":
            i += 1
            continue
        key = None
        if is_object:
            key_end = string_end(text, i) if text[i] == '"' else -1
            if key_end == -1:
                raise ValueError(f"an object key expected at {i}")
            if key_end is None:
                return out, len(text)  # the key cut short
            key = json.loads(text[i:key_end])
            i = skip_whitespace(text, key_end)
            if i >= len(text):
                return out, i
            if text[i] != ":":
                raise ValueError(f"':' expected at {i}")
            i += 1
        value, i = _partial(text, i)
        if value is _MISSING:
            return out, i
        if is_object:
            out[key] = value
        else:
            out.append(value)

"""Tool calls in model output: the pieces a tool-call syntax cuts the text into, and what one
call object says (its name and its arguments' JSON text) while it is still being written."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Protocol

from inflight.server.parsers.json_scan import scan_object, skip_whitespace

# The members a call object may carry its arguments in (hermes writes "arguments", Llama 3
# "parameters"; either is read whatever the syntax).
ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as the model wrote it


@dataclass(frozen=True)
class CallSpan:
    """Where the output holds (or starts) one call: `raw` is its text as written, markers
    included (it is content again if it turns out to be no call); `body` the JSON object;
    `name` the call's name where the syntax knows it before the model has written it (a forced
    choice of one function), so that a reply cut inside the name is still that call."""

    raw: str
    body: str
    name: str | None = None


class ToolSyntax(Protocol):
    """A format models write tool calls in."""

    # The member a constrained call object carries the arguments in.
    arguments_key: str

    def split(self, text: str, final: bool) -> list[str | CallSpan]:
        """The output cut into content and call spans. Unless `final`, text that could still
        become the start of a call is left out."""
        ...


@dataclass(frozen=True)
class CallReading:
    name: str | None  # known once the name's string is complete
    arguments: str  # the arguments' JSON text written so far ("{}" for a call without them)
    closed: bool  # the call object is complete (or can no longer be one)
    valid: bool  # a finished, well-formed call: a name and an object of arguments


def read_call(span: CallSpan) -> CallReading:
    body = span.body
    start = skip_whitespace(body, 0)
    if start >= len(body):
        return CallReading(span.name, "", False, False)
    if body[start] != "{":
        return CallReading(None, "", True, False)
    scan = scan_object(body, start)
    name_member = scan.members.get("name")
    name = span.name
    if name_member is not None and name_member.complete:
        value = _loads(name_member.raw)
        name = value if isinstance(value, str) and value else None
    arguments_member = next((scan.members[k] for k in ARGUMENT_KEYS if k in scan.members), None)
    closed = scan.end is not None or scan.malformed
    if arguments_member is not None:
        arguments = arguments_member.raw
    else:
        arguments = "{}" if scan.end is not None else ""
    valid = False
    if scan.end is not None and not body[scan.end :].strip() and name is not None:
        whole = _loads(body)
        valid = isinstance(whole, dict) and isinstance(_loads(arguments), dict)
    return CallReading(name, arguments, closed, valid)


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None

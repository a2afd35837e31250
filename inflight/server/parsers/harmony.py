"""Reasoning in OpenAI's harmony format (gpt-oss): a reply is a run of messages, each a header
(`<|start|>assistant`, then `<|channel|>` and the channel's name, perhaps a recipient and a
`<|constrain|>` type) and a body after `<|message|>` that `<|end|>`, `<|return|>` or `<|call|>`
closes. The "analysis" channel's bodies are the reasoning; the others' ("final", and
"commentary": preambles) are the content. A message addressed to a function (`to=functions.NAME`
in its header) is a tool call, its body the arguments: with `calls` (`--tool-call-parser
openai`, tool choice auto) it goes into the content as a call object between markers of its own
that `HarmonyCalls` reads; without, its body is content.

The markers are special tokens, so the text this reads keeps them (`keeps_special_tokens`). A
reply that opens with no marker (a template that writes no harmony) is all content.
"""

from __future__ import annotations

import json
import re

from inflight.server.parsers.calls import CallSpan
from inflight.server.parsers.hermes import split_marked
from inflight.server.parsers.markers import held_back

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
MARKERS = (START, CHANNEL, MESSAGE, "<|constrain|>", *ENDS)
_END = re.compile("|".join(re.escape(end) for end in ENDS))
REASONING_CHANNEL = "analysis"
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
# Where the content holds a call: no text a model writes holds these (its markers are gone).
CALL_OPEN, CALL_CLOSE = "<|inflight_call|>", "<|/inflight_call|>"


class HarmonyChannels:
    # The markers must reach `split`: the reply is decoded with its special tokens.
    keeps_special_tokens = True

    def __init__(self, calls: bool = False) -> None:
        self.calls = calls

    def thinks_from_prompt(self, prompt_tail: str) -> bool:
        """The model names each message's channel itself: a prompt never leaves it inside one."""
        return False

    def split(self, text: str, final: bool, thinking: bool) -> tuple[str | None, str]:
        """(reasoning, content) of the output so far: the analysis messages' bodies, and the
        others'; reasoning is None when no analysis message was written. Unless `final`, a
        message whose header is still being written adds nothing yet, and text that may be
        the start of a marker is left out."""
        if not text.lstrip().startswith(MARKERS) and (final or not _may_open(text)):
            return None, text
        reasoning: list[str] | None = None
        content: list[str] = []
        at = 0
        while at < len(text):
            header_end = text.find(MESSAGE, at)
            if header_end < 0:
                break  # a header still being written (or text after the last message)
            header = text[at:header_end]
            body_start = header_end + len(MESSAGE)
            end = _END.search(text, body_start)
            if end is None:
                body = text[body_start:]
                if not final:
                    body = body[: len(body) - max(held_back(body, m) for m in MARKERS)]
                at = len(text)
            else:
                body, at = text[body_start : end.start()], end.end()
            recipient = _RECIPIENT.search(header)
            if _channel(header) == REASONING_CHANNEL:
                reasoning = [*(reasoning or []), body]
            elif self.calls and recipient is not None:
                name = json.dumps(recipient[1])
                call = f'{CALL_OPEN}{{"name": {name}, "arguments": {body}'
                content.append(call + (f"}}{CALL_CLOSE}" if final or end is not None else ""))
            else:
                content.append(body)
        return (None if reasoning is None else "".join(reasoning)), "".join(content)


def _may_open(text: str) -> bool:
    """Whether text that does not open with a marker yet still may (it is one's beginning)."""
    head = text.lstrip()
    return not head or any(marker.startswith(head) for marker in MARKERS)


def _channel(header: str) -> str:
    """The channel a message header names ("analysis" of "<|channel|>analysis"; of
    "<|start|>assistant to=functions.f<|channel|>commentary json": "commentary")."""
    _, _, rest = header.partition(CHANNEL)
    return re.split(r"[\s<]", rest.strip(), maxsplit=1)[0]


class HarmonyCalls:
    """The calls `HarmonyChannels(calls=True)` left in the content (`--tool-call-parser
    openai`, which needs `--reasoning-parser openai_gptoss`)."""

    arguments_key = "arguments"

    def split(self, text: str, final: bool) -> list[str | CallSpan]:
        return split_marked(text, final, CALL_OPEN, CALL_CLOSE)

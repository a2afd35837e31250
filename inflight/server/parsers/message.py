"""An assistant reply read out of the generated text: reasoning, content and tool calls, whole
or as deltas while it streams.

Both ways read the text the same way (`_read`): the reasoning split first, then the tool-call
syntax over the content. A stream re-reads everything generated so far at each delta and sends
what grew; text that could still turn into a tag or a call is held back until it is decided, so
what a stream sends always adds up to what the whole reply says, for any cut of the text into
deltas. One difference remains, for output that breaks off inside a call (`max_tokens`): a
stream has already sent that call's name and part of its arguments, while the whole reply, which
only returns calls whose arguments parse, returns the text as content.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inflight.server.parsers.calls import ToolCall, ToolSyntax, read_call
from inflight.server.parsers.reasoning import ReasoningSyntax


@dataclass(frozen=True)
class ParsedMessage:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    name: str | None  # set on a call's first delta only
    arguments: str  # the next fragment of the arguments' JSON text


@dataclass
class MessageDelta:
    """What a stream adds: reasoning (which comes first), then content text and tool-call
    deltas in `parts`, in the order the model wrote them."""

    reasoning: str = ""
    parts: list[str | ToolCallDelta] = field(default_factory=list)

    @property
    def content(self) -> str:
        return "".join(p for p in self.parts if isinstance(p, str))

    @property
    def tool_calls(self) -> list[ToolCallDelta]:
        return [p for p in self.parts if isinstance(p, ToolCallDelta)]

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.parts)


@dataclass(frozen=True)
class _Call:
    name: str
    arguments: str  # written so far
    offset: int  # the length of the content written before it


class MessageParser:
    """How one request's output is read: `reasoning` splits off the thinking (`thinking`: the
    prompt left the model inside it), `tools` finds the calls in the content, `max_calls` keeps
    that many (later calls are dropped: `parallel_tool_calls: false`)."""

    def __init__(
        self,
        *,
        reasoning: ReasoningSyntax | None = None,
        thinking: bool = False,
        tools: ToolSyntax | None = None,
        max_calls: int | None = None,
    ) -> None:
        self.reasoning = reasoning
        self.thinking = thinking
        self.tools = tools
        self.max_calls = max_calls

    @property
    def plain(self) -> bool:
        """The text is all content (no parser applies)."""
        return self.reasoning is None and self.tools is None

    def whole(self, text: str) -> ParsedMessage:
        if self.plain:
            return ParsedMessage(None, text, [])
        reasoning, rest = self._reasoning(text, final=True)
        content, found = self._read(rest, final=True, strict=True)
        calls = [ToolCall(call.name, call.arguments) for call in found]
        # With no call found, the content is the text as written (spans that were no call
        # included, whatever the syntax dropped around them).
        content = content if calls else rest
        return ParsedMessage(reasoning or None, content or None, calls)

    def stream(self) -> MessageStream:
        return MessageStream(self)

    def _reasoning(self, text: str, final: bool) -> tuple[str | None, str]:
        if self.reasoning is None:
            return None, text
        return self.reasoning.split(text, final, self.thinking)

    def _read(self, text: str, final: bool, strict: bool) -> tuple[str, list[_Call]]:
        """The content and the calls of `text`: in a whole reply (`strict`) the calls that are
        valid and the one the reply was cut inside, its name known (arguments as far as
        written, as a stream sent them); in a stream those whose name is known."""
        if self.tools is None:
            return text, []
        runs: list[list[str]] = [[]]  # content between calls
        found: list[tuple[str, str] | None] = []  # (name, arguments); None: a dropped call
        kept = 0  # calls found, not dropped
        for piece in self.tools.split(text, final):
            if isinstance(piece, str):
                runs[-1].append(piece)
                continue
            call = read_call(piece)
            if strict:
                is_call = call.valid or (final and not call.closed and call.name is not None)
            else:
                # A stream sends a call as soon as its name is known; a span without one is
                # held back while it may still get it.
                is_call = call.name is not None
                if not is_call and not call.closed and not final:
                    break
            if not is_call:
                runs[-1].append(piece.raw)
                continue
            runs.append([])
            # A call has its name here (a valid call has one, a streamed call is sent by it).
            if self.max_calls is None or kept < self.max_calls:
                found.append((call.name, call.arguments))
                kept += 1
            else:
                found.append(None)
        # The content runs between calls lose the whitespace next to a call (and, while more
        # text may come, the whitespace at the end: a call may follow it).
        content, calls = "", []
        for i, run in enumerate(runs):
            piece = "".join(run)
            if i > 0:
                piece = piece.lstrip()
                call_found = found[i - 1]
                if call_found is not None:
                    calls.append(_Call(*call_found, len(content)))
            if i < len(runs) - 1 or not final:
                piece = piece.rstrip()
            content += piece
        return content, calls


class MessageStream:
    """Deltas of one streamed reply: `feed` each piece of generated text, `finish` at the end."""

    def __init__(self, parser: MessageParser) -> None:
        self._parser = parser
        self._text = ""
        self._reasoning = ""
        self._content = ""
        self._calls: list[tuple[str, str]] = []  # (name, arguments sent) of the calls begun

    @property
    def calls_made(self) -> int:
        return len(self._calls)

    def feed(self, text: str) -> MessageDelta:
        if not text:
            return MessageDelta()
        if self._parser.plain:
            return MessageDelta(parts=[text])
        self._text += text
        return self._advance(final=False)

    def finish(self) -> MessageDelta:
        if self._parser.plain:
            return MessageDelta()
        return self._advance(final=True)

    def _advance(self, final: bool) -> MessageDelta:
        parser = self._parser
        reasoning, rest = parser._reasoning(self._text, final)
        content, calls = parser._read(rest, final, strict=False)
        if final and not calls and not self._calls:
            content = rest  # as in a whole reply: no call, so the text as written
        delta = MessageDelta(reasoning=self._new_reasoning(reasoning or ""))
        # A stream cannot take text back: content that no longer extends what was sent (the
        # text as written, at the end of a reply whose syntax had dropped part of it, such as
        # llama3_json's python tag before an object that was no call) is not sent.
        sent = len(self._content) if content.startswith(self._content) else len(content)
        for index, call in enumerate(calls):
            if call.offset > sent:
                delta.parts.append(content[sent : call.offset])
                sent = call.offset
            if index == len(self._calls):
                self._calls.append((call.name, call.arguments))
                delta.parts.append(ToolCallDelta(index, call.name, call.arguments))
                continue
            name, arguments = self._calls[index]
            if len(call.arguments) > len(arguments) and call.arguments.startswith(arguments):
                self._calls[index] = (name, call.arguments)
                delta.parts.append(ToolCallDelta(index, None, call.arguments[len(arguments) :]))
        if len(content) > sent:
            delta.parts.append(content[sent:])
        if len(content) > len(self._content) and content.startswith(self._content):
            self._content = content
        return delta

    def _new_reasoning(self, now: str) -> str:
        sent = self._reasoning
        if len(now) <= len(sent) or not now.startswith(sent):
            return ""
        self._reasoning = now
        return now[len(sent) :]

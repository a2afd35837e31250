"""Anthropic's context editing (`context_management`, the beta `context-management-2025-06-27`):
edits the server applies to a conversation before the model reads it, the client keeping the
whole history and sending it every time.

- `clear_tool_uses_20250919`: once the prompt exceeds the trigger (input tokens, or tool uses),
  the results of all tool uses but the most recent `keep` are replaced by a placeholder (and
  with `clear_tool_inputs` their inputs emptied), those of `exclude_tools` never; with
  `clear_at_least`, nothing is cleared unless that many input tokens would be.
- `clear_thinking_20251015`: the thinking blocks of all assistant turns but the last `keep`
  that carry them are dropped.

Edits apply in the order sent, each to what the one before left. Token counts are the caller's
(`Count`: the conversation rendered and tokenized as the reply's prompt would be), so a trigger
compares the prompt's real size and `cleared_input_tokens` is the real difference. Nothing here
touches the messages it is given: the edits make new ones (a message thread keeps the whole
conversation).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError

from inflight.server.errors import ServerError, invalid_request
from inflight.server.protocol import (
    AnthropicMessage,
    AnthropicThinkingBlock,
    AnthropicToolResultBlock,
    AnthropicToolUseBlock,
    Strict,
)

# What a cleared tool result reads, so that the model knows there was one and that it is gone
# (rather than that the tool answered nothing).
CLEARED_TOOL_RESULT = "[tool result cleared to save context]"

CLEAR_TOOL_USES = "clear_tool_uses_20250919"
CLEAR_THINKING = "clear_thinking_20251015"
# Anthropic's server-side compaction edit: not served, and left out like a field this server
# ignores (named in the reply's ignored-fields header), so that a client sending it beside the
# served edits is answered on the whole conversation rather than refused.
COMPACT = "compact_20260112"

Count = Callable[[list[AnthropicMessage]], Awaitable[int]]

NonNegative = Annotated[int, Field(ge=0)]


# -- the request's edits, as the SDK's types spell them (`BetaContextManagementConfigParam`) ----


class InputTokens(Strict):
    type: Literal["input_tokens"]
    value: NonNegative


class ToolUses(Strict):
    type: Literal["tool_uses"]
    value: NonNegative


class ThinkingTurns(Strict):
    type: Literal["thinking_turns"]
    value: NonNegative


class AllThinkingTurns(Strict):
    type: Literal["all"]


class ClearToolUses(Strict):
    type: Literal["clear_tool_uses_20250919"]
    trigger: Annotated[InputTokens | ToolUses, Field(discriminator="type")] = InputTokens(
        type="input_tokens", value=100_000
    )
    keep: ToolUses = ToolUses(type="tool_uses", value=3)
    clear_at_least: InputTokens | None = None
    exclude_tools: list[str] | None = None
    # True: the inputs of every cleared tool use too; a list: those of the tools it names.
    clear_tool_inputs: bool | list[str] | None = None

    def clears_input(self, name: str) -> bool:
        inputs = self.clear_tool_inputs
        return inputs is True or (isinstance(inputs, list) and name in inputs)


class ClearThinking(Strict):
    type: Literal["clear_thinking_20251015"]
    keep: (
        Annotated[ThinkingTurns | AllThinkingTurns, Field(discriminator="type")] | Literal["all"]
    ) = ThinkingTurns(type="thinking_turns", value=1)

    @property
    def turns_kept(self) -> int | None:
        """The number of most recent thinking turns kept; None: all of them."""
        return self.keep.value if isinstance(self.keep, ThinkingTurns) else None


Edit = Annotated[ClearToolUses | ClearThinking, Field(discriminator="type")]


class ContextManagement(Strict):
    edits: list[Edit] = []


_TAG_FIELD = {"union_tag_invalid": ("type",), "union_tag_not_found": ("type",)}


def parse(raw: Any) -> tuple[ContextManagement, list[str]]:
    """The request's `context_management`, checked: an unknown edit type, a field of the wrong
    type or one no edit has is a 400 naming it (`context_management.edits.0.type`). Compaction
    edits are left out: the second value names where they stand (`context_management.edits.N`)."""
    edits = raw.get("edits") if isinstance(raw, dict) else None
    seen: set[str] = set()
    ignored: list[str] = []
    for i, edit in enumerate(edits if isinstance(edits, list) else []):
        kind = edit.get("type") if isinstance(edit, dict) else None
        where = f"context_management.edits.{i}.type"
        if kind == COMPACT:
            ignored.append(f"context_management.edits.{i}")
            continue
        if kind not in (CLEAR_TOOL_USES, CLEAR_THINKING):
            raise ServerError(
                400,
                f"{where}: unknown context edit type {kind!r}; "
                f"known: {CLEAR_TOOL_USES}, {CLEAR_THINKING} ({COMPACT} is ignored)",
                where,
            )
        if kind in seen:  # one of each: a second would clear by other rules what the first kept
            raise ServerError(400, f"{where}: {kind} is given more than once", where)
        seen.add(kind)
    if ignored:
        assert isinstance(raw, dict) and isinstance(edits, list)
        raw = {**raw, "edits": [e for e in edits if e.get("type") != COMPACT]}
    try:
        return ContextManagement.model_validate(raw), ignored
    except ValidationError as exc:
        # Located as the body's own errors are (the union's tag names dropped); a tag that
        # names no member is its `type` field's error.
        errors = [
            {**e, "loc": ("body", "context_management", *e["loc"], *_TAG_FIELD.get(e["type"], ()))}
            for e in exc.errors(include_url=False)
        ]
        raise invalid_request(errors, {"context_management": raw}) from exc


# -- applying them -----------------------------------------------------------------------------


@dataclass
class Edited:
    """The conversation the model reads, what each edit that cleared something did (the
    response's `context_management.applied_edits`), and the prompt's size before the edits and
    after them (None where no edit needed it counted)."""

    messages: list[AnthropicMessage]
    applied_edits: list[dict[str, Any]] = field(default_factory=list)
    original_input_tokens: int | None = None
    input_tokens: int | None = None
    # Where the request's edits left out (compaction) stand, for the ignored-fields header.
    ignored: list[str] = field(default_factory=list)


async def apply(
    config: ContextManagement,
    messages: list[AnthropicMessage],
    count: Count,
) -> Edited:
    """`messages` with `config`'s edits applied in order; `count` gives a conversation's prompt
    tokens, asked only where an edit needs them."""
    edited = Edited(list(messages))

    async def tokens() -> int:
        """The prompt tokens of the conversation as edited so far (counted once)."""
        if edited.input_tokens is None:
            edited.input_tokens = await count(edited.messages)
            if edited.original_input_tokens is None:
                edited.original_input_tokens = edited.input_tokens
        return edited.input_tokens

    for edit in config.edits:
        if isinstance(edit, ClearToolUses):
            if isinstance(edit.trigger, ToolUses):
                triggered = len(_tool_uses(edited.messages)) > edit.trigger.value
            else:
                triggered = await tokens() > edit.trigger.value
            if not triggered:
                continue
            after, cleared = clear_tool_uses(edited.messages, edit)
            record = {"type": edit.type, "cleared_tool_uses": cleared}
        else:
            after, cleared = clear_thinking(edited.messages, edit)
            record = {"type": edit.type, "cleared_thinking_turns": cleared}
        if not cleared:
            continue
        before = await tokens()
        after_tokens = await count(after)
        saved = before - after_tokens
        least = edit.clear_at_least if isinstance(edit, ClearToolUses) else None
        if saved <= 0 or (least is not None and saved < least.value):
            # Nothing saved (results shorter than the placeholder), or not worth breaking the
            # prompt's cached prefix for: the conversation stays as it was.
            continue
        edited.messages, edited.input_tokens = after, after_tokens
        edited.applied_edits.append({**record, "cleared_input_tokens": saved})
    return edited


def _tool_uses(messages: list[AnthropicMessage]) -> list[AnthropicToolUseBlock]:
    """The conversation's tool uses (its assistants' tool_use blocks), oldest first."""
    return [
        block
        for m in messages
        if m.role == "assistant" and not isinstance(m.content, str)
        for block in m.content
        if isinstance(block, AnthropicToolUseBlock)
    ]


def clear_tool_uses(
    messages: list[AnthropicMessage], edit: ClearToolUses
) -> tuple[list[AnthropicMessage], int]:
    """(the conversation with the results of its older tool uses cleared, how many tool uses
    were cleared). The most recent `keep` tool uses stay whatever their tools; the older ones
    of excluded tools stay too. A tool use counts as cleared when its result, or its input
    where `clear_tool_inputs` says so, changed (one cleared before is not cleared again)."""
    uses = _tool_uses(messages)
    kept = edit.keep.value
    older = uses[: len(uses) - kept] if kept < len(uses) else []
    excluded = set(edit.exclude_tools or ())
    targets = {u.id for u in older if u.name not in excluded}
    if not targets:
        return messages, 0
    out = list(messages)
    cleared: set[str] = set()
    for i, m in enumerate(messages):
        if isinstance(m.content, str):
            continue
        content, changed = list(m.content), False
        for j, block in enumerate(content):
            if (
                isinstance(block, AnthropicToolUseBlock)
                and block.id in targets
                and edit.clears_input(block.name)
                and block.input
            ):
                content[j], changed = block.model_copy(update={"input": {}}), True
                cleared.add(block.id)
            elif (
                isinstance(block, AnthropicToolResultBlock)
                and block.tool_use_id in targets
                and block.content != CLEARED_TOOL_RESULT
            ):
                content[j] = block.model_copy(update={"content": CLEARED_TOOL_RESULT})
                cleared.add(block.tool_use_id)
                changed = True
        if changed:
            out[i] = m.model_copy(update={"content": content})
    return (out, len(cleared)) if cleared else (messages, 0)


def _is_thinking(block: Any) -> bool:
    # A redacted_thinking block (thinking the API encrypted) is a turn's thinking too.
    return isinstance(block, AnthropicThinkingBlock) or (
        getattr(block, "type", None) == "redacted_thinking"
    )


def clear_thinking(
    messages: list[AnthropicMessage], edit: ClearThinking
) -> tuple[list[AnthropicMessage], int]:
    """(the conversation with the thinking blocks of its older thinking turns dropped, how many
    turns lost theirs). A thinking turn is an assistant message carrying thinking blocks; the
    last `keep` of them keep theirs."""
    turns = [
        i
        for i, m in enumerate(messages)
        if m.role == "assistant"
        and not isinstance(m.content, str)
        and any(_is_thinking(b) for b in m.content)
    ]
    kept = edit.turns_kept
    if kept is None or kept >= len(turns):
        return messages, 0
    out = list(messages)
    for i in turns[: len(turns) - kept]:
        content = [b for b in out[i].content if not _is_thinking(b)]
        out[i] = out[i].model_copy(update={"content": content})
    return out, len(turns) - kept

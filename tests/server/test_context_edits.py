"""Context editing's edits (`context_edits.py`) on parsed Anthropic conversations, counted by a
stand-in tokenizer (a word per whitespace-separated piece of the messages' JSON)."""

import asyncio
import json

import pytest

from inflight.server.context_edits import CLEARED_TOOL_RESULT, apply, parse
from inflight.server.errors import ServerError
from inflight.server.protocol import AnthropicMessage


def conversation(*tools: str, thinking: bool = False) -> list[AnthropicMessage]:
    """A user's question, then for each tool an assistant's call of it (with its thinking) and
    the user's tool result, then a closing question."""
    raw: list[dict] = [{"role": "user", "content": "Plan my trip."}]
    for i, name in enumerate(tools):
        call = {"type": "tool_use", "id": f"t{i}", "name": name, "input": {"n": i, "q": "x y"}}
        content = [call]
        if thinking:
            content.insert(0, {"type": "thinking", "thinking": f"think {i} a b c", "signature": ""})
        raw.append({"role": "assistant", "content": content})
        result = f"the {name} answer number {i} with several words in it"
        raw.append(
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": f"t{i}", "content": result}],
            }
        )
    raw.append({"role": "user", "content": "So?"})
    return [AnthropicMessage.model_validate(m) for m in raw]


def dumped(messages: list[AnthropicMessage]) -> list[dict]:
    return [m.model_dump(exclude_none=True) for m in messages]


class Counter:
    """A stand-in count of a conversation's prompt tokens, which notes how often it is asked."""

    def __init__(self) -> None:
        self.calls = 0

    def tokens(self, messages: list[AnthropicMessage]) -> int:
        return len(json.dumps(dumped(messages)).split())

    async def __call__(self, messages: list[AnthropicMessage]) -> int:
        self.calls += 1
        return self.tokens(messages)


def edit(messages, *edits):
    count = Counter()
    config, ignored = parse({"edits": list(edits)})
    assert ignored == []
    edited = asyncio.run(apply(config, messages, count))
    return edited, count


def _fields(messages: list[AnthropicMessage], kind: str, name: str) -> list:
    """The field `name` of the blocks of type `kind`, in order."""
    return [
        getattr(b, name)
        for m in messages
        if not isinstance(m.content, str)
        for b in m.content
        if b.type == kind
    ]


def results(messages: list[AnthropicMessage]) -> list[str]:
    """The tool results' contents, in order."""
    return _fields(messages, "tool_result", "content")


def inputs(messages: list[AnthropicMessage]) -> list[dict]:
    return _fields(messages, "tool_use", "input")


def tool_edit(trigger=0, **fields):
    return {
        "type": "clear_tool_uses_20250919",
        "trigger": {"type": "input_tokens", "value": trigger},
        **fields,
    }


def keep(n):
    return {"type": "tool_uses", "value": n}


def test_an_untriggered_edit_leaves_the_conversation_as_sent():
    messages = conversation("a", "b", "c", "d", "e")
    size = Counter().tokens(messages)
    edited, _ = edit(messages, tool_edit(trigger=size, keep=keep(1)))
    assert edited.messages == messages and edited.applied_edits == []
    assert edited.input_tokens == edited.original_input_tokens == size
    # The default trigger is 100,000 input tokens; the default keep 3 tool uses.
    edited, _ = edit(messages, {"type": "clear_tool_uses_20250919"})
    assert edited.messages == messages and edited.applied_edits == []


def test_the_oldest_tool_results_are_cleared_keeping_the_most_recent():
    messages = conversation("a", "b", "c", "d", "e")
    sent = dumped(messages)
    edited, _ = edit(messages, tool_edit())  # keep: 3 by default
    assert results(edited.messages) == [CLEARED_TOOL_RESULT] * 2 + results(messages)[2:]
    assert inputs(edited.messages) == inputs(messages)  # the inputs stay by default
    before, after = Counter().tokens(messages), Counter().tokens(edited.messages)
    assert edited.applied_edits == [
        {
            "type": "clear_tool_uses_20250919",
            "cleared_tool_uses": 2,
            "cleared_input_tokens": before - after,
        }
    ]
    assert before - after > 0
    assert (edited.original_input_tokens, edited.input_tokens) == (before, after)
    assert dumped(messages) == sent  # the messages given are untouched
    edited, _ = edit(messages, tool_edit(keep=keep(1)))
    assert results(edited.messages)[:4] == [CLEARED_TOOL_RESULT] * 4
    assert edited.applied_edits[0]["cleared_tool_uses"] == 4
    edited, _ = edit(messages, tool_edit(keep=keep(0)))
    assert results(edited.messages) == [CLEARED_TOOL_RESULT] * 5


def test_excluded_tools_are_never_cleared():
    messages = conversation("search", "memory", "search", "memory", "search")
    edited, _ = edit(messages, tool_edit(keep=keep(1), exclude_tools=["memory"]))
    got = results(edited.messages)
    assert got[1] == results(messages)[1] and got[3] == results(messages)[3]
    assert got[0] == got[2] == CLEARED_TOOL_RESULT and got[4] == results(messages)[4]
    assert edited.applied_edits[0]["cleared_tool_uses"] == 2
    # Only excluded tools are old enough to clear: nothing is, and nothing is reported.
    only_memory = conversation("memory", "memory", "search")
    edited, _ = edit(only_memory, tool_edit(keep=keep(1), exclude_tools=["memory"]))
    assert edited.applied_edits == []


def test_clear_tool_inputs_empties_the_cleared_calls_inputs():
    messages = conversation("a", "b", "c")
    edited, _ = edit(messages, tool_edit(keep=keep(1), clear_tool_inputs=True))
    assert inputs(edited.messages) == [{}, {}, {"n": 2, "q": "x y"}]
    assert results(edited.messages)[:2] == [CLEARED_TOOL_RESULT] * 2
    # A list names the tools whose inputs are cleared.
    edited, _ = edit(messages, tool_edit(keep=keep(0), clear_tool_inputs=["b"]))
    assert inputs(edited.messages) == [{"n": 0, "q": "x y"}, {}, {"n": 2, "q": "x y"}]
    assert edited.applied_edits[0]["cleared_tool_uses"] == 3


def test_clear_at_least_clears_nothing_unless_that_many_tokens_would_go():
    messages = conversation("a", "b", "c", "d")
    whole, _ = edit(messages, tool_edit(keep=keep(1)))
    freed = whole.applied_edits[0]["cleared_input_tokens"]
    least = {"type": "input_tokens", "value": freed + 1}
    edited, _ = edit(messages, tool_edit(keep=keep(1), clear_at_least=least))
    assert edited.messages == messages and edited.applied_edits == []
    assert edited.input_tokens == edited.original_input_tokens
    least["value"] = freed
    edited, _ = edit(messages, tool_edit(keep=keep(1), clear_at_least=least))
    assert edited.applied_edits == whole.applied_edits
    assert dumped(edited.messages) == dumped(whole.messages)


def test_results_shorter_than_the_placeholder_are_not_cleared_to_a_larger_prompt():
    """Replacing a short result by the placeholder would grow the prompt and report a negative
    count of cleared tokens (the AI SDK surfaced -1): the edit is then not applied."""
    raw = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t0", "name": "w", "input": {"c": "P"}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t0", "content": "ok"}],
        },
    ]
    messages = [AnthropicMessage.model_validate(m) for m in raw]
    edited, _ = edit(messages, tool_edit(keep=keep(0)))
    assert edited.messages == messages and edited.applied_edits == []
    assert edited.input_tokens == edited.original_input_tokens


def test_a_tool_uses_trigger_counts_the_conversations_tool_uses():
    messages = conversation("a", "b", "c")
    trigger = {"type": "tool_uses", "value": 3}
    edited, count = edit(messages, tool_edit(trigger=0, keep=keep(1)) | {"trigger": trigger})
    assert edited.applied_edits == [] and count.calls == 0  # not exceeded: nothing counted
    trigger["value"] = 2
    edited, _ = edit(messages, tool_edit(keep=keep(1)) | {"trigger": trigger})
    assert edited.applied_edits[0]["cleared_tool_uses"] == 2


def test_thinking_is_kept_for_the_last_thinking_turns():
    messages = conversation("a", "b", "c", thinking=True)

    def thoughts(edited):
        return [
            [b.thinking for b in m.content if b.type == "thinking"]
            for m in edited
            if m.role == "assistant"
        ]

    edited, _ = edit(messages, {"type": "clear_thinking_20251015"})  # keep: 1 turn by default
    assert thoughts(edited.messages) == [[], [], ["think 2 a b c"]]
    before, after = Counter().tokens(messages), Counter().tokens(edited.messages)
    assert edited.applied_edits == [
        {
            "type": "clear_thinking_20251015",
            "cleared_thinking_turns": 2,
            "cleared_input_tokens": before - after,
        }
    ]
    # The calls stay where the thinking went.
    assert inputs(edited.messages) == inputs(messages)
    two = {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 2}}
    assert thoughts(edit(messages, two)[0].messages) == [[], ["think 1 a b c"], ["think 2 a b c"]]
    for every in ("all", {"type": "all"}):
        kept, count = edit(messages, {"type": "clear_thinking_20251015", "keep": every})
        assert kept.messages == messages and kept.applied_edits == [] and count.calls == 0
    # A turn without thinking is no thinking turn; redacted thinking is thinking.
    raw = dumped(messages)
    raw[3]["content"][0] = {"type": "redacted_thinking", "data": "opaque"}
    raw[5]["content"] = raw[5]["content"][1:]
    messages = [AnthropicMessage.model_validate(m) for m in raw]
    edited, _ = edit(messages, {"type": "clear_thinking_20251015"})
    kinds = [[b.type for b in m.content] for m in edited.messages if m.role == "assistant"]
    assert kinds == [["tool_use"], ["redacted_thinking", "tool_use"], ["tool_use"]]
    assert edited.applied_edits[0]["cleared_thinking_turns"] == 1


def test_edits_apply_in_order_each_counted_from_what_the_one_before_left():
    messages = conversation("a", "b", "c", thinking=True)
    edited, count = edit(messages, {"type": "clear_thinking_20251015"}, tool_edit(keep=keep(1)))
    sizes = [Counter().tokens(messages)]
    thinking_only, _ = edit(messages, {"type": "clear_thinking_20251015"})
    sizes.append(Counter().tokens(thinking_only.messages))
    sizes.append(Counter().tokens(edited.messages))
    assert edited.applied_edits == [
        {
            "type": "clear_thinking_20251015",
            "cleared_thinking_turns": 2,
            "cleared_input_tokens": sizes[0] - sizes[1],
        },
        {
            "type": "clear_tool_uses_20250919",
            "cleared_tool_uses": 2,
            "cleared_input_tokens": sizes[1] - sizes[2],
        },
    ]
    assert (edited.original_input_tokens, edited.input_tokens) == (sizes[0], sizes[2])
    assert count.calls == 3  # each size once


@pytest.mark.parametrize(
    ("edits", "where", "says"),
    [
        ([{"type": "clear_everything"}], "context_management.edits.0.type", "unknown"),
        ([{"keep": "all"}], "context_management.edits.0.type", "unknown"),
        (
            [{"type": "clear_thinking_20251015"}, {"type": "clear_thinking_20251015"}],
            "context_management.edits.1.type",
            "more than once",
        ),
        (
            [{"type": "clear_tool_uses_20250919", "keep": {"type": "thinking_turns", "value": 1}}],
            "context_management.edits.0.keep.type",
            "tool_uses",
        ),
        (
            [{"type": "clear_tool_uses_20250919", "trigger": {"type": "turns", "value": 1}}],
            "context_management.edits.0.trigger.type",
            "input_tokens",
        ),
        (
            [{"type": "clear_tool_uses_20250919", "keep": {"type": "tool_uses", "value": -1}}],
            "context_management.edits.0.keep.value",
            "greater than or equal to 0",
        ),
        (
            [{"type": "clear_tool_uses_20250919", "clear_at_least": {"type": "input_tokens"}}],
            "context_management.edits.0.clear_at_least.value",
            "required",
        ),
        (
            [{"type": "clear_tool_uses_20250919", "exclude_tool": ["a"]}],
            "context_management.edits.0.exclude_tool",
            "unknown field",
        ),
        (
            [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": "x"}}],
            "context_management.edits.0.keep.value",
            "integer",
        ),
    ],
)
def test_a_bad_edit_is_a_400_naming_its_place(edits, where, says):
    with pytest.raises(ServerError) as info:
        parse({"edits": edits})
    assert info.value.status == 400 and info.value.param == where
    assert info.value.message.startswith(f"{where}: ") and says in info.value.message


def test_a_compaction_edit_is_left_out_and_named_where_it_stands():
    config, ignored = parse(
        {
            "edits": [
                {"type": "compact_20260112", "trigger": {}},
                {"type": "clear_thinking_20251015"},
            ]
        }
    )
    assert ignored == ["context_management.edits.0"]
    assert [e.type for e in config.edits] == ["clear_thinking_20251015"]

"""Context editing (`context_management`) over a real server, driven by the official client's
beta API: the model reads the edited conversation, and the edits' numbers are the real
tokenizer's."""

import anthropic
import pytest

from inflight.server.context_edits import CLEARED_TOOL_RESULT

from server_harness import prompt_of, serve

pytestmark = pytest.mark.slow

MODEL = "test-model"
BETA = ["context-management-2025-06-27"]
GREEDY = {"extra_body": {"temperature": 0}}
# A template that shows the model everything an edit may clear: thinking, tool calls' inputs
# and tool results (the default model's own leaves out the first two). It reads `tools`, so
# that it renders the conversations with tools too.
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>\n{% endif %}"
    "{{ m.content }}"
    "{% for c in m.tool_calls or [] %}\n<tool_call>{{ c.function.name }} "
    "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [
    {
        "name": name,
        "description": f"The {name} tool",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
    for name in ("get_weather", "remember")
]
# The tools are the conversation's; the replies only answer in text (this template has no
# tool-call parser to read a call).
TOOLING = {"tools": TOOLS, "tool_choice": {"type": "none"}}


@pytest.fixture(scope="module")
def client(server_llm):
    with serve(server_llm, chat_template=TEMPLATE) as (url, _):
        yield anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)


def trip(cleared=(), inputs_cleared=(), thinking_kept=None):
    """Four tool uses (the third of `remember`) with their thinking, then a question: the tool
    uses of `cleared` with their results replaced as the edits replace them (and the inputs of
    `inputs_cleared` emptied), the thinking only of the turns of `thinking_kept` (all: None)."""
    cities = ["Paris", "Rome", "Oslo", "Lima"]
    messages = [{"role": "user", "content": "Check the weather in four cities."}]
    for i, city in enumerate(cities):
        name = "remember" if i == 2 else "get_weather"
        call = {
            "type": "tool_use",
            "id": f"toolu_{i}",
            "name": name,
            "input": {} if i in inputs_cleared else {"city": city},
        }
        content = [call]
        if thinking_kept is None or i in thinking_kept:
            thought = {"type": "thinking", "thinking": f"Next I look up {city}.", "signature": ""}
            content.insert(0, thought)
        messages.append({"role": "assistant", "content": content})
        result = f"In {city} it is {10 + i} degrees with light wind from the west all day."
        result = CLEARED_TOOL_RESULT if i in cleared else result
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": result}
                ],
            }
        )
    messages.append({"role": "user", "content": "Which city is warmest?"})
    return messages


def counted(client, messages):
    return client.messages.count_tokens(model=MODEL, messages=messages, tools=TOOLS).input_tokens


def create(client, messages, edits, **fields):
    return client.beta.messages.create(
        model=MODEL,
        max_tokens=6,
        messages=messages,
        **TOOLING,
        context_management={"edits": edits},
        betas=BETA,
        **GREEDY,
        **fields,
    )


def test_old_tool_results_are_cleared_before_the_model_reads_them(client):
    sent, read = trip(), trip(cleared=(0, 1))
    original, edited = counted(client, sent), counted(client, read)
    edit = {
        "type": "clear_tool_uses_20250919",
        "trigger": {"type": "input_tokens", "value": original - 1},
        "keep": {"type": "tool_uses", "value": 2},
    }
    raw = client.beta.messages.with_raw_response.create(
        model=MODEL,
        max_tokens=6,
        messages=sent,
        **TOOLING,
        context_management={"edits": [edit]},
        betas=BETA,
        **GREEDY,
    )
    assert "x-inflight-ignored-fields" not in raw.http_response.headers  # applied, not ignored
    message = raw.parse()
    assert prompt_of(message.usage) == edited < original
    (applied,) = message.context_management.applied_edits
    assert applied.type == "clear_tool_uses_20250919"
    assert (applied.cleared_tool_uses, applied.cleared_input_tokens) == (2, original - edited)
    # What the model read: the reply is the one to the conversation edited by hand.
    by_hand = client.beta.messages.create(
        model=MODEL, max_tokens=6, messages=read, **TOOLING, betas=BETA, **GREEDY
    )
    assert message.content[0].text == by_hand.content[0].text
    assert by_hand.context_management is None  # none asked, none reported
    # Streamed: the edits come on message_delta, the edited size on message_start.
    with client.beta.messages.stream(
        model=MODEL,
        max_tokens=6,
        messages=sent,
        **TOOLING,
        context_management={"edits": [edit]},
        betas=BETA,
        **GREEDY,
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    (delta,) = [e for e in events if e.type == "message_delta"]
    assert delta.context_management.applied_edits == message.context_management.applied_edits
    assert prompt_of(final.usage) == edited
    assert final.context_management == message.context_management
    assert final.content[0].text == message.content[0].text
    # Counted: the size after the edits, and the conversation's as sent.
    count = client.beta.messages.count_tokens(
        model=MODEL, messages=sent, **TOOLING, context_management={"edits": [edit]}, betas=BETA
    )
    assert count.input_tokens == edited
    assert count.context_management.original_input_tokens == original
    # Not past the trigger: the conversation is read as sent, and no edit is reported.
    untriggered = {**edit, "trigger": {"type": "input_tokens", "value": original}}
    message = create(client, sent, [untriggered])
    assert prompt_of(message.usage) == original
    assert message.context_management.applied_edits == []
    # Server-side compaction beside it: left out and named, the clearing applied all the same.
    raw = client.beta.messages.with_raw_response.create(
        model=MODEL,
        max_tokens=6,
        messages=sent,
        **TOOLING,
        context_management={"edits": [{"type": "compact_20260112"}, edit]},
        betas=BETA,
        **GREEDY,
    )
    assert raw.http_response.headers["x-inflight-ignored-fields"] == "context_management.edits.0"
    assert prompt_of(raw.parse().usage) == edited


def test_thinking_inputs_and_excluded_tools_as_edited_together(client):
    sent = trip()
    # Thinking kept for the last turn; of the tool uses before the last one, those of
    # get_weather cleared with their inputs, remember's kept.
    after_thinking = trip(thinking_kept=(3,))
    read = trip(cleared=(0, 1), inputs_cleared=(0, 1), thinking_kept=(3,))
    sizes = [counted(client, c) for c in (sent, after_thinking, read)]
    assert sizes[0] > sizes[1] > sizes[2]  # the template shows what each edit clears
    edits = [
        {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}},
        {
            "type": "clear_tool_uses_20250919",
            "trigger": {"type": "tool_uses", "value": 3},
            "keep": {"type": "tool_uses", "value": 1},
            "exclude_tools": ["remember"],
            "clear_tool_inputs": True,
        },
    ]
    message = create(client, sent, edits)
    assert prompt_of(message.usage) == sizes[2]
    assert [e.model_dump() for e in message.context_management.applied_edits] == [
        {
            "type": "clear_thinking_20251015",
            "cleared_thinking_turns": 3,
            "cleared_input_tokens": sizes[0] - sizes[1],
        },
        {
            "type": "clear_tool_uses_20250919",
            "cleared_tool_uses": 2,
            "cleared_input_tokens": sizes[1] - sizes[2],
        },
    ]
    by_hand = client.messages.create(model=MODEL, max_tokens=6, messages=read, **TOOLING, **GREEDY)
    assert message.content[0].text == by_hand.content[0].text
    # With clear_at_least more than the tool edit frees, it clears nothing.
    least = {"type": "input_tokens", "value": sizes[1] - sizes[2] + 1}
    message = create(client, sent, [edits[0], {**edits[1], "clear_at_least": least}])
    assert prompt_of(message.usage) == sizes[1]
    assert [e.type for e in message.context_management.applied_edits] == ["clear_thinking_20251015"]


def test_a_bad_edit_is_a_400_naming_it(client):
    for edits, where in (
        ([{"type": "clear_everything"}], "context_management.edits.0.type"),
        (
            [{"type": "clear_tool_uses_20250919", "keep": {"type": "tool_uses", "value": "x"}}],
            "context_management.edits.0.keep.value",
        ),
    ):
        with pytest.raises(anthropic.BadRequestError) as info:
            create(client, trip(), edits)
        assert info.value.body["error"]["message"].startswith(f"{where}: ")
        with pytest.raises(anthropic.BadRequestError):
            client.beta.messages.count_tokens(
                model=MODEL, messages=trip(), context_management={"edits": edits}, betas=BETA
            )


def test_a_conversation_too_long_as_sent_is_refused_before_its_edits(client):
    """The edits count the conversation as sent, so it must fit the context: Anthropic's
    "prompt is too long" 400, prefixed by what counted it."""
    long = [{"role": "user", "content": "word " * 600}]
    edit = {"type": "clear_tool_uses_20250919"}
    with pytest.raises(anthropic.BadRequestError) as info:
        create(client, long, [edit])
    message = info.value.body["error"]["message"]
    prefix = "context_management counts the conversation as sent, before its edits: "
    assert message.startswith(prefix + "prompt is too long: ")
    assert message.endswith(" tokens > 511 maximum")

"""The Anthropic request's mapping onto the chat path: tools (deferred, strict, with examples)
and tool results."""

import pytest

from inflight.server.anthropic import chat_messages, offered_tools
from inflight.server.errors import ServerError
from inflight.server.protocol import AnthropicMessagesRequest

SCHEMA = {"type": "object", "properties": {"q": {"type": "string"}}}


def body(tools, messages):
    return AnthropicMessagesRequest.model_validate(
        {"model": "m", "max_tokens": 8, "tools": tools, "messages": messages}
    )


def tool(name, **fields):
    return {"name": name, "description": f"The {name} tool", "input_schema": SCHEMA, **fields}


def searched(*names, text=None):
    """A conversation whose tool search answered with `tool_reference` blocks for `names`."""
    content = [{"type": "tool_reference", "tool_name": n} for n in names]
    if text is not None:
        content.insert(0, {"type": "text", "text": text})
    return [
        {"role": "user", "content": "Find a tool."},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "search", "input": {}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": content}],
        },
    ]


def test_a_deferred_tool_is_offered_only_once_a_tool_reference_loads_it():
    tools = [tool("search"), tool("lookup", defer_loading=True), tool("other", defer_loading=True)]
    assert [t.name for t in offered_tools(body(tools, [{"role": "user", "content": "Hi"}]))] == [
        "search"
    ]
    loaded = offered_tools(body(tools, searched("lookup")))
    assert [t.name for t in loaded] == ["search", "lookup"]
    assert loaded[1].description == "The lookup tool" and loaded[1].parameters == SCHEMA


def test_a_tool_reference_reads_as_the_tool_it_loads():
    (_, _, result) = chat_messages(
        None, body([], searched("lookup", "other", text="Found:")).messages
    )
    assert result == {
        "role": "tool",
        "tool_call_id": "toolu_1",
        "content": "Found:\nTool loaded: lookup\nTool loaded: other",
    }


def test_a_tool_reference_to_no_tool_of_the_request_is_refused():
    with pytest.raises(ServerError) as info:
        offered_tools(body([tool("search")], searched("missing")))
    assert info.value.status == 400 and "'missing'" in info.value.message


def test_strict_and_input_examples_reach_the_function_tool():
    (t,) = offered_tools(
        body(
            [
                tool(
                    "lookup",
                    strict=True,
                    input_examples=[{"q": "weather"}, {"q": "time"}],
                    eager_input_streaming=True,
                    allowed_callers=["direct"],
                )
            ],
            [{"role": "user", "content": "Hi"}],
        )
    )
    assert t.strict
    assert t.description == ('The lookup tool\n\nInput examples:\n{"q": "weather"}\n{"q": "time"}')


def system(*blocks, **fields):
    return {"role": "system", "content": list(blocks), **fields}


def change(kind, **tool):
    return {"type": kind, "tool": tool}


def test_system_messages_add_and_remove_tools_from_where_they_stand():
    tools = [tool("search"), tool("lookup", defer_loading=True)]
    messages = [
        {"role": "user", "content": "Hi"},
        system(
            {"type": "text", "text": "More tools now."},
            change("tool_addition", type="tool_reference", name="lookup"),
            change("tool_addition", type="tool_definition", definition=tool("inline")),
        ),
        {"role": "user", "content": "Go on"},
        system(change("tool_removal", type="tool_reference", name="search")),
    ]
    request = body(tools, messages)
    assert [t.name for t in offered_tools(request)] == ["lookup", "inline"]
    rendered = chat_messages(None, request.messages)
    assert [m["content"] for m in rendered if m["role"] == "system"] == [
        "More tools now.\nTool added: lookup\nTool added: inline",
        "Tool removed: search",
    ]


@pytest.mark.parametrize(
    "block",
    [
        change("tool_removal", type="tool_reference", name="missing"),
        change("tool_addition", type="mcp_toolset_reference", mcp_server_name="s"),
        change("tool_removal", type="tool_definition", definition=tool("x")),
    ],
)
def test_a_tool_change_that_cannot_be_served_is_refused(block):
    with pytest.raises(ServerError) as info:
        offered_tools(body([tool("search")], [{"role": "user", "content": "Hi"}, system(block)]))
    assert info.value.status == 400


def test_a_system_message_cleared_at_the_next_user_message_is_shown_for_its_turn_only():
    note = system({"type": "text", "text": "Answer in French."}, clear_at="next_user_message")
    first = [{"role": "user", "content": "Hi"}, note]
    assert [m["role"] for m in chat_messages(None, body([], first).messages)] == [
        "user",
        "system",
    ]
    later = [*first, {"role": "assistant", "content": "Salut"}, {"role": "user", "content": "?"}]
    assert [m["role"] for m in chat_messages(None, body([], later).messages)] == [
        "user",
        "assistant",
        "user",
    ]
    with pytest.raises(ServerError):
        chat_messages(
            None, body([], [{"role": "user", "content": "Hi", "clear_at": "never"}]).messages
        )

"""The OpenAI Responses API over a real server, driven by the official `openai` client: a
request is served as a chat completion is (same prompt, same greedy output), its reply rendered
as output items or typed stream events, and stored responses continue conversations."""

import asyncio
import json
import time

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from test_tools_server import PARAMETERS

from inflight import SamplingParams
from inflight.protocol.outputs import StreamChunk
from inflight.server import compaction
from inflight.server.chat_templates import HERMES_TEMPLATE
from inflight.server.conversations import ConversationStore
from inflight.server.errors import ServerError
from inflight.server.parsers import MessageParser
from inflight.server.responses import (
    BackgroundJob,
    EventLog,
    ResponseReply,
    ResponseStore,
    StoredResponse,
    Turn,
    chat_messages,
)
from inflight.server.responses_protocol import ResponsesRequest

from server_harness import serve

pytestmark = pytest.mark.slow

MODEL = "test-model"
QUESTION = "What is the capital of France?"
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": PARAMETERS,
        "strict": True,
    }
]
# The same tool as chat templates read it.
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": PARAMETERS,
        },
    }
]
GREEDY = {"temperature": 0, "max_output_tokens": 24}
# The stream of a reply with one message, before and after its text deltas.
MESSAGE_OPENING = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
MESSAGE_CLOSING = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]
# ChatML whose prompt opens the reasoning block with enable_thinking, closes an empty one
# without it (as Qwen's templates do).
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking %}<think>\n"
    "{% else %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def server(server_llm):
    with serve(server_llm, tool_call_parser="hermes") as (url, _):
        yield url


@pytest.fixture
def oa(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


_EVENT = TypeAdapter(ResponseStreamEvent)


def _checked(reply):
    """`reply` (a response or a stream's events) validated against the SDK's models: the SDK
    itself builds them without validation."""
    for event in reply if isinstance(reply, list) else []:
        _EVENT.validate_python(event.model_dump(exclude_unset=True))
    if not isinstance(reply, list):
        Response.model_validate(reply.model_dump(exclude_unset=True))
    return reply


def _expected(llm, messages, max_tokens=24, **template):
    return llm.chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens), **template)[0]


def _status(finish_reason: str) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def test_text_response_equals_the_chat_path(oa, server_llm):
    expected = _expected(server_llm, [{"role": "user", "content": QUESTION}])
    reply = _checked(oa.responses.create(model=MODEL, input=QUESTION, **GREEDY))
    assert reply.id.startswith("resp_") and reply.object == "response"
    assert reply.output_text == expected.text
    (message,) = reply.output
    assert message.type == "message" and message.id.startswith("msg_")
    assert message.role == "assistant" and message.content[0].type == "output_text"
    assert reply.status == _status(expected.finish_reason)
    # Only a completed response has a completion time (the SDK's reading of the field).
    assert (reply.completed_at is not None) == (reply.status == "completed")
    assert reply.usage.input_tokens == expected.prompt_tokens
    assert reply.usage.output_tokens == len(expected.token_ids)
    assert reply.usage.total_tokens == expected.prompt_tokens + len(expected.token_ids)
    assert reply.model == MODEL and reply.temperature == 0 and reply.max_output_tokens == 24
    cut = oa.responses.create(model=MODEL, input=QUESTION, **{**GREEDY, "max_output_tokens": 16})
    assert cut.status == "incomplete" and cut.completed_at is None


def test_streamed_events_add_up_to_the_whole_response(oa):
    whole = oa.responses.create(model=MODEL, input=QUESTION, **GREEDY)
    events = _checked(list(oa.responses.create(model=MODEL, input=QUESTION, stream=True, **GREEDY)))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == [
        *MESSAGE_OPENING,
        *["response.output_text.delta"] * len(deltas),
        *MESSAGE_CLOSING,
        f"response.{whole.status}",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in deltas)
    assert text == whole.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == text
    final = events[-1].response
    assert final.id == events[0].response.id and final.output_text == text
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens
    item = next(e.item for e in events if e.type == "response.output_item.done")
    assert {e.item_id for e in deltas} == {item.id} == {final.output[0].id}


def test_stream_helper_gives_the_final_response(oa):
    with oa.responses.stream(model=MODEL, input="Say hello.", temperature=0) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "".join(texts)


def test_instructions_are_a_system_message_in_front(oa, server_llm):
    instructions = "Answer in one word."
    messages = [{"role": "system", "content": instructions}, {"role": "user", "content": QUESTION}]
    expected = _expected(server_llm, messages)
    reply = oa.responses.create(model=MODEL, input=QUESTION, instructions=instructions, **GREEDY)
    assert reply.instructions == instructions
    assert reply.output_text == expected.text
    assert reply.usage.input_tokens == expected.prompt_tokens


def test_message_items_with_parts_read_as_chat_messages(oa, server_llm):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": QUESTION},
    ]
    items = [
        {"type": "message", "role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Hello!", "annotations": []}],
        },
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
    ]
    expected = _expected(server_llm, messages)
    reply = oa.responses.create(model=MODEL, input=items, **GREEDY)
    assert reply.output_text == expected.text
    assert reply.usage.input_tokens == expected.prompt_tokens


def test_required_tool_choice_returns_a_valid_function_call(oa):
    reply = oa.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=TOOLS,
        tool_choice="required",
        **GREEDY | {"max_output_tokens": 40},
    )
    assert reply.status == "completed"
    (call,) = reply.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), PARAMETERS)
    assert reply.tool_choice == "required" and reply.tools[0].name == "get_weather"
    # Streamed: the call's arguments in deltas, the same call in the end.
    with oa.responses.stream(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=TOOLS,
        tool_choice="required",
        **GREEDY | {"max_output_tokens": 40},
    ) as stream:
        events = _checked(list(stream))
        final = stream.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    (streamed,) = final.output
    assert "".join(deltas) == done.arguments == streamed.arguments == call.arguments
    assert streamed.name == "get_weather" and streamed.parsed_arguments == json.loads(
        call.arguments
    )


def test_a_named_tool_choice_calls_that_function(oa):
    reply = oa.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        **GREEDY | {"max_output_tokens": 40},
    )
    (call,) = reply.output
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), PARAMETERS)


def test_allowed_tools_offer_only_the_tools_they_name(oa, server):
    tools = [*TOOLS, {"type": "function", "name": "get_time", "description": "The time now"}]
    choice = {
        "type": "allowed_tools",
        "mode": "required",
        "tools": [{"type": "function", "name": "get_time"}],
    }
    reply = oa.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=False,
        **GREEDY | {"max_output_tokens": 40},
    )
    (call,) = reply.output
    assert call.type == "function_call" and call.name == "get_time"
    assert reply.tool_choice.type == "allowed_tools"
    for listed, param in (
        ([{"type": "function", "name": "get_stock_price"}], "tool_choice.tools.0"),
        ([{"type": "mcp", "server_label": "deepwiki"}], "tool_choice.tools.0"),
    ):
        r = httpx.post(
            server + "/v1/responses",
            json={"input": "Hi", "tools": tools, "tool_choice": choice | {"tools": listed}},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_tool_in_chat_completions_shape_is_a_400_saying_so(server):
    """Code ported from chat completions sends {"type": "function", "function": {...}}: the
    refusal says the Responses API's tools are flat, not that a name is missing."""
    chat_shaped = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
    r = httpx.post(server + "/v1/responses", json={"input": "Hi", "tools": [chat_shaped]})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "tools.0.function", r.text
    assert "a Responses API function tool is flat" in error["message"]


def test_a_text_format_beside_a_forced_call_is_accepted_and_named(oa):
    # instructor's Responses tools mode sends the tool's schema both ways.
    text = {"format": {"type": "json_schema", "name": "weather", "schema": PARAMETERS}}
    raw = oa.responses.with_raw_response.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        text=text,
        **GREEDY | {"max_output_tokens": 40},
    )
    assert raw.http_response.headers["x-inflight-ignored-fields"] == "text.format"
    (call,) = raw.parse().output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), PARAMETERS)


# Codex's form: each MCP server's tools (and its sub-agent tools) grouped in a namespace.
NAMESPACED = [
    {
        "type": "namespace",
        "name": "mcp__weather",
        "description": "A weather service",
        "tools": [{**TOOLS[0], "strict": False}],
    }
]


def test_a_namespaced_function_is_called_by_name_and_namespace(oa, server_llm):
    question = {"role": "user", "content": "What is the weather in Paris?"}
    asked = dict(model=MODEL, tools=NAMESPACED, tool_choice="required", **GREEDY)
    reply = _checked(oa.responses.create(input=[question], **asked | {"max_output_tokens": 40}))
    (call,) = reply.output
    assert (call.name, call.namespace) == ("get_weather", "mcp__weather")
    jsonschema.validate(json.loads(call.arguments), PARAMETERS)
    # The model was offered the function under its flat name, and wrote the same call.
    flat = [{**CHAT_TOOLS[0], "function": {**CHAT_TOOLS[0]["function"]}}]
    flat[0]["function"]["name"] = "mcp__weather__get_weather"
    expected = server_llm.chat(
        [question],
        SamplingParams(temperature=0, max_tokens=1),
        tools=flat,
        chat_template=HERMES_TEMPLATE.read_text(),
    )[0]
    assert expected.prompt_tokens == reply.usage.input_tokens
    with oa.responses.stream(input=[question], **asked | {"max_output_tokens": 40}) as stream:
        events = _checked(list(stream))
        final = stream.get_final_response()
    added = next(e for e in events if e.type == "response.output_item.added")
    assert (added.item.name, added.item.namespace) == ("get_weather", "mcp__weather")
    assert final.output[0].namespace == "mcp__weather"
    # Sent back with its namespace, the call renders as the flat name the model wrote.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}
    history = [question, call.model_dump(exclude_none=True), result]
    again = oa.responses.create(input=history, **asked | {"tool_choice": "none"})
    messages = chat_messages(None, ResponsesRequest(input=history).input, 0)
    assert messages[1]["tool_calls"][0]["function"]["name"] == "mcp__weather__get_weather"
    assert again.output[0].type == "message"


def test_codex_web_search_and_client_metadata_are_accepted_and_named(oa):
    raw = oa.responses.with_raw_response.create(
        model=MODEL,
        input=QUESTION,
        tools=[*TOOLS, {"type": "web_search", "external_web_access": False}],
        extra_body={"client_metadata": {"session_id": "s1"}},
        **GREEDY,
    )
    assert raw.http_response.headers["x-inflight-ignored-fields"] == (
        "client_metadata, tools.1 (web_search)"
    )
    assert raw.parse().status in ("completed", "incomplete")
    # Asked for by name, a web search is still refused.
    with pytest.raises(openai.BadRequestError, match="web_search"):
        oa.responses.create(
            model=MODEL, input=QUESTION, tools=[{"type": "web_search"}],
            tool_choice={"type": "web_search"}, **GREEDY,
        )  # fmt: skip


def test_the_hosted_services_newer_options_are_accepted_and_named(oa, server_llm):
    """The SDK's compaction, moderation, cache, image and access options: the reply is the
    plain one, the options named in the ignored-fields header; background options refused as
    background is."""
    raw = oa.responses.with_raw_response.create(
        model=MODEL,
        input=QUESTION,
        context_management=[{"type": "compaction", "compact_threshold": 100000}],
        moderation={"policy": {"input": {"mode": "score"}}},
        prompt_cache_options={"mode": "implicit"},
        image={"context_compression": "auto"},
        access_programs={"cyber": "standard"},
        **GREEDY,
    )
    assert raw.http_response.headers["x-inflight-ignored-fields"] == (
        "moderation, context_management, prompt_cache_options, image, access_programs"
    )
    expected = _expected(server_llm, [{"role": "user", "content": QUESTION}])
    assert raw.parse().output_text == expected.text
    with pytest.raises(openai.BadRequestError) as refused:
        oa.responses.create(
            model=MODEL, input=QUESTION, background_options={"completion_window": "2h"}, **GREEDY
        )
    assert refused.value.body["param"] == "background_options"


def test_a_function_call_output_sent_back_gets_a_message(oa, server_llm):
    question = {"role": "user", "content": "What is the weather in Paris?"}
    first = oa.responses.create(
        model=MODEL,
        input=[question],
        tools=TOOLS,
        tool_choice="required",
        **GREEDY | {"max_output_tokens": 40},
    )
    (call,) = first.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}
    reply = oa.responses.create(
        model=MODEL,
        input=[question, call.model_dump(exclude_none=True), result],
        tools=TOOLS,
        **GREEDY,
    )
    assert reply.output[0].type == "message" and reply.output_text
    assert all(item.type == "message" for item in reply.output)
    # The call and its result went through the (shipped) template as a chat conversation.
    history = [
        question,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": json.loads(call.arguments)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 C"},
    ]
    prepared = server_llm.prepare(
        history, tools=CHAT_TOOLS, chat_template=HERMES_TEMPLATE.read_text()
    )
    assert reply.usage.input_tokens == len(prepared.prompt_token_ids)
    rendered = server_llm.tokenizer.decode(prepared.prompt_token_ids, skip_special_tokens=False)
    assert "<tool_response>\n18 C\n</tool_response>" in rendered


def test_function_calls_cut_short_are_sent_back_and_rendered_as_far_as_written(oa, server_llm):
    question = {"role": "user", "content": "What is the weather in Paris?"}
    sent, rendered = [question], [question]
    for call_id, arguments, read in (("c1", '{"city": "Par', {"city": "Par"}), ("c2", "1", {})):
        sent += [
            {
                "type": "function_call",
                "call_id": call_id,
                "name": "get_weather",
                "arguments": arguments,
            },
            {"type": "function_call_output", "call_id": call_id, "output": "Invalid JSON."},
        ]
        call = {
            "id": call_id,
            "type": "function",
            "function": {"name": "get_weather", "arguments": read},
        }
        rendered += [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "content": "Invalid JSON."},
        ]
    reply = oa.responses.create(model=MODEL, input=sent, tools=TOOLS, **GREEDY)
    assert reply.status in ("completed", "incomplete")
    prepared = server_llm.prepare(
        rendered, tools=CHAT_TOOLS, chat_template=HERMES_TEMPLATE.read_text()
    )
    assert reply.usage.input_tokens == len(prepared.prompt_token_ids)


def test_previous_response_id_continues_the_conversation(oa, server_llm):
    first = oa.responses.create(model=MODEL, input=QUESTION, instructions="Be brief.", **GREEDY)
    follow_up = "And of Italy?"
    reply = oa.responses.create(
        model=MODEL, input=follow_up, previous_response_id=first.id, **GREEDY
    )
    assert reply.previous_response_id == first.id
    # The earlier turn is in the prompt; its instructions are not carried over.
    history = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": follow_up},
    ]
    expected = _expected(server_llm, history)
    assert reply.usage.input_tokens == expected.prompt_tokens > first.usage.input_tokens
    assert reply.output_text == expected.text
    # Its input items: the earlier turn's, then its own (newest first unless asked).
    items = oa.responses.input_items.list(reply.id, order="asc")
    assert [(i.type, i.role) for i in items.data] == [
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
    ]
    assert items.data[1].id == first.output[0].id
    assert items.data[2].content[0].text == follow_up and not items.has_more
    newest = oa.responses.input_items.list(reply.id, limit=1)
    assert [i.id for i in newest.data] == [items.data[2].id] and newest.has_more
    rest = oa.responses.input_items.list(reply.id, after=newest.last_id)
    assert [i.id for i in rest.data] == [items.data[1].id, items.data[0].id]
    with pytest.raises(openai.NotFoundError):
        oa.responses.input_items.list("resp_unknown")


def test_input_tokens_count_the_prompt_a_response_runs(oa, server):
    """`responses.input_tokens.count` (POST /v1/responses/input_tokens) gives the input tokens
    a response of the same fields reports: instructions, tools, a stored conversation."""
    first = oa.responses.create(model=MODEL, input=QUESTION, instructions="Be brief.", **GREEDY)
    counted = oa.responses.input_tokens.count(model=MODEL, input=QUESTION, instructions="Be brief.")
    assert counted.object == "response.input_tokens"
    assert counted.input_tokens == first.usage.input_tokens
    fields = {"input": "And its weather?", "previous_response_id": first.id, "tools": TOOLS}
    reply = oa.responses.create(model=MODEL, tool_choice="required", **fields, **GREEDY)
    counted = oa.responses.input_tokens.count(model=MODEL, tool_choice="required", **fields)
    assert counted.input_tokens == reply.usage.input_tokens > first.usage.input_tokens
    for extra, param in (
        ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"max_output_tokens": 5}, "max_output_tokens"),  # not a field of the count
    ):
        r = httpx.post(server + "/v1/responses/input_tokens", json={"input": QUESTION, **extra})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
    body = {"input": QUESTION, "conversation": "conv_unknown"}
    r = httpx.post(server + "/v1/responses/input_tokens", json=body)
    assert r.status_code == 404 and r.json()["error"]["param"] == "conversation"


def test_a_conversation_holds_the_items_of_the_responses_that_name_it(oa, server_llm):
    """The Conversations API: a response naming a conversation is generated from its items,
    then its input and output items are added to it (whole and streamed alike)."""
    conversation = oa.conversations.create(
        items=[{"type": "message", "role": "user", "content": QUESTION}], metadata={"k": "v"}
    )
    assert conversation.metadata == {"k": "v"}
    first = oa.responses.create(
        model=MODEL, input="Answer in one word.", conversation=conversation.id, **GREEDY
    )
    assert first.conversation.id == conversation.id
    history = [
        {"role": "user", "content": QUESTION},
        {"role": "user", "content": "Answer in one word."},
    ]
    expected = _expected(server_llm, history)
    assert first.usage.input_tokens == expected.prompt_tokens
    assert first.output_text == expected.text
    stream = oa.responses.create(
        model=MODEL,
        input="And of Italy?",
        conversation={"id": conversation.id},
        stream=True,
        **GREEDY,
    )
    (done,) = [
        e.response for e in stream if e.type in ("response.completed", "response.incomplete")
    ]
    history += [
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And of Italy?"},
    ]
    assert done.usage.input_tokens == _expected(server_llm, history).prompt_tokens
    listed = oa.conversations.items.list(conversation.id, order="asc")
    assert [(i.type, i.role) for i in listed.data] == [
        ("message", "user"),
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
        ("message", "assistant"),
    ]
    assert listed.data[2].content[0].text == first.output_text and not listed.has_more
    assert listed.data[4].content[0].text == done.output_text
    newest = oa.conversations.items.list(conversation.id, limit=2)
    assert [i.id for i in newest.data] == [listed.data[4].id, listed.data[3].id]
    assert newest.has_more
    after = oa.conversations.items.list(conversation.id, after=newest.last_id, limit=100)
    assert [i.id for i in after.data] == [i.id for i in reversed(listed.data[:3])]
    # Items added by hand, read back, deleted; the metadata replaced.
    added = oa.conversations.items.create(
        conversation.id, items=[{"type": "message", "role": "user", "content": "Thanks."}]
    )
    (item,) = added.data
    assert oa.conversations.items.retrieve(item.id, conversation_id=conversation.id).id == item.id
    assert oa.conversations.items.delete(item.id, conversation_id=conversation.id).id == (
        conversation.id
    )
    with pytest.raises(openai.NotFoundError):
        oa.conversations.items.retrieve(item.id, conversation_id=conversation.id)
    assert oa.conversations.update(conversation.id, metadata={"x": "y"}).metadata == {"x": "y"}
    # The count of a response's input reads the conversation too.
    counted = oa.responses.input_tokens.count(
        model=MODEL, input="And of Spain?", conversation=conversation.id
    )
    history += [
        {"role": "assistant", "content": done.output_text},
        {"role": "user", "content": "And of Spain?"},
    ]
    assert counted.input_tokens == _expected(server_llm, history).prompt_tokens
    with pytest.raises(openai.BadRequestError):
        oa.responses.create(
            model=MODEL, input="x", conversation=conversation.id, previous_response_id=first.id
        )
    assert oa.conversations.delete(conversation.id).deleted
    with pytest.raises(openai.NotFoundError):
        oa.conversations.retrieve(conversation.id)
    with pytest.raises(openai.NotFoundError):
        oa.responses.create(model=MODEL, input="x", conversation=conversation.id)


def test_stored_responses_are_retrieved_and_deleted(oa, server):
    reply = oa.responses.create(model=MODEL, input=QUESTION, **GREEDY)
    got = _checked(oa.responses.retrieve(reply.id))
    assert got.id == reply.id and got.output_text == reply.output_text and got.store
    oa.responses.delete(reply.id)
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(reply.id)
    with pytest.raises(openai.NotFoundError):
        oa.responses.delete(reply.id)
    r = httpx.post(
        server + "/v1/responses",
        json={"input": "And of Italy?", "previous_response_id": reply.id},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"


def _settled(oa, response_id):
    """The background response once it left queued / in_progress."""
    deadline = time.monotonic() + 60
    while True:
        response = oa.responses.retrieve(response_id)
        if response.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            return response
        time.sleep(0.05)


def test_a_background_response_is_queued_then_polled_to_the_same_reply(oa):
    queued = oa.responses.create(model=MODEL, input=QUESTION, background=True, **GREEDY)
    assert queued.status == "queued" and queued.background and queued.output == []
    done = _settled(oa, queued.id)
    direct = oa.responses.create(model=MODEL, input=QUESTION, **GREEDY)
    assert done.status == direct.status and done.output_text == direct.output_text
    assert done.usage.output_tokens == direct.usage.output_tokens and done.background
    # It continues a conversation as any stored response does, once it is done.
    follow = oa.responses.create(
        model=MODEL, input="And of Italy?", previous_response_id=done.id, **GREEDY
    )
    assert follow.usage.input_tokens > done.usage.input_tokens
    assert oa.responses.cancel(done.id).status == done.status  # over: returned as it is
    with pytest.raises(openai.BadRequestError) as info:  # created without stream
        oa.responses.retrieve(done.id, stream=True)
    assert "background: true and stream: true" in info.value.message
    with pytest.raises(openai.BadRequestError):
        oa.responses.cancel(direct.id)  # only background responses


def test_a_background_response_is_cancelled_and_the_engine_freed(oa, server):
    body = {"input": "Tell a long story.", "max_output_tokens": 400, "temperature": 0}
    running = oa.responses.create(
        model=MODEL, background=True, extra_body={"ignore_eos": True}, **body
    )
    with pytest.raises(openai.BadRequestError) as info:  # not a finished response yet
        oa.responses.create(model=MODEL, input="And?", previous_response_id=running.id)
    assert "only a completed or incomplete response" in info.value.message
    cancelled = oa.responses.cancel(running.id)
    assert cancelled.status == "cancelled" and cancelled.output == []
    assert oa.responses.retrieve(running.id).status == "cancelled"
    assert oa.responses.cancel(running.id).status == "cancelled"
    # Deleting one that runs stops it too.
    deleted = oa.responses.create(
        model=MODEL, background=True, extra_body={"ignore_eos": True}, **body
    )
    oa.responses.delete(deleted.id)
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(deleted.id)
    deadline = time.monotonic() + 30
    while httpx.get(server + "/health").json()["scheduling"]["resident"]:
        assert time.monotonic() < deadline, "a cancelled background response stayed resident"
        time.sleep(0.05)
    body = {"input": "x", "background": True, "store": False}
    r = httpx.post(server + "/v1/responses", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "store"


def _stream_text(events):
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def test_a_streamed_background_response_is_replayed_from_any_event(oa):
    direct = oa.responses.create(model=MODEL, input=QUESTION, **GREEDY)
    with oa.responses.create(
        model=MODEL, input=QUESTION, background=True, stream=True, **GREEDY
    ) as stream:
        events = list(stream)
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.queued", "response.in_progress"]
    assert types[3:5] == MESSAGE_OPENING[2:] and types[-1] == f"response.{direct.status}"
    assert events[0].response.status == "queued" and events[0].response.background
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert _stream_text(events) == direct.output_text
    response_id = events[0].response.id
    stored = oa.responses.retrieve(response_id)
    assert stored.status == direct.status and stored == events[-1].response
    # Replayed whole, or after any event: the same events.
    dumped = [e.model_dump() for e in events]
    again = oa.responses.retrieve(response_id, stream=True)
    assert [e.model_dump() for e in again] == dumped
    for after in (0, 5, len(events) - 2, len(events) - 1):
        tail = oa.responses.retrieve(response_id, stream=True, starting_after=after)
        assert [e.model_dump() for e in tail] == dumped[after + 1 :]
    # The SDK's stream helper resumes by response id.
    with oa.responses.stream(response_id=response_id, starting_after=4) as resumed:
        got = list(resumed)
    assert [e.sequence_number for e in got] == list(range(5, len(events)))
    assert got[-1].response.output_text == direct.output_text
    for query, param in (
        ("starting_after=3", "starting_after"),  # without stream
        ("stream=true&starting_after=-2", "query.starting_after"),
    ):
        r = httpx.get(f"{oa.base_url}responses/{response_id}?{query}")
        assert r.status_code == 400 and r.json()["error"]["param"] == param, query
    with pytest.raises(openai.BadRequestError):  # not a background response
        oa.responses.retrieve(direct.id, stream=True)


def _background_stream_to_first_text(oa, max_output_tokens):
    """A streamed background story (no end but its bound), and its events up to its first
    text delta."""
    stream = oa.responses.create(
        model=MODEL,
        input="Tell a long story.",
        max_output_tokens=max_output_tokens,
        temperature=0,
        background=True,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    seen = []
    for event in stream:
        seen.append(event)
        if event.type == "response.output_text.delta":
            return stream, seen
    raise AssertionError("the stream ended before any text")


def test_a_dropped_background_stream_goes_on_and_resumes_where_it_stopped(oa):
    stream, seen = _background_stream_to_first_text(oa, 120)
    stream.close()  # the connection dropped
    rest = list(
        oa.responses.retrieve(
            seen[0].response.id, stream=True, starting_after=seen[-1].sequence_number
        )
    )
    events = seen + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.incomplete"  # cut at max_output_tokens: it ran on
    assert events[-1].response.usage.output_tokens == 120
    assert _stream_text(events) == events[-1].response.output_text


def test_a_streamed_background_response_is_cancelled_and_its_streams_end(oa, server):
    stream, events = _background_stream_to_first_text(oa, 400)
    response_id = events[0].response.id
    assert oa.responses.cancel(response_id).status == "cancelled"
    events += list(stream)  # the creating stream ends, without a last response event
    ends = {"response.completed", "response.incomplete", "response.failed"}
    assert not ends & {e.type for e in events}
    replay = oa.responses.retrieve(response_id, stream=True)
    assert [e.model_dump() for e in replay] == [e.model_dump() for e in events]
    assert oa.responses.retrieve(response_id).status == "cancelled"
    deadline = time.monotonic() + 30
    while httpx.get(server + "/health").json()["scheduling"]["resident"]:
        assert time.monotonic() < deadline, "a cancelled background response stayed resident"
        time.sleep(0.05)


def _input_tokens(server, items):
    r = httpx.post(server + "/v1/responses/input_tokens", json={"model": MODEL, "input": items})
    assert r.status_code == 200, r.text
    return r.json()["input_tokens"]


def test_a_conversation_is_compacted_to_its_user_messages_and_a_summary_that_stands_for_it(
    oa, server
):
    first = oa.responses.create(model=MODEL, input="My name is Ada. I write a parser.", **GREEDY)
    history = [
        {"role": "user", "content": "My name is Ada. I write a parser."},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"role": "developer", "content": "Prefer Rust."},
        {"role": "user", "content": "It reads JSON."},
    ]
    raw = oa.responses.with_raw_response.compact(
        model=MODEL,
        input=history,
        instructions="You help with code.",
        extra_body={"max_output_tokens": 16, "tools": [], "text": {"verbosity": "low"}},
    )
    assert raw.headers["x-inflight-ignored-fields"] == "tools, text"
    compacted = raw.parse()
    assert compacted.object == "response.compaction" and compacted.id.startswith("resp_")
    *users, item = raw.http_response.json()["output"]  # as a client sends them back
    assert [(u["role"], u["content"][0]["text"]) for u in users] == [
        ("user", "My name is Ada. I write a parser."),
        ("user", "It reads JSON."),
    ]
    assert item["type"] == "compaction" and item["id"].startswith("cmp_")
    assert 0 < compacted.usage.output_tokens <= 16
    assert compacted.usage.input_tokens > _input_tokens(server, history)  # + the request
    # Sent back, the item is read as a user message holding the summary.
    summary = compaction.summary_of(item["encrypted_content"], "-")
    nxt = {"role": "user", "content": "What is my name?"}
    as_summary = {"role": "user", "content": f"{compaction.SUMMARY_HEADER}\n\n{summary}"}
    assert _input_tokens(server, [*users, item, nxt]) == _input_tokens(
        server, [*users, as_summary, nxt]
    )
    follow = oa.responses.create(model=MODEL, input=[*users, item, nxt], **GREEDY)
    assert follow.status in ("completed", "incomplete")
    # A stored response's conversation compacts too, and a stored input keeps the item.
    again = oa.responses.compact(
        model=MODEL, previous_response_id=follow.id, extra_body={"max_output_tokens": 8}
    )
    texts = [o.content[0].text for o in again.output[:-1]]
    assert texts == ["My name is Ada. I write a parser.", "It reads JSON.", "What is my name?"]
    kept = oa.responses.input_items.list(follow.id, order="asc").data
    assert [i.type for i in kept].count("compaction") == 1
    r = httpx.post(server + "/v1/responses/compact", json={"model": MODEL})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"  # nothing to compact
    # Another service's compaction is refused by name.
    foreign = {"type": "compaction", "encrypted_content": "gAAAAABfb3JlaWdu"}
    with pytest.raises(openai.BadRequestError) as info:
        oa.responses.create(model=MODEL, input=[foreign, nxt], **GREEDY)
    assert info.value.body["param"] == "input.0.encrypted_content"


def test_a_compaction_trigger_makes_the_response_one_compaction_item(oa, server):
    """Codex's compaction on the OpenAI provider: the input ends with a compaction_trigger,
    and the (streamed) response's one output item is the compaction, completed even where
    the summary ran to its bound."""
    history = [
        {"role": "user", "content": "My name is Ada. I write a parser."},
        {"role": "assistant", "content": "Nice to meet you, Ada."},
        {"role": "user", "content": "It reads JSON."},
    ]
    body = {"model": MODEL, "store": False, "max_output_tokens": 12, "temperature": 0}
    trigger = {"type": "compaction_trigger"}
    raw = oa.responses.with_raw_response.create(
        input=[*history, trigger], stream=True, tools=TOOLS, **body
    )
    assert raw.headers["x-inflight-ignored-fields"] == "tools"
    events = list(raw.parse())
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.output_item.done",
        "response.completed",
    ]
    item = events[3].item
    assert item.type == "compaction" and item.id == events[2].item.id
    final = events[-1].response
    assert [o.type for o in final.output] == ["compaction"] and final.status == "completed"
    assert final.usage.output_tokens == 12  # cut at its bound, whole all the same
    summary = compaction.summary_of(item.encrypted_content, "-")
    whole = oa.responses.create(input=[*history, trigger], **body)
    assert whole.status == "completed" and [o.type for o in whole.output] == ["compaction"]
    assert compaction.summary_of(whole.output[0].encrypted_content, "-") == summary  # greedy
    # The compaction stands for the conversation in what follows.
    nxt = {"role": "user", "content": "What is my name?"}
    users = [history[0], history[2]]
    as_summary = {"role": "user", "content": f"{compaction.SUMMARY_HEADER}\n\n{summary}"}
    assert _input_tokens(server, [*users, item.model_dump(), nxt]) == _input_tokens(
        server, [*users, as_summary, nxt]
    )
    r = httpx.post(server + "/v1/responses", json={**body, "input": [trigger, *history]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.0"


def _socket_response(connection, **fields):
    """Send one response.create over a Responses WebSocket; its events, to the last."""
    connection.send({"type": "response.create", "model": MODEL, **fields})
    events = []
    for event in connection:
        events.append(event)
        if event.type in ("response.completed", "response.incomplete", "response.failed", "error"):
            return events
    raise AssertionError("the socket closed mid-response")


def test_the_responses_websocket_streams_and_continues_on_the_connection(oa):
    """OpenAI's WebSocket mode (`responses.connect()`; the Codex CLI's first try on the OpenAI
    provider): the SSE stream's events as frames; responses continued on the connection
    whatever their `store`; `generate: false` prepares a continuation; a bad frame answered
    with an error frame, the connection kept."""
    direct = oa.responses.create(model=MODEL, input=QUESTION, **GREEDY)
    with oa.responses.connect() as connection:
        events = _socket_response(connection, input=QUESTION, store=False, **GREEDY)
        streamed = list(oa.responses.create(model=MODEL, input=QUESTION, stream=True, **GREEDY))
        assert [e.type for e in events] == [e.type for e in streamed]
        first = events[-1].response
        assert first.output_text == direct.output_text and first.store is False
        with pytest.raises(openai.NotFoundError):  # not stored: kept by the connection only
            oa.responses.retrieve(first.id)
        follow = {"role": "user", "content": "And of Italy?"}
        events = _socket_response(
            connection, input=[follow], previous_response_id=first.id, store=False, **GREEDY
        )
        whole = [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": first.output_text},
            follow,
        ]
        over_http = oa.responses.create(model=MODEL, input=whole, **GREEDY)
        assert events[-1].response.usage.input_tokens == over_http.usage.input_tokens
        assert events[-1].response.output_text == over_http.output_text
        # Prepared without generating, then continued from.
        events = _socket_response(connection, input=QUESTION, generate=False, stream_id="a")
        assert [e.type for e in events] == ["response.created", "response.completed"]
        assert events[-1].response.output == [] and events[-1].stream_id == "a"
        events = _socket_response(
            connection, input=[follow], previous_response_id=events[-1].response.id, **GREEDY
        )
        asked = [{"role": "user", "content": QUESTION}, follow]
        alike = oa.responses.create(model=MODEL, input=asked, **GREEDY)
        assert events[-1].response.usage.input_tokens == alike.usage.input_tokens
        # A bad frame is answered and the connection stays.
        error = _socket_response(connection, input=QUESTION, temperature="hot")[-1]
        assert error.type == "error" and error.status == 400
        assert error.error.param == "temperature"
        connection.send({"type": "response.steer", "input": "x"})
        error = next(iter(connection))
        assert error.status == 400 and error.error.param == "type"
        assert _socket_response(connection, input="Hi", **GREEDY)[-1].type.startswith("response.")


def test_a_response_not_stored_is_not_found(oa):
    reply = oa.responses.create(model=MODEL, input=QUESTION, store=False, **GREEDY)
    assert reply.store is False
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(reply.id)
    streamed = list(
        oa.responses.create(model=MODEL, input=QUESTION, store=False, stream=True, **GREEDY)
    )
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(streamed[-1].response.id)


def test_json_schema_text_format_gives_json_matching_the_schema(oa):
    text = {"format": {"type": "json_schema", "name": "weather", "schema": PARAMETERS}}
    reply = oa.responses.create(
        model=MODEL,
        input="The weather in Paris, as JSON.",
        text=text,
        temperature=0,
        max_output_tokens=60,
    )
    assert reply.status == "completed"
    jsonschema.validate(json.loads(reply.output_text), PARAMETERS)
    assert reply.text.format.type == "json_schema" and reply.text.format.name == "weather"
    as_object = oa.responses.create(
        model=MODEL,
        input="The weather in Paris, as JSON.",
        temperature=0,
        text={"format": {"type": "json_object"}},
        max_output_tokens=60,
    )
    assert as_object.status != "completed" or isinstance(json.loads(as_object.output_text), dict)


def test_vllm_sampling_fields_are_served_as_on_chat_completions(oa, server_llm):
    # vLLM's extensions of /v1/responses (`vllm bench serve --backend openai-responses` sends
    # ignore_eos): a seeded reply equals the library's with the same parameters.
    fields = {
        "top_k": 20,
        "min_p": 0.05,
        "seed": 7,
        "ignore_eos": True,
        "repetition_penalty": 1.1,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.3,
        "logit_bias": {"13": -100},
        "stop_token_ids": [2],
        "min_tokens": 4,
    }
    reply = _checked(
        oa.responses.create(
            model=MODEL, input=QUESTION, temperature=1.0, max_output_tokens=24, extra_body=fields
        )
    )
    params = SamplingParams(
        temperature=1.0, max_tokens=24, **{**fields, "logit_bias": {13: -100.0}}
    )
    (expected,) = server_llm.chat([{"role": "user", "content": QUESTION}], params)
    assert reply.output_text == expected.text and reply.usage.output_tokens == 24
    stop = expected.text[len(expected.text) // 2 :].split()[0]
    cut = oa.responses.create(
        model=MODEL,
        input=QUESTION,
        temperature=1.0,
        max_output_tokens=24,
        extra_body={**fields, "stop": [stop]},
    )
    assert cut.output_text == expected.text[: expected.text.index(stop)]
    assert cut.status == "completed"


def test_vllm_structured_outputs_field_constrains_the_reply(oa):
    reply = oa.responses.create(
        model=MODEL,
        input="Is the sky blue?",
        temperature=0,
        max_output_tokens=8,
        extra_body={"structured_outputs": {"choice": ["certainly yes", "no"]}},
    )
    assert reply.output_text in ("certainly yes", "no") and reply.status == "completed"


def test_output_logprobs_are_the_chat_paths_whole_and_streamed(oa, server_llm):
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=2)
    (expected,) = server_llm.chat([{"role": "user", "content": QUESTION}], params)
    asked = {"include": ["message.output_text.logprobs"], "top_logprobs": 2, **GREEDY}
    reply = _checked(oa.responses.create(model=MODEL, input=QUESTION, **asked))
    (part,) = reply.output[0].content
    assert part.text == expected.text and len(part.logprobs) == len(expected.token_ids)
    for got, want in zip(part.logprobs, expected.logprobs, strict=True):
        assert (got.token, got.logprob, bytes(got.bytes)) == (want.token, want.logprob, want.bytes)
        assert [t.token for t in got.top_logprobs] == [t.token for t in want.top]
    events = _checked(list(oa.responses.create(model=MODEL, input=QUESTION, stream=True, **asked)))
    whole = [lp.model_dump() for lp in part.logprobs]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [lp.model_dump() for d in deltas for lp in d.logprobs] == whole
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [lp.model_dump() for lp in done.logprobs] == whole
    final = events[-1].response.output[0].content[0]
    assert [lp.model_dump() for lp in final.logprobs] == whole
    # Not asked: none.
    plain = oa.responses.create(model=MODEL, input=QUESTION, **GREEDY)
    assert plain.output[0].content[0].logprobs == []


def test_output_logprobs_beside_no_functions_to_call(oa):
    # openai-agents 0.24 sends `tools: []` with every request (here its ModelSettings with
    # top_logprobs, streamed), and a web search is left out of the prompt: neither offers the
    # model a function, so the logprobs are served (each a 400 "without tools" before).
    asked = {"include": ["message.output_text.logprobs"], "top_logprobs": 2, **GREEDY}
    for tools in ([], [{"type": "web_search"}]):
        stream = oa.responses.create(model=MODEL, input=QUESTION, stream=True, tools=tools, **asked)
        final = _checked(list(stream))[-1].response.output[0].content[0]
        assert final.logprobs and len(final.logprobs[0].top_logprobs) == 2


def test_max_output_tokens_cut_is_incomplete(oa):
    reply = _checked(
        oa.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=4)
    )
    assert reply.status == "incomplete"
    assert reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage.output_tokens == 4 and reply.output[0].status == "incomplete"
    events = _checked(
        list(
            oa.responses.create(
                model=MODEL, input=QUESTION, temperature=0, max_output_tokens=4, stream=True
            )
        )
    )
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output_text == reply.output_text


def test_a_context_overflow_names_the_responses_fields(server):
    """OpenAI's `context_length_exceeded`, its `param` the Responses API's own field."""
    for body, param in (
        ({"input": "word " * 600}, "input"),
        ({"input": QUESTION, "max_output_tokens": 600}, "max_output_tokens"),
    ):
        r = httpx.post(server + "/v1/responses", json={"model": MODEL, **body})
        error = r.json()["error"]
        assert r.status_code == 400 and error["code"] == "context_length_exceeded"
        assert error["param"] == param


def test_auto_truncation_drops_the_oldest_turns_that_do_not_fit(oa, server, server_llm):
    long_turns = [
        {"role": "user", "content": "Tell me a story. " * 150},
        {"role": "assistant", "content": "Once upon a time."},
    ]
    items = [*long_turns, {"role": "user", "content": QUESTION}]
    r = httpx.post(server + "/v1/responses", json={"input": items, **GREEDY})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    reply = oa.responses.create(model=MODEL, input=items, truncation="auto", **GREEDY)
    expected = _expected(server_llm, [{"role": "user", "content": QUESTION}])
    assert reply.truncation == "auto" and reply.output_text == expected.text
    assert reply.usage.input_tokens == expected.prompt_tokens


def test_reasoning_items_sent_back_are_accepted(oa):
    items = [
        {"role": "user", "content": "Hi"},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [{"type": "summary_text", "text": "Greet back."}],
        },
        {"type": "message", "role": "assistant", "content": "Hello!", "status": "completed"},
        {"role": "user", "content": QUESTION},
    ]
    reply = oa.responses.create(
        model=MODEL, input=items, reasoning={"effort": "low", "summary": "auto"}, **GREEDY
    )
    assert reply.output_text and reply.reasoning.effort == "low"


@pytest.mark.parametrize(
    ("change", "param", "named"),
    [
        ({"tools": [{"type": "file_search"}]}, "tools.0", "file_search"),
        (
            {"tools": [{"type": "namespace", "name": "n", "tools": [{"type": "custom"}]}]},
            "tools.0.tools.0",
            "custom",
        ),
        ({"temprature": 0}, "temprature", "temprature"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "web_search_preview"),
        ({"tools": TOOLS + TOOLS}, "tools", "get_weather"),
        ({"tool_choice": "required"}, "tool_choice", "required"),
        ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input.0", "computer"),
        (
            # (Files are read: tests/server/test_documents.py; uploaded images too.)
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input.0.content.0",
            "input_image",
        ),
        # Named by the request's own keys, not pydantic's names of the item types.
        ({"input": [{"role": "user", "content": "x", "bogus": 1}]}, "input.0.bogus", "bogus"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f"}]},
            "input.0.arguments",
            "required",
        ),
        ({"input": [{"type": "compaction_trigger"}, "x"]}, "input.1", "valid"),
        ({"previous_response_id": "resp_unknown"}, "previous_response_id", "resp_unknown"),
        ({"background_options": {"x": 1}}, "background_options", "background"),
        (
            {"include": ["message.output_text.logprobs"], "tools": TOOLS},
            "include",
            "without tools",
        ),
        (
            {
                "text": {"format": {"type": "json_object"}},
                "structured_outputs": {"choice": ["a"]},
            },
            "structured_outputs",
            "not both",
        ),
        ({"structured_outputs": {"choise": ["a"]}}, "structured_outputs", "choise"),
        ({"top_k": -2}, "top_k", "greater than or equal"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x"}}},
            "text.format.schema",
            "required",
        ),
    ],
)
def test_bad_requests_are_400s_naming_the_field(server, server_llm, change, param, named):
    before = server_llm.get_scheduling_metrics()["submitted"]
    r = httpx.post(server + "/v1/responses", json={"model": MODEL, "input": QUESTION, **change})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and named in error["message"]
    assert server_llm.get_scheduling_metrics()["submitted"] == before


def test_codex_message_metadata_on_the_openai_provider_is_accepted(oa):
    """Codex on the OpenAI provider tags its messages with metadata the hosted service passes
    through: served, and kept with the stored input."""
    metadata = {"turn_id": "t1", "create_time": 1.5, "content_item_kinds": ["user.text"]}
    item = {"role": "user", "content": QUESTION}
    reply = oa.responses.create(
        model=MODEL,
        input=[{**item, "internal_chat_message_metadata_passthrough": metadata}],
        **GREEDY,
    )
    direct = oa.responses.create(model=MODEL, input=[item], **GREEDY)
    assert reply.output_text == direct.output_text
    kept = oa.responses.input_items.list(reply.id).data[0].model_dump()
    assert kept["internal_chat_message_metadata_passthrough"] == metadata


def test_openai_sdk_parses_a_bad_request_error(oa):
    with pytest.raises(openai.BadRequestError, match="file_search"):
        oa.responses.create(model=MODEL, input=QUESTION, tools=[{"type": "file_search"}])


@pytest.fixture(scope="module")
def thinking(server_llm):
    with serve(server_llm, reasoning_parser="qwen3", chat_template=THINKING_TEMPLATE) as (url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_reasoning_effort_switches_the_templates_thinking(thinking):
    # The model never closes the block the prompt opens: its whole reply is reasoning.
    reply = _checked(
        thinking.responses.create(
            model=MODEL, input=QUESTION, reasoning={"effort": "high"}, **GREEDY
        )
    )
    (reasoning,) = reply.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert reasoning.content[0].type == "reasoning_text" and reasoning.content[0].text
    assert reasoning.status == reply.status and reply.output_text == ""
    assert 0 < reply.usage.output_tokens_details.reasoning_tokens <= reply.usage.output_tokens
    events = _checked(
        list(
            thinking.responses.create(
                model=MODEL, input=QUESTION, reasoning={"effort": "high"}, stream=True, **GREEDY
            )
        )
    )
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == reasoning.content[0].text
    assert [i.model_dump(exclude={"id"}) for i in events[-1].response.output] == [
        i.model_dump(exclude={"id"}) for i in reply.output
    ]
    # vLLM's chat_template_kwargs reach the template as on chat completions.
    switched = thinking.responses.create(
        model=MODEL,
        input=QUESTION,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
        **GREEDY,
    )
    assert [item.model_dump(exclude={"id"}) for item in switched.output] == [
        item.model_dump(exclude={"id"}) for item in reply.output
    ]
    # Effort "none" closes the block in the prompt: the reply is all text.
    plain = thinking.responses.create(
        model=MODEL, input=QUESTION, reasoning={"effort": "none"}, **GREEDY
    )
    assert [item.type for item in plain.output] == ["message"] and plain.output_text


def test_a_reply_becomes_one_assistant_message():
    items = ResponsesRequest(
        input=[
            {"role": "user", "content": "Hi"},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "Call both."}],
            },
            {"type": "message", "role": "assistant", "content": "Checking."},
            {"type": "function_call", "call_id": "a", "name": "f", "arguments": '{"x": 1}'},
            {"type": "function_call", "call_id": "b", "name": "g", "arguments": ""},
            {"type": "function_call_output", "call_id": "a", "output": "one"},
            {
                "type": "function_call_output",
                "call_id": "b",
                "output": [{"type": "input_text", "text": "two"}],
            },
        ]
    ).input
    assert chat_messages("Be brief.", items, 0) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Call both.",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
                {"id": "b", "type": "function", "function": {"name": "g", "arguments": {}}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "one"},
        {"role": "tool", "tool_call_id": "b", "content": "two"},
    ]


def test_the_store_forgets_the_least_recently_used():
    store = ResponseStore(capacity=2)
    for name in ("a", "b"):
        store.put(name, StoredResponse({"id": name}, []))
    assert store.get("a") is not None  # "b" is now the least recently used
    store.put("c", StoredResponse({"id": "c"}, []))
    assert store.get("b") is None and store.get("a") and store.get("c")
    assert store.delete("a") and not store.delete("a")


class _FailingRun:
    """A run that writes a little, then fails as a generation that failed does."""

    output = None

    async def __aiter__(self):
        yield StreamChunk(token_ids=[1], text="Hel", prompt_tokens=3)
        raise ServerError(500, "generation failed: boom")


def test_a_failed_stream_ends_with_an_error_event_and_response_failed():
    store = ResponseStore()
    held = ConversationStore().create([], {})
    turn = Turn([], [], None, None, None, {}, [], {}, [])
    reply = ResponseReply(
        ResponsesRequest(input="Hi"),
        MODEL,
        SamplingParams(),
        turn,
        MessageParser(),
        None,
        store,
        held,
    )

    async def read() -> list[str]:
        return [event async for event in reply.stream(_FailingRun())]

    events = []
    for text in asyncio.run(read()):
        kind, data = text.removesuffix("\n\n").split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        events.append(_EVENT.validate_python(event))
    assert [e.type for e in events] == [
        *MESSAGE_OPENING,
        "response.output_text.delta",
        "error",
        "response.failed",
    ]
    assert "boom" in events[-2].message and events[-1].response.status == "failed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert store.get(reply.id) is None
    assert held.items == []  # a failed response adds nothing to its conversation


def test_a_failed_background_response_is_stored_as_failed():
    store = ResponseStore()
    held = ConversationStore().create([], {})
    body = ResponsesRequest(input="Hi", background=True)
    turn = Turn([], [], None, None, None, {}, [], {}, [])
    reply = ResponseReply(body, MODEL, SamplingParams(), turn, MessageParser(), None, store, held)
    job = BackgroundJob(_FailingRun())
    assert reply.queued(job)["status"] == "queued"
    asyncio.run(reply.background(job))
    stored = store.get(reply.id).body
    assert stored["status"] == "failed" and stored["background"]
    assert "boom" in stored["error"]["message"] and stored["output"] == []
    assert held.items == []  # nothing added to its conversation


def test_a_failed_streamed_background_response_logs_its_failure_and_stores_it():
    store = ResponseStore()
    body = ResponsesRequest(input="Hi", background=True, stream=True)
    turn = Turn([], [], None, None, None, {}, [], {}, [])
    reply = ResponseReply(body, MODEL, SamplingParams(), turn, MessageParser(), None, store)
    job = BackgroundJob(_FailingRun(), events=EventLog())
    reply.queued(job)
    asyncio.run(reply.background(job))
    assert job.events.closed
    events = [json.loads(e.split("\ndata: ")[1]) for e in job.events.events]
    assert [e["type"] for e in events] == [
        "response.created",
        "response.queued",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "error",
        "response.failed",
    ]
    assert events[0]["response"]["status"] == "queued"
    stored = store.get(reply.id)
    assert stored.body == events[-1]["response"] and stored.body["status"] == "failed"
    assert stored.events is job.events  # kept for a replay


def test_an_event_log_replays_after_any_event_and_follows_until_closed():
    async def scenario():
        log = EventLog()
        log.add("e0")
        log.add("e1")
        got = {}

        async def read(after):
            got[after] = [e async for e in log.follow(after)]

        readers = [asyncio.create_task(read(after)) for after in (None, 0, 1, 5)]
        await asyncio.sleep(0)
        assert not any(r.done() for r in readers)  # waiting for what comes next
        log.add("e2")
        await asyncio.sleep(0)
        log.close()
        await asyncio.gather(*readers)
        assert got == {None: ["e0", "e1", "e2"], 0: ["e1", "e2"], 1: ["e2"], 5: []}
        assert [e async for e in log.follow(0)] == ["e1", "e2"]  # closed: replayed at once

    asyncio.run(scenario())

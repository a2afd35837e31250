"""Tool calling over a real server, driven by the official `openai` and `anthropic` clients.

The embedded model was not trained to call tools and its template has none, so the server
renders the shipped hermes template; forced tool choices constrain the output and must give
calls whose arguments validate, `auto` reads whatever the model writes."""

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from inflight.server.chat_templates import HERMES_TEMPLATE
from inflight.server.openai import chat_tools
from inflight.server.parsers.json_scan import partial_value
from inflight.server.protocol import ChatTool
from inflight.server.tools import FunctionTool, ToolChoice, forced_constraint

from server_harness import prompt_of, serve

pytestmark = pytest.mark.slow

MODEL = "test-model"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": PARAMETERS,
        },
    },
    {"type": "function", "function": {"name": "get_time", "description": "The time now"}},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# Parameters as langchain's bind_tools writes them: additionalProperties left unsaid.
OPEN_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
GREEDY = {"temperature": 0, "max_tokens": 40}


@pytest.fixture(scope="module")
def server(server_llm):
    with serve(server_llm, tool_call_parser="hermes") as (url, _):
        yield url


@pytest.fixture
def oa(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def ac(server):
    return anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0)


def _valid_call(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        jsonschema.validate(arguments, PARAMETERS)
    return arguments


def test_named_tool_choice_calls_that_function_with_valid_arguments(oa):
    reply = oa.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, **GREEDY
    )
    choice = reply.choices[0]
    # A named choice's call ends as "stop", as OpenAI's and vLLM's do ("tool_calls" where the
    # model chose to call: auto and required).
    assert choice.finish_reason == "stop"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    _valid_call(call)


def test_a_format_beside_a_forced_call_is_accepted_and_named(oa):
    # The call is the whole reply: a response_format has no text to shape (OpenAI and vLLM
    # accept the pair too).
    for choice in (NAMED, "required"):
        raw = oa.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice=choice,
            response_format={"type": "json_object"},
            **GREEDY,
        )
        assert raw.http_response.headers["x-inflight-ignored-fields"] == "response_format"
        reply = raw.parse().choices[0]
        finished = "stop" if choice == NAMED else "tool_calls"
        assert reply.finish_reason == finished and reply.message.content is None
        for call in reply.message.tool_calls:
            _valid_call(call)


def test_required_tool_choice_makes_one_or_more_valid_calls(oa):
    reply = oa.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", **GREEDY
    )
    assert reply.choices[0].finish_reason == "tool_calls"
    calls = reply.choices[0].message.tool_calls
    assert calls and all(c.function.name in ("get_weather", "get_time") for c in calls)
    for call in calls:
        _valid_call(call)
    single = oa.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        **GREEDY,
    )
    assert len(single.choices[0].message.tool_calls) == 1


def test_mistral_clients_names_any_and_random_seed_are_required_and_seed(oa, server):
    """Mistral's client sends tool_choice "any" for "required" and the seed as random_seed."""
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, **GREEDY}
    required = oa.chat.completions.create(tool_choice="required", **body)
    mistral = httpx.post(server + "/v1/chat/completions", json={**body, "tool_choice": "any"})
    assert mistral.status_code == 200, mistral.text
    calls = mistral.json()["choices"][0]["message"]["tool_calls"]
    assert [c["function"] for c in calls] == [
        c.function.model_dump() for c in required.choices[0].message.tool_calls
    ]
    sampled = {"model": MODEL, "messages": MESSAGES, "temperature": 1.0, "max_tokens": 16}
    seeded = oa.chat.completions.create(seed=7, **sampled).choices[0].message.content
    named = httpx.post(server + "/v1/chat/completions", json={**sampled, "random_seed": 7})
    assert named.json()["choices"][0]["message"]["content"] == seeded
    both = httpx.post(
        server + "/v1/chat/completions", json={**sampled, "seed": 7, "random_seed": 8}
    )
    assert both.status_code == 400 and both.json()["error"]["param"] == "random_seed"


@pytest.mark.parametrize("tool_choice", [NAMED, "required"], ids=["named", "required"])
def test_forced_calls_take_only_the_arguments_the_tool_declares(oa, tool_choice):
    """Not the keys of the model's own that JSON Schema's default allows, which a small model
    writes until the length limit."""
    tool = {**TOOLS[0]["function"], "parameters": OPEN_PARAMETERS}
    reply = oa.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=[{"type": "function", "function": tool}],
        tool_choice=tool_choice,
        temperature=0,
        max_tokens=60,
    )
    assert reply.choices[0].finish_reason == ("stop" if tool_choice == NAMED else "tool_calls")
    for call in reply.choices[0].message.tool_calls:
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments).keys() == {"city"}


def test_a_strict_tool_makes_its_forced_call_strict():
    """OpenAI's strict tools: the constraint closes every object of their parameters."""
    options = {"type": "object", "properties": {"options": {"type": "object"}}}
    strict = FunctionTool("set", None, options, strict=True)
    plain = FunctionTool("get", None, options)
    for tools, mode, function, want in [
        ([strict, plain], "named", "set", True),
        ([strict, plain], "named", "get", False),
        ([strict, plain], "required", None, True),
        ([plain], "required", None, False),
    ]:
        constraint = forced_constraint(ToolChoice(tools, mode, function), "arguments")
        assert constraint.strict is want, (mode, function)


def test_strict_beside_the_function_is_the_functions_own_where_that_says_nothing():
    """TensorZero sends `strict` beside `function` (the Responses API's place for it)."""
    function = {"name": "f", "parameters": PARAMETERS}

    def strict(tool: dict) -> bool:
        (read,) = chat_tools([ChatTool.model_validate({"type": "function", **tool})])
        return read.strict

    assert strict({"function": function, "strict": True})
    assert not strict({"function": function, "strict": False})
    assert not strict({"function": {**function, "strict": False}, "strict": True})
    assert strict({"function": {**function, "strict": True}})


def test_required_beside_the_parameters_is_the_schemas_where_that_names_none():
    """guardrails' function-calling tool repeats the parameters' `required` beside them."""

    def schema(function: dict) -> dict | None:
        (read,) = chat_tools([ChatTool.model_validate({"type": "function", "function": function})])
        return read.parameters

    said = {"name": "f", "parameters": OPEN_PARAMETERS, "required": ["x"]}
    assert schema(said) == OPEN_PARAMETERS  # the schema's own list stands
    unsaid = {"type": "object", "properties": {"city": {"type": "string"}}}
    assert schema({"name": "f", "parameters": unsaid, "required": ["city"]}) == {
        **unsaid,
        "required": ["city"],
    }
    assert schema({"name": "f", "parameters": unsaid}) == unsaid


def test_guardrails_function_calling_tool_is_served_and_its_required_names_hold(oa):
    properties = {
        "city": {"type": "string", "maxLength": 20},
        "note": {"type": "string", "maxLength": 20},
    }
    tool = {
        "type": "function",
        "function": {
            "name": "gd_response_tool",
            "description": "The answer as a structured object",
            "parameters": {"type": "object", "properties": properties},
            "required": ["city", "note"],
        },
    }
    reply = oa.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[tool], tool_choice="required", max_tokens=80,
        temperature=0,
    )  # fmt: skip
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "gd_response_tool"
    assert json.loads(call.function.arguments).keys() >= {"city", "note"}


def test_tensorzeros_tools_are_served(oa):
    tools = [{**tool, "strict": False} for tool in TOOLS]
    reply = oa.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=tools, tool_choice="required", **GREEDY
    )
    for call in reply.choices[0].message.tool_calls:
        _valid_call(call)


def test_streamed_call_reassembles_to_the_non_streamed_one(oa):
    whole = oa.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, **GREEDY
    )
    with oa.chat.completions.stream(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, **GREEDY
    ) as stream:
        chunks = [e.chunk for e in stream if e.type == "chunk"]
        streamed = stream.get_final_completion()
    assert streamed.choices[0].finish_reason == whole.choices[0].finish_reason == "stop"
    (got,) = streamed.choices[0].message.tool_calls
    (want,) = whole.choices[0].message.tool_calls
    assert (got.function.name, got.function.arguments) == (
        want.function.name,
        want.function.arguments,
    )
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    first, rest = deltas[0], deltas[1:]
    assert first.index == 0 and first.id == got.id and first.type == "function"
    assert first.function.name == "get_weather"
    assert rest and all(d.id is None and d.function.name is None for d in rest)


def test_a_tool_result_in_the_history_gets_a_normal_reply(oa, server_llm):
    call = oa.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, **GREEDY
    ).choices[0]
    result = {"role": "tool", "tool_call_id": call.message.tool_calls[0].id, "content": "18 C"}
    history = [*MESSAGES, call.message, result]
    reply = oa.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, **GREEDY)
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.content
    assert not choice.message.tool_calls
    # The assistant's call and the result went through the (shipped) template.
    template_history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.message.tool_calls[0].id,
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": json.loads(call.message.tool_calls[0].function.arguments),
                    },
                }
            ],
        },
        result,
    ]
    prepared = server_llm.prepare(
        template_history, tools=TOOLS, chat_template=HERMES_TEMPLATE.read_text()
    )
    assert reply.usage.prompt_tokens == len(prepared.prompt_token_ids)
    rendered = server_llm.tokenizer.decode(prepared.prompt_token_ids, skip_special_tokens=False)
    assert '<tool_call>\n{"name": "get_weather"' in rendered
    assert "<tool_response>\n18 C\n</tool_response>" in rendered
    # Without the call's id (Llama Stack's vLLM adapter sends none; vLLM takes it): served, and
    # the same here, where the template renders no ids.
    bare = [*MESSAGES, call.message, {"role": "tool", "content": "18 C"}]
    again = oa.chat.completions.create(model=MODEL, messages=bare, tools=TOOLS, **GREEDY)
    assert again.usage.prompt_tokens == reply.usage.prompt_tokens
    assert again.choices[0].message.content == choice.message.content
    # Keys of the client's own beside a call's (tau2-bench sends the call's `name`, clients
    # that rebuild calls from streamed deltas their `index`): ignored, as vLLM does.
    sent = call.message.model_dump(exclude_none=True)
    sent["tool_calls"][0] |= {"name": "get_weather", "index": 0}
    sent["tool_calls"][0]["function"]["thought_signature"] = "x"
    kept = oa.chat.completions.create(
        model=MODEL, messages=[*MESSAGES, sent, result], tools=TOOLS, **GREEDY
    )
    assert kept.usage.prompt_tokens == reply.usage.prompt_tokens
    assert kept.choices[0].message.content == choice.message.content


def test_a_call_cut_short_is_sent_back_and_rendered_as_far_as_written(oa, server_llm):
    # pydantic-ai, kani and marvin tell the model its call's JSON was broken and replay the
    # call: a 400 there would end the conversation, since every later turn replays it too.
    cut = oa.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=16
    ).choices[0]
    assert cut.finish_reason == "length"
    text = cut.message.tool_calls[0].function.arguments
    with pytest.raises(ValueError):
        json.loads(text)
    calls = [
        # (id, arguments as sent, the object the template renders)
        (cut.message.tool_calls[0].id, text, partial_value(text)),
        ("c2", '{"city": "Par', {"city": "Par"}),
        ("c3", '{"city": Paris}', {}),  # malformed: an empty object
        ("c4", "[1]", {}),  # no object: an empty one
    ]
    sent, rendered = [*MESSAGES], [*MESSAGES]
    for call_id, arguments, read in calls:
        result = {"role": "tool", "tool_call_id": call_id, "content": "Invalid JSON, try again."}
        for history, args in ((sent, arguments), (rendered, read)):
            call = {"id": call_id, "type": "function", "function": {"name": "get_weather"}}
            call["function"]["arguments"] = args
            history += [{"role": "assistant", "content": "", "tool_calls": [call]}, result]
    assert isinstance(calls[0][2], dict)
    reply = oa.chat.completions.create(model=MODEL, messages=sent, tools=TOOLS, **GREEDY)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    prepared = server_llm.prepare(rendered, tools=TOOLS, chat_template=HERMES_TEMPLATE.read_text())
    assert reply.usage.prompt_tokens == len(prepared.prompt_token_ids)


def test_auto_reads_what_the_model_writes_and_none_never_calls(oa):
    # The untrained model answers in prose: auto finds no call in it, and returns the text.
    auto = oa.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, **GREEDY)
    none = oa.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none", **GREEDY
    )
    for reply in (auto, none):
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert not reply.choices[0].message.tool_calls and reply.choices[0].message.content
    assert auto.choices[0].message.content == none.choices[0].message.content


def _allowed(names, mode):
    return {
        "type": "allowed_tools",
        "allowed_tools": {
            "mode": mode,
            "tools": [{"type": "function", "function": {"name": n}} for n in names],
        },
    }


def test_allowed_tools_offer_only_the_tools_they_name(oa, server_llm):
    # "required" among get_time alone: the call is get_time, though get_weather is listed
    # first and the question is about the weather.
    reply = oa.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=_allowed(["get_time"], "required"),
        parallel_tool_calls=False,
        **GREEDY,
    )
    assert reply.choices[0].finish_reason == "tool_calls"
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    # "auto" among them is auto over those tools: the prompt shows only them, so the reply
    # is the one auto gives with the allowed tools alone.
    allowed = oa.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=_allowed(["get_weather"], "auto"),
        **GREEDY,
    )
    alone = oa.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS[:1], tool_choice="auto", **GREEDY
    )
    assert allowed.choices[0].message.content == alone.choices[0].message.content
    assert allowed.usage.prompt_tokens == alone.usage.prompt_tokens


def test_anthropics_own_tool_types_are_refused_by_name(ac):
    for tool in (
        {"type": "code_execution_20250825", "name": "code_execution"},
        {"type": "bash_20250124", "name": "bash"},
    ):
        with pytest.raises(anthropic.BadRequestError) as info:
            ac.messages.create(model=MODEL, max_tokens=5, messages=MESSAGES, tools=[tool])
        message = info.value.body["error"]["message"]
        # The validator's words, not pydantic's "Value error, " before them.
        assert message.startswith(f"tools.0: tools of type {tool['type']!r} are not supported")


def test_anthropics_web_search_is_left_out_and_named_but_not_choosable(ac):
    """Cline's Anthropic provider offers the hosted web search with every request: the reply
    is the one without it, which the response header names as ignored."""
    search = {"type": "web_search_20250305", "name": "web_search", "max_uses": 2}
    custom = [{"name": "get_time", "input_schema": {"type": "object"}}]
    greedy = dict(model=MODEL, max_tokens=8, messages=MESSAGES, extra_body={"temperature": 0})
    raw = ac.messages.with_raw_response.create(**greedy, tools=[search, *custom])
    assert raw.headers["x-inflight-ignored-fields"] == "tools.0 (web_search_20250305)"
    alone = ac.messages.create(**greedy, tools=custom)
    reply = raw.parse()
    assert reply.content == alone.content
    assert prompt_of(reply.usage) == prompt_of(alone.usage)  # the same prompt
    with pytest.raises(anthropic.BadRequestError):
        ac.messages.create(
            **greedy, tools=[search, *custom], tool_choice={"type": "tool", "name": "web_search"}
        )


@pytest.mark.parametrize(
    ("choice", "param"),
    [
        ({"type": "function", "function": {"name": "get_stock_price"}}, "tool_choice"),
        (
            _allowed(["get_time", "get_stock_price"], "required"),
            "tool_choice.allowed_tools.tools.1",
        ),
    ],
    ids=["named", "allowed"],
)
def test_a_missing_tool_is_a_400_naming_it_and_nothing_is_submitted(
    server, server_llm, choice, param
):
    before = server_llm.get_scheduling_metrics()["submitted"]
    r = httpx.post(
        server + "/v1/chat/completions",
        json={"messages": MESSAGES, "tools": TOOLS, "tool_choice": choice},
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param and "get_stock_price" in error["message"]
    assert server_llm.get_scheduling_metrics()["submitted"] == before


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, "tools"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        (
            {
                "messages": [
                    {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}
                ]
            },
            "messages",
        ),
    ],
)
def test_malformed_tool_requests_are_400_naming_the_field(server, change, param):
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, **change}
    r = httpx.post(server + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param)


def test_auto_without_a_tool_call_parser_is_a_400_naming_the_flag(server_llm):
    with serve(server_llm) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS)
        assert info.value.body["param"] == "tool_choice"
        assert "--tool-call-parser" in info.value.body["message"]
        # Forced choices need no parser: the constraint builds the call.
        named = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, **GREEDY
        )
        assert named.choices[0].message.tool_calls[0].function.name == "get_weather"


ANTHROPIC_TOOLS = [
    {"name": "get_weather", "description": "The current weather", "input_schema": PARAMETERS}
]


def _forced_weather(messages=MESSAGES, tools=ANTHROPIC_TOOLS, max_tokens=40):
    """A greedy Messages request that must call get_weather."""
    return dict(
        model=MODEL,
        max_tokens=max_tokens,
        messages=messages,
        tools=tools,
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 0},
    )


def test_anthropic_tool_use_round_trip(ac):
    message = ac.messages.create(**_forced_weather())
    assert message.stop_reason == "tool_use"
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, PARAMETERS)
    with ac.messages.stream(**_forced_weather()) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["tool_use"]
    assert any(
        e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events
    )
    assert streamed.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in streamed.content] == [(use.name, use.input)]
    history = [
        *MESSAGES,
        {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C"}],
        },
    ]
    reply = ac.messages.create(
        model=MODEL,
        max_tokens=20,
        messages=history,
        tools=ANTHROPIC_TOOLS,
        extra_body={"temperature": 0},
    )
    assert reply.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text
    counted = ac.messages.count_tokens(model=MODEL, messages=history, tools=ANTHROPIC_TOOLS)
    assert counted.input_tokens == prompt_of(reply.usage)


def test_auto_parses_a_hermes_call_the_model_writes_whole_and_streamed(oa):
    # The untrained model is made to write a hermes call (a constraint on the raw text).
    call = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}"\}\}\n'
    request = dict(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        extra_body={"structured_outputs": {"regex": call + "</tool_call>"}},
        **GREEDY,
    )
    whole = oa.chat.completions.create(**request).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    (got,) = whole.message.tool_calls
    assert got.function.name == "get_weather" and "city" in json.loads(got.function.arguments)
    with oa.chat.completions.stream(**request) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls" and not streamed.message.content
    (call,) = streamed.message.tool_calls
    assert (call.function.name, call.function.arguments) == (
        got.function.name,
        got.function.arguments,
    )


def test_anthropic_deferred_tool_is_called_once_a_tool_search_loaded_it(ac):
    """The API's tool search: a `defer_loading` tool is neither shown nor callable until a
    `tool_reference` block in a tool result loads it (as Claude Code's ToolSearch answers)."""
    search = {"name": "search_tools", "input_schema": {"type": "object"}}
    deferred = {**ANTHROPIC_TOOLS[0], "defer_loading": True}
    placeholder = {"name": "Placeholder", "input_schema": {"type": "object"}, "defer_loading": True}
    tools = [search, deferred, placeholder]
    with pytest.raises(anthropic.BadRequestError):  # not loaded: no such tool to call
        ac.messages.create(**_forced_weather(tools=tools))
    # Unloaded deferred tools are not rendered at all.
    assert (
        ac.messages.count_tokens(model=MODEL, messages=MESSAGES, tools=tools).input_tokens
        == ac.messages.count_tokens(model=MODEL, messages=MESSAGES, tools=[search]).input_tokens
    )
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_s", "name": "search_tools", "input": {}}],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_s",
                    "content": [{"type": "tool_reference", "tool_name": "get_weather"}],
                }
            ],
        },
    ]
    message = ac.messages.create(**_forced_weather(history, tools))
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "get_weather"
    jsonschema.validate(use.input, PARAMETERS)
    # Loaded, it is rendered as a tool sent without deferral.
    plain = [search, ANTHROPIC_TOOLS[0]]
    assert (
        ac.messages.count_tokens(model=MODEL, messages=history, tools=tools).input_tokens
        == ac.messages.count_tokens(model=MODEL, messages=history, tools=plain).input_tokens
    )


def _forced_weather_response(oa, max_output_tokens: int):
    """A greedy Responses request that must call get_weather."""
    return oa.responses.create(
        model=MODEL,
        input=MESSAGES[0]["content"],
        tools=[{"type": "function", **TOOLS[0]["function"]}],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=max_output_tokens,
    )


def test_a_call_cut_by_max_tokens_is_the_call_as_written_on_every_api(oa, ac):
    """A forced call cut by max_tokens comes back as a call whose arguments stop where the
    reply did (OpenAI's finish_reason "length"), whole as streamed; the Responses API marks it
    incomplete; Anthropic's tool_use block holds the input as far as written."""
    request = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, temperature=0)
    full = oa.chat.completions.create(**request, max_tokens=60)
    whole_arguments = full.choices[0].message.tool_calls[0].function.arguments
    cut = full.usage.completion_tokens - 3
    reply = oa.chat.completions.create(**request, max_tokens=cut)
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    arguments = call.function.arguments
    assert whole_arguments.startswith(arguments) and len(arguments) < len(whole_arguments)
    stream = oa.chat.completions.create(**request, max_tokens=cut, stream=True)
    streamed = "".join(
        c.choices[0].delta.tool_calls[0].function.arguments or ""
        for c in stream
        if c.choices and c.choices[0].delta.tool_calls
    )
    assert streamed == arguments
    responses = _forced_weather_response(oa, cut)
    assert responses.status == "incomplete"
    (item,) = responses.output
    assert item.type == "function_call" and item.status == "incomplete"
    assert item.arguments == arguments
    message = ac.messages.create(**_forced_weather(max_tokens=cut))
    assert message.stop_reason == "max_tokens"
    (use,) = message.content
    assert use.type == "tool_use" and use.name == "get_weather"
    written = json.loads(whole_arguments)
    assert use.input and all(
        written[k].startswith(v) or written[k] == v for k, v in use.input.items()
    )


def test_a_forced_call_cut_inside_its_name_is_still_that_call_on_every_api(oa, ac):
    """A choice that leaves one function (named, or `required` with one tool) cut by max_tokens
    before the model has written the name is that function's call with the arguments written
    (none), as OpenAI sends a forced call's name first; not the fragment as content."""
    request = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=2)
    for tools, tool_choice in ((TOOLS, NAMED), (TOOLS[:1], "required")):
        reply = oa.chat.completions.create(**request, tools=tools, tool_choice=tool_choice)
        choice = reply.choices[0]
        assert choice.finish_reason == "length" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert (call.function.name, call.function.arguments) == ("get_weather", "")
        stream = oa.chat.completions.create(
            **request, tools=tools, tool_choice=tool_choice, stream=True
        )
        deltas = [c.choices[0].delta for c in stream if c.choices]
        assert not any(d.content for d in deltas)
        calls = [call for d in deltas for call in d.tool_calls or []]
        assert [c.function.name for c in calls if c.function.name] == ["get_weather"]
    responses = _forced_weather_response(oa, 2)
    (item,) = responses.output
    assert (item.type, item.name, item.status) == ("function_call", "get_weather", "incomplete")
    message = ac.messages.create(**_forced_weather(max_tokens=2))
    (use,) = message.content
    assert (use.type, use.name, use.input) == ("tool_use", "get_weather", {})
    assert message.stop_reason == "max_tokens"

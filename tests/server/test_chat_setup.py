"""The server's chat setup, decided at start: which template renders a conversation, which
parsers read the reply, the flags that set them, and the schema of a forced tool choice."""

import jsonschema
import pytest

from inflight.server.chat import ChatSetup
from inflight.server.chat_templates import (
    HERMES_TEMPLATE,
    ChatTemplates,
    choose_templates,
    read_template,
    template_variables,
)
from inflight.server.cli import build_parser, main
from inflight.server.errors import ServerError
from inflight.server.tools import FunctionTool, ToolChoice, forced_constraint, tool_choice

CHATML = "{% for m in messages %}{{ m.content }}{% endfor %}"
WITH_TOOLS = "{% if tools %}{{ tools | tojson }}{% endif %}" + CHATML
WEATHER = FunctionTool(
    "get_weather",
    None,
    {
        "type": "object",
        "properties": {"place": {"$ref": "#/$defs/place"}},
        "required": ["place"],
        "$defs": {"place": {"type": "string", "enum": ["Paris", "Lyon"]}},
    },
)
TIME = FunctionTool("get_time", "The time", None)


def test_a_template_without_tools_gets_the_shipped_hermes_template_for_tools():
    shipped = HERMES_TEMPLATE.read_text()
    chatml, tools = template_variables(CHATML), template_variables(WITH_TOOLS)
    assert choose_templates(CHATML, None) == ChatTemplates(None, shipped, True, chatml)
    assert choose_templates(WITH_TOOLS, None) == ChatTemplates(None, None, False, tools)
    assert choose_templates(CHATML, WITH_TOOLS) == ChatTemplates(
        WITH_TOOLS, WITH_TOOLS, False, tools
    )
    assert choose_templates(WITH_TOOLS, CHATML) == ChatTemplates(CHATML, shipped, True, chatml)
    assert "tools" in tools and "tools" not in chatml


def test_template_args_pick_the_tools_template_for_tools_and_tool_history():
    setup = ChatSetup.create(CHATML, None, "hermes", None)
    plain = [{"role": "user", "content": "hi"}]
    assert "chat_template" not in setup.template_args(plain, None)
    choice = ToolChoice([TIME], "auto")
    args = setup.template_args(plain, choice, {"enable_thinking": False})
    assert args["chat_template"] == HERMES_TEMPLATE.read_text()
    assert args["tools"] == [
        {"type": "function", "function": {"name": "get_time", "description": "The time"}}
    ]
    assert args["chat_template_kwargs"] == {"enable_thinking": False}
    history = [*plain, {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    assert setup.template_args(history, None)["chat_template"] == HERMES_TEMPLATE.read_text()


def test_parsers_the_model_cannot_serve_are_refused_at_start():
    with pytest.raises(ValueError, match="--chat-template"):
        ChatSetup.create(CHATML, None, "llama3_json", None)
    assert ChatSetup.create(WITH_TOOLS, None, "llama3_json", None).arguments_key == "parameters"
    with pytest.raises(ValueError, match="hermes"):
        ChatSetup.create(CHATML, None, "pythonic", None)
    with pytest.raises(ValueError, match="qwen3"):
        ChatSetup.create(CHATML, None, None, "deepseek")
    with pytest.raises(ValueError, match="needs --reasoning-parser openai_gptoss"):
        ChatSetup.create(WITH_TOOLS, None, "openai", "qwen3")


def test_chat_template_flag_takes_a_file_or_the_text(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(WITH_TOOLS)
    assert read_template(str(path)) == WITH_TOOLS
    assert read_template(CHATML) == CHATML
    with pytest.raises(ValueError, match="cannot read"):
        read_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not parse"):
        read_template("{% for %}")


def test_serve_flags_and_their_checks():
    args = build_parser().parse_args(
        [
            "serve",
            "--tool-call-parser",
            "hermes",
            "--enable-auto-tool-choice",
            "--reasoning-parser",
            "qwen3",
            "--chat-template",
            "t.jinja",
        ]
    )
    assert (args.tool_call_parser, args.reasoning_parser, args.chat_template) == (
        "hermes",
        "qwen3",
        "t.jinja",
    )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "mistral"])
    # vLLM's rule, checked before any model loads.
    assert main(["serve", "--enable-auto-tool-choice"]) == 2


def test_named_choice_schema_is_the_call_object_of_that_function():
    choice = tool_choice([WEATHER, TIME], "named", "get_weather", True, parser=None)
    schema = forced_constraint(choice, "arguments").json
    jsonschema.validate({"name": "get_weather", "arguments": {"place": "Paris"}}, schema)
    for wrong in (
        {"name": "get_time", "arguments": {"place": "Paris"}},
        {"name": "get_weather", "arguments": {"place": "Rome"}},
        {"name": "get_weather"},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)


def test_required_schema_is_an_array_of_calls_and_one_without_parallel_calls():
    calls = [
        {"name": "get_weather", "parameters": {"place": "Lyon"}},
        {"name": "get_time", "parameters": {}},
    ]
    many = forced_constraint(ToolChoice([WEATHER, TIME], "required"), "parameters").json
    jsonschema.validate(calls, many)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], many)
    one = forced_constraint(ToolChoice([WEATHER, TIME], "required", parallel=False), "parameters")
    jsonschema.validate(calls[:1], one.json)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(calls, one.json)


def test_conflicting_definitions_and_bad_choices_are_400s():
    other = FunctionTool("other", None, {"$defs": {"place": {"type": "integer"}}})
    with pytest.raises(ServerError) as info:
        forced_constraint(ToolChoice([WEATHER, other], "required"), "arguments")
    assert info.value.param == "tools"
    for tools, mode, name, param in (
        ([WEATHER, WEATHER], "auto", None, "tools"),
        ([WEATHER], "named", "get_time", "tool_choice"),
        ([], "required", None, "tool_choice"),
        ([WEATHER], None, None, "tool_choice"),  # auto, and no parser
    ):
        with pytest.raises(ServerError) as info:
            tool_choice(tools, mode, name, True, parser=None)
        assert info.value.status == 400 and info.value.param == param
    assert tool_choice([], None, None, True, parser=None) is None
    assert tool_choice([WEATHER], None, None, True, parser="hermes").mode == "auto"

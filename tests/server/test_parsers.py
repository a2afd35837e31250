"""Tool-call and reasoning parsers on fixed strings: whole replies, and streams cut at every
position (inside tags, inside JSON strings) that must add up to the same reply."""

import json

import pytest

from inflight.server.parsers import MessageParser, ThinkTags, ToolCall
from inflight.server.parsers.forced import ForcedCallsSyntax
from inflight.server.parsers.harmony import HarmonyCalls, HarmonyChannels
from inflight.server.parsers.hermes import HermesSyntax
from inflight.server.parsers.json_scan import partial_value
from inflight.server.parsers.llama3_json import Llama3JsonSyntax
from inflight.server.parsers.message import ToolCallDelta

HERMES = MessageParser(tools=HermesSyntax())
LLAMA = MessageParser(tools=Llama3JsonSyntax())
QWEN3 = MessageParser(reasoning=ThinkTags(), tools=HermesSyntax())

WEATHER = '{"city": "Paris", "note": "say \\"hi\\" <tool_call> {x}"}'
TWO_CALLS = (
    "Let me check.\n"
    f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)


def reassemble(parser: MessageParser, deltas: list[str]):
    """(reasoning, content, calls) that a client rebuilds from the stream of `deltas`."""
    stream = parser.stream()
    reasoning, content, calls = "", "", {}
    for delta in [*(stream.feed(d) for d in deltas), stream.finish()]:
        reasoning += delta.reasoning
        content += delta.content
        for call in delta.tool_calls:
            if call.name is not None:
                assert call.index not in calls, "a call's first delta came twice"
                calls[call.index] = [call.name, ""]
            calls[call.index][1] += call.arguments
    assert sorted(calls) == list(range(len(calls)))
    return reasoning or None, content or None, [ToolCall(n, a) for n, a in calls.values()]


def every_cut(parser: MessageParser, text: str) -> None:
    """The stream equals the whole reply whether the text comes in two pieces (cut anywhere)
    or one character at a time."""
    whole = parser.whole(text)
    expected = (whole.reasoning, whole.content, whole.tool_calls)
    for cut in range(len(text) + 1):
        assert reassemble(parser, [text[:cut], text[cut:]]) == expected, cut
    assert reassemble(parser, list(text)) == expected


def test_hermes_whole_reply_has_content_and_calls_in_order():
    parsed = HERMES.whole(TWO_CALLS)
    assert parsed.content == "Let me check."
    assert parsed.tool_calls == [
        ToolCall("get_weather", WEATHER),
        ToolCall("get_time", '{"zone": "CET"}'),
    ]
    assert json.loads(parsed.tool_calls[0].arguments)["note"] == 'say "hi" <tool_call> {x}'


def test_hermes_stream_cut_anywhere_adds_up_to_the_whole_reply():
    every_cut(HERMES, TWO_CALLS)


def test_hermes_stream_never_sends_part_of_a_tag_as_content():
    stream = HERMES.stream()
    sent = [stream.feed(c).content for c in "Hi <tool_call"]
    assert "".join(sent) == "Hi"
    assert stream.feed('>{"name": "f"').tool_calls[0].name == "f"


def test_hermes_call_header_comes_first_then_argument_fragments():
    stream = HERMES.stream()
    deltas = [stream.feed(c) for c in '<tool_call>{"name": "f", "arguments": {"a": 1}}']
    calls = [c for d in deltas for c in d.tool_calls]
    assert calls[0].name == "f" and calls[0].index == 0
    assert all(c.name is None and c.arguments for c in calls[1:])
    assert "".join(c.arguments for c in calls) == '{"a": 1}'


def test_hermes_without_calls_is_the_text_unchanged():
    text = "  Paris is the capital.\n\n"
    assert HERMES.whole(text).content == text and HERMES.whole(text).tool_calls == []
    every_cut(HERMES, text)


def test_hermes_call_that_does_not_parse_stays_content():
    text = 'Try <tool_call>{"name": "f", "arguments": {"a": }}</tool_call>'
    parsed = HERMES.whole(text)
    assert parsed.tool_calls == [] and parsed.content == text


def test_hermes_span_without_a_name_stays_content_in_a_stream_too():
    every_cut(HERMES, 'A <tool_call>{"city": "Paris"}</tool_call> B')
    assert HERMES.whole('A <tool_call>{"city": "Paris"}</tool_call> B').tool_calls == []


def test_hermes_unterminated_call_counts_and_missing_arguments_are_empty():
    parsed = HERMES.whole('<tool_call>\n{"name": "now"}\n')
    assert parsed.tool_calls == [ToolCall("now", "{}")] and parsed.content is None
    every_cut(HERMES, '<tool_call>\n{"name": "now"}\n')


def test_hermes_accepts_parameters_for_arguments_and_text_after_the_calls():
    text = '<tool_call>{"parameters": {"q": "x"}, "name": "search"}</tool_call>\nDone.'
    parsed = HERMES.whole(text)
    assert parsed.tool_calls == [ToolCall("search", '{"q": "x"}')]
    assert parsed.content == "Done."
    every_cut(HERMES, text)


def test_a_cut_off_call_is_the_call_as_written_whole_and_streamed():
    """A reply cut by max_tokens inside a call (its name written) returns the call with its
    arguments as far as written, as OpenAI does; a whole reply as its stream."""
    text = 'Sure. <tool_call>{"name": "f", "arguments": {"a": "unfini'
    whole = HERMES.whole(text)
    assert whole.tool_calls == [ToolCall("f", '{"a": "unfini')] and whole.content == "Sure."
    _, content, calls = reassemble(HERMES, [text])
    assert calls == whole.tool_calls and content == whole.content
    # Cut before the name is whole: no call yet, the text as written.
    early = '<tool_call>{"name": "f'
    assert HERMES.whole(early).tool_calls == [] and HERMES.whole(early).content == early
    # A forced choice's array cut inside its second call: both calls.
    forced = MessageParser(tools=ForcedCallsSyntax("arguments", array=True))
    cut = '[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"x": [1, 2'
    assert forced.whole(cut).tool_calls == [ToolCall("f", "{}"), ToolCall("g", '{"x": [1, 2')]


def test_max_calls_keeps_the_first_call_only():
    parser = MessageParser(tools=HermesSyntax(), max_calls=1)
    assert [c.name for c in parser.whole(TWO_CALLS).tool_calls] == ["get_weather"]
    every_cut(parser, TWO_CALLS)


def test_llama3_json_one_call_and_several_separated_by_semicolons():
    one = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert LLAMA.whole(one).tool_calls == [ToolCall("get_weather", '{"city": "Paris"}')]
    assert LLAMA.whole(one).content is None
    several = f'<|python_tag|>{one}; {{"name": "get_time", "parameters": {{}}}}'
    assert [c.name for c in LLAMA.whole(several).tool_calls] == ["get_weather", "get_time"]
    every_cut(LLAMA, one)
    every_cut(LLAMA, several)


def test_llama3_json_prose_and_json_without_a_name_are_content():
    for text in ("The weather is fine {really}.", '{"city": "Paris"}', "  "):
        assert LLAMA.whole(text).content == text and LLAMA.whole(text).tool_calls == []
        every_cut(LLAMA, text)


def test_forced_named_call_object_and_required_array():
    named = MessageParser(tools=ForcedCallsSyntax("arguments", array=False))
    text = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert named.whole(text).tool_calls == [ToolCall("get_weather", '{"city": "Paris"}')]
    every_cut(named, text)
    required = MessageParser(tools=ForcedCallsSyntax("arguments", array=True))
    text = f'[{text},{{"name": "get_time", "arguments": {{}}}}]'
    assert [c.name for c in required.whole(text).tool_calls] == ["get_weather", "get_time"]
    assert required.whole(text).content is None
    every_cut(required, text)


def test_reasoning_with_both_tags_generated():
    parser = MessageParser(reasoning=ThinkTags())
    text = "<think>\nThe user wants a city.\n</think>\n\nParis."
    parsed = parser.whole(text)
    assert (parsed.reasoning, parsed.content) == ("The user wants a city.", "Paris.")
    every_cut(parser, text)


def test_reasoning_opened_by_the_prompt_so_only_the_close_tag_is_generated():
    tags = ThinkTags()
    assert tags.thinks_from_prompt("<|im_start|>assistant\n<think>\n")
    parser = MessageParser(reasoning=tags, thinking=True)
    parsed = parser.whole("Hmm, France.</think>Paris.")
    assert (parsed.reasoning, parsed.content) == ("Hmm, France.", "Paris.")
    every_cut(parser, "Hmm, France.</think>Paris.")


def test_a_missing_close_tag_makes_everything_reasoning():
    for parser, text in (
        (MessageParser(reasoning=ThinkTags()), "<think>still thinking"),
        (MessageParser(reasoning=ThinkTags(), thinking=True), "still thinking </thi"),
    ):
        parsed = parser.whole(text)
        assert parsed.content is None and parsed.reasoning.startswith("still thinking")
        every_cut(parser, text)


def test_no_reasoning_when_thinking_is_off():
    tags = ThinkTags()
    assert not tags.thinks_from_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    parser = MessageParser(reasoning=tags)
    parsed = parser.whole("Paris. I think </think> not.")
    assert parsed.reasoning is None and parsed.content == "Paris. I think </think> not."
    every_cut(parser, "Paris. I think </think> not.")


HARMONY = MessageParser(reasoning=HarmonyChannels())
ANALYSIS_THEN_FINAL = (
    "<|channel|>analysis<|message|>The user wants a city. <b>France</b>.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Paris, of course."
)


def test_harmony_analysis_is_reasoning_and_final_is_content():
    """gpt-oss's reply after its template's `<|start|>assistant`: the analysis channel, then
    the final one (`<|return|>`, its end of turn, is a stop token: not in the text)."""
    parsed = HARMONY.whole(ANALYSIS_THEN_FINAL)
    assert parsed.reasoning == "The user wants a city. <b>France</b>."
    assert parsed.content == "Paris, of course."
    every_cut(HARMONY, ANALYSIS_THEN_FINAL)
    assert not HarmonyChannels().thinks_from_prompt("<|start|>assistant")


@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        ("<|channel|>final<|message|>Paris.", None, "Paris."),
        ("<|channel|>analysis<|message|>cut off mid-thou", "cut off mid-thou", None),
        ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>ana", "a", None),
        (
            "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
            '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"a": 1}',
            "Need the weather.",
            '{"a": 1}',
        ),
        ("No harmony at all <|end|>", None, "No harmony at all <|end|>"),
    ],
    ids=["final only", "cut off", "cut in a header", "commentary", "no markers"],
)
def test_harmony_replies(text, reasoning, content):
    parsed = HARMONY.whole(text)
    assert (parsed.reasoning, parsed.content) == (reasoning, content)
    every_cut(HARMONY, text)


HARMONY_TOOLS = MessageParser(reasoning=HarmonyChannels(calls=True), tools=HarmonyCalls())
HARMONY_CALL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
    "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city": "Paris", "note": "<b>"}'
)


def test_harmony_calls_are_tool_calls_with_the_openai_parser():
    """A message to `functions.NAME` is a call of NAME with its body as the arguments (its
    `<|call|>` end is a stop token: not in the text); a preamble in the commentary channel and
    the final answer stay content; without the parser the arguments are content."""
    parsed = HARMONY_TOOLS.whole(HARMONY_CALL)
    assert parsed.reasoning == "Need the weather."
    assert parsed.tool_calls == [ToolCall("get_weather", '{"city": "Paris", "note": "<b>"}')]
    assert parsed.content is None
    every_cut(HARMONY_TOOLS, HARMONY_CALL)
    two = (
        "<|channel|>commentary<|message|>Checking both.<|end|>"
        '<|start|>assistant to=functions.a<|channel|>commentary json<|message|>{"x": 1}<|call|>'
        "<|start|>assistant<|channel|>commentary to=functions.b <|constrain|>json<|message|>{}"
    )
    parsed = HARMONY_TOOLS.whole(two)
    assert parsed.content == "Checking both."
    assert parsed.tool_calls == [ToolCall("a", '{"x": 1}'), ToolCall("b", "{}")]
    every_cut(HARMONY_TOOLS, two)
    assert HARMONY.whole(HARMONY_CALL).content == '{"city": "Paris", "note": "<b>"}'


def test_tool_calls_are_read_from_the_content_only():
    text = (
        '<think>I could write <tool_call>{"name": "no"}</tool_call> here.</think>\n'
        '<tool_call>{"name": "yes", "arguments": {}}</tool_call>'
    )
    parsed = QWEN3.whole(text)
    assert parsed.reasoning == 'I could write <tool_call>{"name": "no"}</tool_call> here.'
    assert parsed.tool_calls == [ToolCall("yes", "{}")] and parsed.content is None
    every_cut(QWEN3, text)


def test_plain_parser_passes_text_through():
    plain = MessageParser()
    assert plain.whole(" <think>x</think> ").content == " <think>x</think> "
    stream = plain.stream()
    assert stream.feed(" <th").content == " <th" and not stream.finish()


@pytest.mark.parametrize(
    "text", ["", "<", "<tool_call>", "<think>", "{", "[{", "<|channel|>", "<|message|>x<|"]
)
def test_fragments_alone_never_fail(text):
    forced = MessageParser(tools=ForcedCallsSyntax("a", True))
    for parser in (HERMES, LLAMA, QWEN3, HARMONY, HARMONY_TOOLS, forced):
        parser.whole(text)
        every_cut(parser, text)


def test_a_delta_keeps_content_and_calls_in_the_order_written():
    stream = HERMES.stream()
    delta = stream.feed('A <tool_call>{"name": "f", "arguments": {}}</tool_call> B')
    assert [p if isinstance(p, str) else p.name for p in delta.parts] == ["A", "f", "B"]


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ('{"city": "Pa', {"city": "Pa"}),
        ('{"city": "Paris", "unit": "cel', {"city": "Paris", "unit": "cel"}),
        ('{"a": [1, 2, {"b": tr', {"a": [1, 2, {}]}),
        ('{"a": 12', {"a": 12}),
        ('{"a": 1.', {}),
        ('{"a"', {}),
        ('{"a":', {}),
        ("", None),
        ('[1, "x\\', [1, "x"]),
        ('"ab\\u00', "ab"),
        ('{"q": "a\\\\', {"q": "a\\"}),
        ('{"a": "x\\"y', {"a": 'x"y'}),
        ('{"x": null, "y": [true]}', {"x": None, "y": [True]}),
    ],
)
def test_partial_value_closes_what_a_cut_reply_left_open(text, value):
    assert partial_value(text) == value


def test_partial_value_refuses_what_is_no_json():
    for text in ('{"a" 1', "{1: 2}", '{"a": nope, "b": 1}'):
        with pytest.raises(ValueError):
            partial_value(text)


def test_a_forced_choice_of_one_function_is_that_call_from_its_first_character():
    named = MessageParser(tools=ForcedCallsSyntax("arguments", False, "get_weather"))
    for cut in ('{"', '{"na', '{"name": "get_w', '{"name": "get_weather", "argu'):
        assert named.whole(cut).tool_calls == [ToolCall("get_weather", "")]
        assert named.whole(cut).content is None
    cut = '{"name": "get_weather", "arguments": {"city": "Pa'
    assert named.whole(cut).tool_calls == [ToolCall("get_weather", '{"city": "Pa')]
    text = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    every_cut(named, text)
    stream = named.stream()
    (first,) = stream.feed('{"').parts
    assert isinstance(first, ToolCallDelta) and first.name == "get_weather"
    required = MessageParser(tools=ForcedCallsSyntax("arguments", True, "get_weather"))
    cut = f'[{text}, {{"na'
    assert required.whole(cut).tool_calls == [
        ToolCall("get_weather", '{"city": "Paris"}'),
        ToolCall("get_weather", ""),
    ]
    every_cut(required, f"[{text}, {text}]")
    assert required.whole("[").tool_calls == [ToolCall("get_weather", "")]
    assert required.whole("[").content is None

"""gpt-oss's harmony replies over a real server started with `--reasoning-parser openai_gptoss`:
a tiny random gpt-oss whose tokenizer has harmony's special tokens, a chat template that
renders harmony, and a grammar that makes the model write an analysis and a final message
with those tokens. The parser needs the markers, which decoding would drop as special tokens:
the server keeps them for it, and leaves none in what it returns."""

import json

import openai
import pytest

from inflight import LLM, SamplingParams

from server_harness import serve
from tiny_models import make_tiny_gpt_oss

pytestmark = pytest.mark.slow

MODEL = "test-model"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
# Harmony's rendering of a conversation, as gpt-oss's template writes it (without its system
# message): each message `<|start|>role<|message|>text<|end|>`, then the assistant's turn opened.
TEMPLATE = (
    "{% if tools %}<|start|>developer<|message|>{{ tools | tojson }}<|end|>{% endif %}"
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
GRAMMAR = (
    'start: <|channel|> "analysis" <|message|> /[a-z ]{4,12}/ <|end|> '
    '<|start|> "assistant" <|channel|> "final" <|message|> /[A-Z][a-z ]{2,8}/'
)
CONSTRAINED = {"structured_outputs": {"grammar": GRAMMAR}}


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss")
    make_tiny_gpt_oss(path)
    with LLM(path, quantization="none", max_batch_size=4, max_model_len=512) as llm:
        yield llm


def test_analysis_is_reasoning_and_final_is_content(gpt_oss):
    params = SamplingParams(temperature=0, max_tokens=60, skip_special_tokens=False,
                            structured_outputs={"grammar": GRAMMAR})  # fmt: skip
    raw = gpt_oss.chat(MESSAGES, params, chat_template=TEMPLATE)[0].text
    thought = raw.split("<|message|>")[1].removesuffix("<|end|><|start|>assistant<|channel|>final")
    answer = raw.rpartition("<|message|>")[2]
    with serve(gpt_oss, reasoning_parser="openai_gptoss", chat_template=TEMPLATE) as (url, _):
        oa = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        ask = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=60)
        message = oa.chat.completions.create(**ask, extra_body=CONSTRAINED).choices[0].message
        assert (message.model_dump()["reasoning_content"], message.content) == (thought, answer)
        stream = oa.chat.completions.create(**ask, stream=True, extra_body=CONSTRAINED)
        chunks = [c.choices[0].delta.model_dump() for c in stream if c.choices]
        assert "".join(c.get("reasoning_content") or "" for c in chunks) == thought
        assert "".join(c.get("content") or "" for c in chunks) == answer
    with serve(gpt_oss, chat_template=TEMPLATE) as (url, _):
        # Without the parser, the reply is decoded as usual: its special tokens dropped.
        oa = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        plain = oa.chat.completions.create(**ask, extra_body=CONSTRAINED).choices[0].message
        assert plain.content == f"analysis{thought}assistantfinal{answer}"


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
# An analysis message, then a call of get_weather in the commentary channel (its `<|call|>`
# end stands for the stop token it is in gpt-oss).
CALLING = (
    'start: <|channel|> "analysis" <|message|> /[a-z ]{4,12}/ <|end|> <|start|> "assistant" '
    '<|channel|> "commentary to=functions.get_weather " <|constrain|> "json" <|message|> '
    '"{\\"city\\": \\"" /[A-Z][a-z]{2,8}/ "\\"}" <|call|>'
)


def test_harmony_calls_are_tool_calls_with_the_openai_parser(gpt_oss):
    """`--tool-call-parser openai`: a message to `functions.get_weather` comes back as that
    tool call, whole and streamed, the analysis before it as the reasoning."""
    options = dict(reasoning_parser="openai_gptoss", tool_call_parser="openai")
    with serve(gpt_oss, chat_template=TEMPLATE, **options) as (url, _):
        oa = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        ask = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=200, tools=[WEATHER])
        grammar = {"structured_outputs": {"grammar": CALLING}}
        choice = oa.chat.completions.create(**ask, extra_body=grammar).choices[0]
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        assert list(json.loads(call.function.arguments)) == ["city"]
        assert choice.message.content is None and choice.finish_reason == "tool_calls"
        assert choice.message.model_dump()["reasoning_content"]
        stream = oa.chat.completions.create(**ask, stream=True, extra_body=grammar)
        arguments = "".join(
            delta.function.arguments or ""
            for chunk in stream
            if chunk.choices
            for delta in chunk.choices[0].delta.tool_calls or ()
        )
        assert arguments == call.function.arguments

"""Chat-template arguments of the Python API: `tools`, `chat_template_kwargs` and a template
of one's own reach the template, in `chat` and `prepare` alike."""

import pytest

from inflight import SamplingParams

MESSAGES = [{"role": "user", "content": "Hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{{ greeting }}{% endif %}"
)


def _rendered(llm, **template) -> str:
    ids = llm.prepare(MESSAGES, **template).prompt_token_ids
    return llm.tokenizer.decode(ids, skip_special_tokens=False)


def test_template_override_tools_and_kwargs_reach_the_template(llm):
    text = _rendered(
        llm, chat_template=TEMPLATE, tools=TOOLS, chat_template_kwargs={"greeting": "Hello!"}
    )
    assert text.endswith("<|im_start|>assistant\nHello!")
    assert '"name": "get_time"' in text
    # Without an override, the model's own template (which ignores tools) renders.
    assert _rendered(llm) == _rendered(llm, tools=TOOLS)
    assert "get_time" not in _rendered(llm, tools=TOOLS)


@pytest.mark.slow
def test_chat_with_a_template_generates_from_that_prompt(llm):
    params = SamplingParams(temperature=0, max_tokens=4)
    kwargs = {"greeting": "Sure,"}
    chat = llm.chat(MESSAGES, params, chat_template=TEMPLATE, chat_template_kwargs=kwargs)[0]
    prompt = llm.prepare(MESSAGES, chat_template=TEMPLATE, chat_template_kwargs=kwargs)
    same = llm.generate({"prompt_token_ids": list(prompt.prompt_token_ids)}, params)[0]
    assert chat.token_ids == same.token_ids
    assert chat.prompt_tokens == len(prompt.prompt_token_ids)


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda llm: llm.prepare(MESSAGES, chat_template_kwargs={"messages": []}), "messages"),
        (lambda llm: llm.prepare(MESSAGES, chat_template_kwargs={"tools": []}), "tools"),
        (lambda llm: llm.prepare("raw text", tools=TOOLS), "chat messages only"),
        (lambda llm: llm.prepare(MESSAGES, chat_template="{% if %}"), "chat template"),
        (
            lambda llm: llm.prepare(MESSAGES, chat_template="{{ raise_exception('no') }}"),
            "chat template: no",
        ),
    ],
)
def test_bad_template_arguments_raise_value_error(llm, call, needle):
    with pytest.raises(ValueError, match=needle):
        call(llm)

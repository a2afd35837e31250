"""Chat-template arguments of the Python API: `tools`, `chat_template_kwargs`, a template of
one's own and vLLM's `add_generation_prompt` / `continue_final_message` reach the template, in
`chat` and `prepare` alike."""

import pytest

from inflight import SamplingParams

MESSAGES = [{"role": "user", "content": "Hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{{ greeting }}{% endif %}"
)


def _rendered(llm, messages=MESSAGES, **template) -> str:
    ids = llm.prepare(messages, **template).prompt_token_ids
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


PREFILL = [*MESSAGES, {"role": "assistant", "content": 'Sure: {"greeting": "'}]
# Trims every message, and renders an assistant's turn without its end marker only last.
TRIMMING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}"
    "{% if not loop.last %}<|im_end|>\n{% endif %}{% endfor %}"
)


def test_the_final_message_is_continued_where_its_text_ends(llm):
    opened = _rendered(llm)  # the conversation, with the reply opened after it
    text = _rendered(
        llm, messages=PREFILL, add_generation_prompt=False, continue_final_message=True
    )
    assert text == opened + PREFILL[-1]["content"]
    # Without add_generation_prompt the turn is closed and none opened.
    closed = _rendered(llm, messages=PREFILL, add_generation_prompt=False)
    assert closed.startswith(text) and closed.rstrip().endswith("<|im_end|>")
    # A template that trims the message's text: the continued text is trimmed as it would be.
    spaced = [*MESSAGES, {"role": "assistant", "content": "Well, "}]
    trimmed = _rendered(
        llm,
        messages=spaced,
        chat_template=TRIMMING,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert trimmed.endswith("<|im_start|>assistant\nWell,")


@pytest.mark.slow
def test_chat_continuing_a_prefill_generates_from_that_prompt(llm):
    params = SamplingParams(temperature=0, max_tokens=12)
    options = {"add_generation_prompt": False, "continue_final_message": True}
    chat = llm.chat(PREFILL, params, **options)[0]
    prompt = llm.prepare(PREFILL, **options)
    same = llm.generate({"prompt_token_ids": list(prompt.prompt_token_ids)}, params)[0]
    assert chat.token_ids == same.token_ids and chat.text == same.text


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (
            lambda llm: llm.prepare(PREFILL, continue_final_message=True),
            "add_generation_prompt=False",
        ),
        (
            lambda llm: llm.prepare(
                PREFILL,
                chat_template="{% for m in messages %}{{ m.role }}{% endfor %}",
                add_generation_prompt=False,
                continue_final_message=True,
            ),
            "does not render the final message",
        ),
        (
            lambda llm: llm.prepare(
                [{"role": "user", "content": None}],
                add_generation_prompt=False,
                continue_final_message=True,
            ),
            "no text to continue",
        ),
        (
            lambda llm: llm.prepare(MESSAGES, chat_template_kwargs={"continue_final_message": 1}),
            "continue_final_message",
        ),
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

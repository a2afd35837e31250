"""Reasoning output over a real server started with `--reasoning-parser qwen3` and a chat
template that reads `enable_thinking` (from `chat_template_kwargs`) the way Qwen's do.

The embedded model does not think on its own; a constraint on the raw text makes it write the
tags, which also shows the parser reading what a constrained request generates."""

import anthropic
import httpx
import openai
import pytest

from inflight import SamplingParams

from server_harness import serve

pytestmark = pytest.mark.slow

MODEL = "test-model"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
# ChatML; with enable_thinking the prompt opens the reasoning (the model writes only
# "</think>"), with enable_thinking false it closes an empty one, unset it leaves both tags to
# the model.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined %}"
    "{% if enable_thinking %}<think>\n{% else %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}{% endif %}"
)
BOTH_TAGS = "<think>[a-z ]{4,16}</think>[A-Z][a-z ]{2,10}"


@pytest.fixture(scope="module")
def oa(server_llm):
    with serve(server_llm, reasoning_parser="qwen3", chat_template=TEMPLATE) as (url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _ask(oa, regex: str, **extra):
    return oa.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        max_tokens=40,
        extra_body={"structured_outputs": {"regex": regex}, **extra},
    ).choices[0]


def test_generated_think_tags_split_into_reasoning_and_content(oa, server_llm):
    choice = _ask(oa, BOTH_TAGS)
    message = choice.message.model_dump()
    reasoning, content = message["reasoning_content"], message["content"]
    assert reasoning and content and message["reasoning"] == reasoning
    assert "<think>" not in content + reasoning and "</think>" not in content + reasoning
    # Exactly the generated text, split at the tags.
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"regex": BOTH_TAGS})
    raw = server_llm.chat(MESSAGES, params, chat_template=TEMPLATE)[0].text
    thought, answer = raw.removeprefix("<think>").split("</think>")
    assert (reasoning, content) == (thought.strip(), answer.lstrip())
    stream = oa.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        max_tokens=40,
        stream=True,
        extra_body={"structured_outputs": {"regex": BOTH_TAGS}},
    )
    chunks = [c.choices[0].delta.model_dump() for c in stream if c.choices]
    assert "".join(c.get("reasoning_content") or "" for c in chunks) == reasoning
    assert "".join(c.get("reasoning") or "" for c in chunks) == reasoning
    assert "".join(c.get("content") or "" for c in chunks) == content


def test_a_prompt_that_opens_the_reasoning_needs_only_the_close_tag(oa):
    choice = _ask(
        oa, "[a-z ]{4,16}</think>[A-Z][a-z ]{2,10}", chat_template_kwargs={"enable_thinking": True}
    )
    message = choice.message.model_dump()
    assert message["reasoning_content"] and message["content"]
    assert "</think>" not in message["reasoning_content"] + message["content"]


def test_thinking_off_and_a_cut_off_thought(oa):
    off = _ask(oa, "[A-Z][a-z ]{2,10}", chat_template_kwargs={"enable_thinking": False})
    assert off.message.model_dump()["reasoning_content"] is None and off.message.content
    # Cut off by max_tokens before "</think>": all of it is reasoning.
    cut = oa.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        max_tokens=6,
        extra_body={"structured_outputs": {"regex": "<think>[a-z ]{30,60}</think>ok"}},
    ).choices[0]
    assert cut.finish_reason == "length" and cut.message.content is None
    assert cut.message.model_dump()["reasoning_content"]


def test_reasoning_effort_and_anthropic_thinking_set_the_templates_switch(oa, server_llm):
    def prompt_tokens(**extra):
        return oa.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=1, **extra
        ).usage.prompt_tokens

    on = prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    off = prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert on != off
    assert prompt_tokens(reasoning_effort="high") == on
    assert prompt_tokens(reasoning_effort="none") == off
    # chat_template_kwargs, the more specific, wins over the effort.
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    assert prompt_tokens(reasoning_effort="high", extra_body=kwargs) == off
    # Ollama's `think`, as Open WebUI sends it: the same switch, under reasoning_effort.
    assert prompt_tokens(extra_body={"think": True}) == on
    assert prompt_tokens(extra_body={"think": False}) == off
    assert prompt_tokens(extra_body={"think": "high"}) == on
    both = oa.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=1, reasoning_effort="none",
        extra_body={"think": True},
    )  # fmt: skip
    assert both.parse().usage.prompt_tokens == off
    assert both.http_response.headers["x-inflight-ignored-fields"] == "think"
    url = str(oa.base_url).removesuffix("/v1/")
    counted = {
        kind: httpx.post(
            url + "/v1/messages/count_tokens",
            json={"model": MODEL, "messages": MESSAGES, "thinking": {"type": kind}},
        ).json()["input_tokens"]
        for kind in ("enabled", "disabled")
    }
    assert counted["enabled"] == on and counted["disabled"] == off


def test_anthropic_thinking_blocks_are_signed_alike_whole_and_streamed(oa):
    """A thought cut by max_tokens: the reply is its thinking block alone (no empty text block
    beside it, which Anthropic's API would refuse sent back), signed; the stream gives the same
    block, its signature in a `signature_delta` before the block ends, as Anthropic's do (the AI
    SDK sends a streamed thinking block back only with one)."""
    url = str(oa.base_url).removesuffix("/v1/")
    claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    ask = dict(
        model=MODEL,
        max_tokens=8,
        messages=MESSAGES,
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={"temperature": 0},
    )
    whole = claude.messages.create(**ask)
    (block,) = whole.content
    assert block.type == "thinking" and block.thinking and block.signature
    with claude.messages.stream(**ask) as stream:
        events = [e.type for e in stream]
        streamed = stream.get_final_message()
    assert [(b.type, b.thinking, b.signature) for b in streamed.content] == [
        ("thinking", block.thinking, block.signature)
    ]
    assert events.index("signature") < events.index("content_block_stop")

"""gpt-oss's harmony replies over a real server started with `--reasoning-parser openai_gptoss`:
a tiny random gpt-oss whose tokenizer has harmony's special tokens, a chat template that
renders harmony, and a grammar that makes the model write an analysis and a final message
with those tokens. The parser needs the markers, which decoding would drop as special tokens:
the server keeps them for it, and leaves none in what it returns."""

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
    with LLM(path, quantization="none", max_batch_size=4, max_model_len=256) as llm:
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

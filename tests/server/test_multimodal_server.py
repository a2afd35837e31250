"""Images over HTTP (tiny random LLaVA, in-flight batching): an `image_url` data URL through the
openai client and a base64 `image` block through the anthropic client give the reply `LLM.chat`
gives for the same image; the model lists its input modalities; the encoder counters show in
/health and /metrics; bad images are a 400 naming where they were."""

import base64
import io

import anthropic
import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from inflight import LLM, SamplingParams
from inflight.server.chat_templates import HERMES_TEMPLATE

from server_harness import serve
from tiny_models import IMAGE_TOKEN_ID

# A template that renders image parts (as the chat templates of LLaVA checkpoints do).
PARTS_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{% else %}"
    "{{ c['text'] }}{% endif %}{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}assistant:"
)


def picture(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (48, 40, 3), dtype=np.uint8))


def png_base64(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def setup(tiny_llava):
    path, _ = tiny_llava
    llm = LLM(
        path,
        enable_in_flight_batching=True,
        max_batch_size=4,
        max_model_len=256,
        limit_mm_per_prompt={"image": 2},
    )
    with serve(llm, name="llava") as (url, _):
        yield url, llm
    llm.close()


def _expected(llm, image, text="What is in the picture?", ignore_eos=True):
    messages = [
        {
            "role": "user",
            "content": [{"type": "image", "image": image}, {"type": "text", "text": text}],
        }
    ]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=ignore_eos)
    return llm.chat(messages, params)[0].outputs[0].text


def test_an_image_url_through_the_openai_client(setup):
    url, llm = setup
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    image = picture(0)
    reply = client.chat.completions.create(
        model="llava",
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "image_url",
                        "image_url": {"url": f"data:image/png;base64,{png_base64(image)}"},
                    },
                    {"type": "text", "text": "What is in the picture?"},
                ],
            }
        ],
        temperature=0,
        max_tokens=12,
        extra_body={"ignore_eos": True},
    )
    assert reply.choices[0].message.content == _expected(llm, image)
    # The image's 16 placeholder tokens count as prompt tokens.
    text_only = client.chat.completions.create(
        model="llava",
        messages=[{"role": "user", "content": "What is in the picture?"}],
        max_tokens=1,
    )
    assert reply.usage.prompt_tokens > text_only.usage.prompt_tokens + 16


def test_an_uploaded_image_by_file_id_on_the_responses_api(setup):
    url, llm = setup
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    image = picture(3)
    uploaded = client.files.create(
        file=("picture.png", base64.b64decode(png_base64(image))), purpose="user_data"
    )
    content = [
        {"type": "input_image", "file_id": uploaded.id},
        {"type": "input_text", "text": "What is in the picture?"},
    ]
    reply = client.responses.create(
        model="llava",
        input=[{"role": "user", "content": content}],
        temperature=0,
        max_output_tokens=12,
        extra_body={"ignore_eos": True},
    )
    assert reply.output_text == _expected(llm, image)
    client.files.delete(uploaded.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="llava", input=[{"role": "user", "content": content}])
    assert info.value.body["param"] == "input.0.content.0.file_id"


def test_a_template_that_renders_image_parts(setup):
    """A chat template that renders image parts puts the placeholder where the part is; one
    that renders text only gets it on a line before the message's text."""
    _, llm = setup
    content = [{"type": "text", "text": "Hi "}, {"type": "image", "image": picture(1)}]
    messages = [{"role": "user", "content": content}]
    tok = llm.tokenizer

    def expanded(text):
        ids = tok.encode(text, add_special_tokens=False)
        at = ids.index(IMAGE_TOKEN_ID)
        return ids[:at] + [IMAGE_TOKEN_ID] * 16 + ids[at + 1 :]

    parts = llm.prepare(messages, chat_template=PARTS_TEMPLATE)
    assert list(parts.prompt_token_ids) == expanded("user: Hi <image>\nassistant:")
    text = llm.prepare(messages)
    rendered = tok.apply_chat_template([{"role": "user", "content": "<image>\nHi "}])
    assert list(text.prompt_token_ids) == expanded(rendered)
    assert len(parts.media) == len(text.media) == 1


def test_an_image_block_through_the_anthropic_client(setup):
    url, llm = setup
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    image = picture(2)
    message = client.messages.create(
        model="llava",
        max_tokens=12,
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {
                            "type": "base64",
                            "media_type": "image/png",
                            "data": png_base64(image),
                        },
                    },
                    {"type": "text", "text": "What is in the picture?"},
                ],
            }
        ],
        extra_body={"temperature": 0},
    )
    assert message.content[0].text == _expected(llm, image, ignore_eos=False)


def test_modalities_and_encoder_counters_are_published(setup):
    url, llm = setup
    models = httpx.get(url + "/v1/models").json()["data"]
    assert models[0]["input_modalities"] == ["text", "image"]
    health = httpx.get(url + "/health").json()
    assert health["capabilities"]["input_modalities"] == ["text", "image"]
    encoder = health["encoder"]
    assert encoder == llm.get_encoder_metrics() and encoder["encoder_runs"] >= 1
    metrics = httpx.get(url + "/metrics").text
    assert f"inflight_encoder_runs_total {float(encoder['encoder_runs'])}" in metrics
    assert "inflight_encoder_cache_hits_total" in metrics


@pytest.mark.parametrize(
    "content, message",
    [
        (
            [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}}],
            "fetching image URLs is disabled",
        ),
        (
            [{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!"}}],
            "not valid base64",
        ),
        (
            [{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}],
            "cannot read the image",
        ),
        (
            [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}],
            "this model takes no audio input (it takes image)",
        ),
    ],
)
def test_bad_images_are_a_400_naming_the_part(setup, content, message):
    url, _ = setup
    reply = httpx.post(
        url + "/v1/chat/completions",
        json={"model": "llava", "messages": [{"role": "user", "content": content}]},
    )
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert message in error["message"]
    assert error["param"] == "messages.0.content.0"


def test_more_images_than_the_limit_is_a_400(setup):
    url, _ = setup
    part = {
        "type": "image_url",
        "image_url": {"url": f"data:image/png;base64,{png_base64(picture(3))}"},
    }
    reply = httpx.post(
        url + "/v1/chat/completions",
        json={"model": "llava", "messages": [{"role": "user", "content": [part] * 3}]},
    )
    assert reply.status_code == 400
    assert "the limit is 2" in reply.json()["error"]["message"]


def test_the_pruner_over_http(setup):
    """vLLM's `mm_processor_kwargs` on a chat: keep_ratio 0.5 drops 8 of the image's 16 tokens;
    a ratio outside (0, 1] is a 400 naming the field."""
    url, _ = setup
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    part = {
        "type": "image_url",
        "image_url": {"url": f"data:image/png;base64,{png_base64(picture(4))}"},
    }
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "What?"}]}]
    whole = client.chat.completions.create(model="llava", messages=messages, max_tokens=1)
    pruned = client.chat.completions.create(
        model="llava",
        messages=messages,
        max_tokens=1,
        extra_body={"mm_processor_kwargs": {"keep_ratio": 0.5}},
    )
    assert whole.usage.prompt_tokens == pruned.usage.prompt_tokens + 8
    reply = httpx.post(
        url + "/v1/chat/completions",
        json={
            "model": "llava",
            "messages": messages,
            "mm_processor_kwargs": {"keep_ratio": 1.5},
        },
    )
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "mm_processor_kwargs"


def test_an_image_a_tool_returned_on_the_anthropic_and_responses_apis(setup):
    """A tool result holding an image (Claude Code's Read of an image file; a Responses
    function_call_output with an input_image) is the tool message with the image where the
    result has it: the reply `LLM.chat` gives for that conversation."""
    url, llm = setup
    image = picture(3)
    question = "What did the camera see?"
    call = {"id": "call_1", "type": "function", "function": {"name": "camera", "arguments": {}}}
    messages = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "content": [
                {"type": "text", "text": "The picture:"},
                {"type": "image", "image": image},
            ],
        },
    ]
    params = SamplingParams(temperature=0, max_tokens=12)
    # The server renders a conversation with tools in its hermes template where the model's
    # reads no tools; that template joins content to strings, so the image goes on a line
    # before the result's text.
    hermes = HERMES_TEMPLATE.read_text()
    expected = llm.chat(messages, params, chat_template=hermes)[0].outputs[0].text
    prompt = llm.prepare(messages, chat_template=hermes).prompt_token_ids
    assert list(prompt).count(IMAGE_TOKEN_ID) == 16  # the image's tokens, in the tool's turn
    assert "<tool_response>\n\nThe picture:" in llm.tokenizer.decode(list(prompt))
    claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    source = {"type": "base64", "media_type": "image/png", "data": png_base64(image)}
    message = claude.messages.create(
        model="llava",
        max_tokens=12,
        messages=[
            {"role": "user", "content": question},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "call_1", "name": "camera", "input": {}}],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "call_1",
                        "content": [
                            {"type": "text", "text": "The picture:"},
                            {"type": "image", "source": source},
                        ],
                    }
                ],
            },
        ],
        extra_body={"temperature": 0},
    )
    assert message.content[0].text == expected
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    response = client.responses.create(
        model="llava",
        input=[
            {"role": "user", "content": question},
            {"type": "function_call", "call_id": "call_1", "name": "camera", "arguments": "{}"},
            {
                "type": "function_call_output",
                "call_id": "call_1",
                "output": [
                    {"type": "input_text", "text": "The picture:"},
                    {
                        "type": "input_image",
                        "image_url": f"data:image/png;base64,{png_base64(image)}",
                    },
                ],
            },
        ],
        temperature=0,
        max_output_tokens=12,
    )
    assert response.output_text == expected

"""A block-diffusion model over real HTTP, driven by the official `openai` client, on a tiny
random DiffusionGemma: chat and text completions with the denoising settings as extra body
fields give the library's output; a stream delivers a canvas at a time; a field that has no
meaning for block diffusion, or a bad setting, is a 400 naming it."""

from __future__ import annotations

import openai
import pytest

from inflight import LLM
from inflight.protocol.request import DiffusionParams, SamplingParams

from diffusion_reference import CANVAS, write_tiny_checkpoint
from server_harness import serve

MESSAGES = [{"role": "user", "content": "The quick brown fox"}]
SETTINGS = {"max_denoising_steps": 4, "t_min": 0.3, "t_max": 0.9, "entropy_bound": 0.5}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("diffusion_server")
    write_tiny_checkpoint(path)
    llm = LLM(str(path), enable_in_flight_batching=True, max_model_len=256)
    with serve(llm) as (url, _):
        yield url, llm
    llm.close()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def test_chat_is_the_library_chat(served):
    url, llm = served
    (want,) = llm.chat(
        MESSAGES,
        SamplingParams(max_tokens=2 * CANVAS, seed=5),
        diffusion=DiffusionParams(**SETTINGS),
    )
    reply = client(url).chat.completions.create(
        model="test-model",
        messages=MESSAGES,
        max_completion_tokens=2 * CANVAS,
        seed=5,
        extra_body=SETTINGS,
    )
    assert reply.choices[0].message.content == want.outputs[0].text
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 2 * CANVAS


def test_completions_round_max_tokens_up_to_canvases(served):
    url, llm = served
    (want,) = llm.generate("Hello there", SamplingParams(max_tokens=10, seed=3))
    reply = client(url).completions.create(
        model="test-model", prompt="Hello there", max_tokens=10, seed=3
    )
    assert reply.choices[0].text == want.outputs[0].text
    assert reply.usage.completion_tokens == 2 * CANVAS


def test_a_stream_delivers_a_canvas_at_a_time(served):
    url, llm = served
    (want,) = llm.generate(
        "Hello there",
        SamplingParams(max_tokens=3 * CANVAS, seed=8),
        diffusion=DiffusionParams(**SETTINGS),
    )
    stream = client(url).completions.create(
        model="test-model",
        prompt="Hello there",
        max_tokens=3 * CANVAS,
        seed=8,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=SETTINGS,
    )
    texts, usage = [], None
    for event in stream:
        if event.choices:
            texts.append(event.choices[0].text)
        usage = event.usage or usage
    assert "".join(texts) == want.outputs[0].text
    assert usage.completion_tokens == 3 * CANVAS
    assert len([t for t in texts if t]) <= 3  # one text delta a canvas at most


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"top_p": 0.5}, "top_p"),
        ({"top_k": 4}, "top_k"),
        ({"logprobs": True}, "logprobs"),
        ({"n": 2}, "n"),
        ({"t_min": -1.0}, "t_min"),
        ({"max_denoising_steps": 0}, "max_denoising_steps"),
        ({"t_min": 0.9, "t_max": 0.5}, "t_min"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_a_field_block_diffusion_cannot_take_is_a_400_naming_it(served, extra, param):
    url, _ = served
    with pytest.raises(openai.BadRequestError) as refused:
        client(url).chat.completions.create(
            model="test-model", messages=MESSAGES, max_completion_tokens=CANVAS, extra_body=extra
        )
    assert refused.value.body["param"] == param

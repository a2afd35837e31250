"""Audio and Qwen2-VL images over HTTP (tiny random Voxtral and Qwen2-VL, in-flight batching):
an `input_audio` WAV part through the openai client gives the reply `LLM.chat` gives for the
same samples, as does a Qwen2-VL image data URL; the model lists audio among its input
modalities; bad audio and media of a kind the model does not take are a 400 naming the part."""

import base64
import io
import json
import wave

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from inflight import LLM, SamplingParams

from server_harness import serve
from tiny_models import AUDIO_TOKEN_ID, make_tiny_qwen2_vl, make_tiny_voxtral

# A template that renders audio parts (as Voxtral's does) and image parts as Qwen2-VL's does.
PARTS_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'audio' %}[AUDIO]"
    "{% elif c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "assistant:"
)


def tone(seconds: float, seed: int) -> np.ndarray:
    t = np.arange(int(seconds * 16000)) / 16000
    return (0.4 * np.sin(2 * np.pi * (220 + 110 * seed) * t)).astype(np.float32)


def wav_base64(samples: np.ndarray) -> str:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(16000)
        f.writeframes((samples * 32767).round().astype("<i2").tobytes())
    return base64.b64encode(buffer.getvalue()).decode()


def serving(path, name):
    """The model at `path`, its chat template the one above, and a server for it."""
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = PARTS_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    llm = LLM(path, enable_in_flight_batching=True, max_batch_size=4, max_model_len=256)
    return llm, serve(llm, name=name)


@pytest.fixture(scope="module")
def voxtral(tmp_path_factory):
    path = tmp_path_factory.mktemp("voxtral_server")
    make_tiny_voxtral(path)
    llm, server = serving(path, "voxtral")
    with server as (url, _):
        yield url, llm
    llm.close()


def _chat(llm, part, text="What is said?"):
    messages = [{"role": "user", "content": [part, {"type": "text", "text": text}]}]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return llm.chat(messages, params)[0].outputs[0].text


def test_an_input_audio_part_through_the_openai_client(voxtral):
    url, llm = voxtral
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    # 16-bit WAV holds the samples rounded to 1/32767: compare with those.
    samples = (tone(1.3, 0) * 32767).round() / 32767
    reply = client.chat.completions.create(
        model="voxtral",
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "input_audio",
                        "input_audio": {"data": wav_base64(samples), "format": "wav"},
                    },
                    {"type": "text", "text": "What is said?"},
                ],
            }
        ],
        temperature=0,
        max_tokens=12,
        extra_body={"ignore_eos": True},
    )
    assert reply.choices[0].message.content == _chat(llm, {"type": "audio", "audio": samples})
    # Two windows of 8 tokens each count as prompt tokens.
    content = [{"type": "audio", "audio": samples}, {"type": "text", "text": "What is said?"}]
    request = llm.prepare([{"role": "user", "content": content}])
    assert list(request.prompt_token_ids).count(AUDIO_TOKEN_ID) == 16
    assert reply.usage.prompt_tokens == len(request.prompt_token_ids)


def test_audio_is_listed_and_bad_audio_is_a_400_naming_the_part(voxtral):
    url, _ = voxtral
    models = httpx.get(url + "/v1/models").json()["data"]
    assert models[0]["input_modalities"] == ["text", "audio"]
    cases = [
        ({"type": "input_audio", "input_audio": {"data": "aGVsbG8=", "format": "wav"}}, "cannot"),
        ({"type": "input_audio", "input_audio": {"data": "aGVsbG8=", "format": "mp3"}}, "'mp3'"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,aGk="}}, "no image"),
    ]
    for part, message in cases:
        reply = httpx.post(
            url + "/v1/chat/completions",
            json={"model": "voxtral", "messages": [{"role": "user", "content": [part]}]},
        )
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert message in error["message"] and error["param"] == "messages.0.content.0"


def test_a_qwen2_vl_image_through_the_openai_client(tmp_path):
    make_tiny_qwen2_vl(tmp_path)
    llm, server = serving(tmp_path, "qwen2-vl")
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (40, 56, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url_data = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    try:
        with server as (url, _):
            client = openai.OpenAI(base_url=url + "/v1", api_key="x")
            reply = client.chat.completions.create(
                model="qwen2-vl",
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": url_data}},
                            {"type": "text", "text": "What is in the picture?"},
                        ],
                    }
                ],
                temperature=0,
                max_tokens=12,
                extra_body={"ignore_eos": True},
            )
        want = _chat(llm, {"type": "image", "image": image}, "What is in the picture?")
        assert reply.choices[0].message.content == want
    finally:
        llm.close()


def test_the_python_api_takes_audio_within_its_limits(voxtral):
    _, llm = voxtral
    samples = tone(0.9, 1)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = [1, 40, AUDIO_TOKEN_ID, 41]
    at_8k = llm.generate(
        {"prompt_token_ids": prompt, "multi_modal_data": {"audio": (samples[::2], 8000)}}, params
    )[0]
    assert len(at_8k.outputs[0].token_ids) == 6
    long = (np.zeros(601 * 8000, np.float32), 8000)
    with pytest.raises(ValueError, match="audio clip is 601.0 s; the limit is 600 s"):
        llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"audio": long}}, params)
    with pytest.raises(ValueError, match="5 audios in one prompt; the limit is 4"):
        llm.generate(
            {"prompt_token_ids": prompt, "multi_modal_data": {"audio": [samples] * 5}}, params
        )

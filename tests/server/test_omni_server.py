"""Spoken chat replies over real HTTP, driven by the official `openai` client, on a tiny random
Qwen3-Omni: `modalities=["text", "audio"]` returns the reply's WAV or PCM (the library's audio)
with its transcript, whole and streamed; an audio id sent back in a later turn; a 400 naming the
field for every bad ask."""

from __future__ import annotations

import base64
import io
import wave

import numpy as np
import openai
import pytest

from inflight import LLM
from inflight.protocol.request import AudioReply, SamplingParams

from omni_reference import write_tiny_checkpoint
from server_harness import serve

MESSAGES = [{"role": "user", "content": "The quick brown fox"}]
GREEDY_AUDIO = {"temperature": 0, "max_frames": 20}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("omni_server")
    write_tiny_checkpoint(path)
    llm = LLM(str(path), enable_in_flight_batching=True, max_model_len=256)
    with serve(llm) as (url, _):
        yield url, llm
    llm.close()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def ask(url: str, fmt: str = "wav", **extra):
    return client(url).chat.completions.create(
        model="test-model",
        messages=extra.pop("messages", MESSAGES),
        modalities=["text", "audio"],
        audio={"voice": "Ethan", "format": fmt, **GREEDY_AUDIO},
        max_completion_tokens=8,
        temperature=0,
        **extra,
    )


def read_wav(data: bytes) -> np.ndarray:
    with wave.open(io.BytesIO(data)) as f:
        assert (f.getnchannels(), f.getsampwidth(), f.getframerate()) == (1, 2, 24000)
        return np.frombuffer(f.readframes(f.getnframes()), "<i2")


def library_reply(llm: LLM):
    (output,) = llm.chat(
        MESSAGES,
        SamplingParams(max_tokens=8, temperature=0),
        audio=AudioReply("ethan", **GREEDY_AUDIO),
    )
    samples = np.frombuffer(output.outputs[0].audio, np.float32)
    return output.outputs[0].text, (np.clip(samples, -1, 1) * 32767).round().astype("<i2")


def test_a_spoken_reply_is_the_library_reply_as_wav_and_pcm(served):
    url, llm = served
    text, samples = library_reply(llm)
    assert samples.size > 0
    reply = ask(url)
    message = reply.choices[0].message
    assert message.content is None
    assert message.audio.transcript == text
    assert message.audio.id.startswith("audio_") and message.audio.expires_at > 0
    assert np.array_equal(read_wav(base64.b64decode(message.audio.data)), samples)
    frames = -(-samples.size // 1920)
    assert reply.usage.completion_tokens_details.audio_tokens == frames
    pcm = ask(url, "pcm16").choices[0].message.audio
    assert np.array_equal(np.frombuffer(base64.b64decode(pcm.data), "<i2"), samples)


def test_a_streamed_reply_is_the_whole_reply(served):
    url, llm = served
    text, samples = library_reply(llm)
    stream = ask(url, stream=True, stream_options={"include_usage": True})
    data, transcript, last, usage = bytearray(), [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        assert not delta.content
        audio = delta.audio
        if audio is None:
            continue
        if audio.data:
            data += base64.b64decode(audio.data)
        if audio.transcript:
            transcript.append(audio.transcript)
        if audio.id:
            last = audio
    assert "".join(transcript) == text
    assert np.array_equal(read_wav(bytes(data)), samples)
    assert last is not None and last.expires_at > 0
    assert usage.completion_tokens_details.audio_tokens == -(-samples.size // 1920)


def test_a_later_turn_sends_the_audio_back_by_id(served):
    url, llm = served
    first = ask(url).choices[0].message
    history = [
        *MESSAGES,
        {"role": "assistant", "audio": {"id": first.audio.id}},
        {"role": "user", "content": "and then?"},
    ]
    follow = ask(url, messages=history).choices[0].message
    expected = (
        ask(
            url,
            messages=[
                *MESSAGES,
                {"role": "assistant", "content": first.audio.transcript},
                history[2],
            ],
        )
        .choices[0]
        .message
    )
    assert follow.audio.transcript == expected.audio.transcript
    with pytest.raises(openai.BadRequestError) as refused:
        ask(url, messages=[*MESSAGES, {"role": "assistant", "audio": {"id": "audio_gone"}}])
    assert refused.value.body["param"] == "messages.1.audio.id"


@pytest.mark.parametrize(
    "change, param",
    [
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio.voice"),
        ({"audio": {"voice": "ethan", "format": "mp3"}}, "audio.format"),
        ({"audio": {"voice": "ethan", "format": "wav", "speed": 2}}, "audio"),
        ({"audio": {"voice": "ethan", "format": "wav", "max_frames": 0}}, "audio.max_frames"),
        ({"modalities": ["audio"]}, "modalities"),
        ({"audio": None}, "audio"),
        ({"logprobs": True}, "logprobs"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
            "tools",
        ),
        ({"n": 2}, "n"),
    ],
)
def test_a_bad_ask_is_a_400_naming_the_field(served, change, param):
    url, _ = served
    body = {
        "model": "test-model",
        "messages": MESSAGES,
        "modalities": ["text", "audio"],
        "audio": {"voice": "ethan", "format": "wav"},
        "max_completion_tokens": 4,
        **change,
    }
    if body["audio"] is None:
        del body["audio"]
    with pytest.raises(openai.BadRequestError) as refused:
        client(url).chat.completions.create(**body)
    assert refused.value.body["param"] == param


def test_text_replies_and_the_models_list_on_a_model_that_speaks(served):
    url, _ = served
    reply = client(url).chat.completions.create(
        model="test-model", messages=MESSAGES, max_completion_tokens=4, temperature=0
    )
    assert reply.choices[0].message.content is not None and reply.choices[0].message.audio is None
    (model,) = client(url).models.list().data
    assert model.model_extra["output_modalities"] == ["text", "audio"]
    with pytest.raises(openai.BadRequestError) as refused:
        client(url).chat.completions.create(
            model="test-model", messages=MESSAGES, audio={"voice": "ethan", "format": "wav"}
        )
    assert refused.value.body["param"] == "modalities"


def test_the_speech_api_reads_the_input_aloud(served):
    """POST /v1/audio/speech on a model that speaks: the input read as its reply (the thinker
    writes nothing), the library's audio; what only a text-to-speech model takes, a 400."""
    url, llm = served
    params = SamplingParams(temperature=0, max_tokens=15)
    whole = llm.speech("The quick brown fox", params, voice="chelsie")
    assert whole.codes and whole.finish_reason in ("stop", "length")
    expected = (np.clip(np.frombuffer(whole.audio, np.float32), -1, 1) * 32767).round()
    speech = client(url).audio.speech.create(
        model="test-model",
        voice="chelsie",
        input="The quick brown fox",
        response_format="wav",
        extra_body={"temperature": 0, "max_new_tokens": 15},
    )
    assert np.array_equal(read_wav(speech.content), expected.astype("<i2"))
    voices = client(url).get("/audio/voices", cast_to=object)
    assert voices["voices"] == ["chelsie", "ethan"] and voices["task_type"] is None
    with pytest.raises(openai.BadRequestError) as refused:
        client(url).audio.speech.create(
            model="test-model", voice="ethan", input="hi", extra_body={"language": "english"}
        )
    assert refused.value.body["param"] == "language"


def test_the_anthropic_api_answers_text_and_refuses_audio(served):
    import anthropic

    url, _ = served
    claude = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    reply = claude.messages.create(
        model="test-model", max_tokens=4, messages=[{"role": "user", "content": "Hello"}]
    )
    assert reply.content[0].type == "text"
    with pytest.raises(anthropic.BadRequestError, match="modalities"):
        claude.messages.create(
            model="test-model",
            max_tokens=4,
            messages=[{"role": "user", "content": "Hello"}],
            extra_body={"modalities": ["text", "audio"], "audio": {"voice": "ethan"}},
        )

"""The OpenAI speech API over real HTTP, driven by the official `openai` client, on tiny random
Qwen3-TTS models: WAV and PCM whole and streamed, server-sent events, voices, clones, and a 400
naming the field for every bad request."""

from __future__ import annotations

import base64
import io
import json
import wave

import httpx
import numpy as np
import openai
import pytest

from inflight import LLM

from server_harness import serve
from speech_reference import write_tiny_checkpoint

TEXT = "Hello world, this is a test."
FRAME = 1920  # samples a frame


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """kind -> (base URL, the LLM), a custom-voice and a base model."""
    root = tmp_path_factory.mktemp("tts_server")
    opened, urls = [], {}
    contexts = []
    for kind in ("custom_voice", "base"):
        write_tiny_checkpoint(root / kind, kind, seed=1)
        llm = LLM(str(root / kind), enable_in_flight_batching=True, max_model_len=256)
        opened.append(llm)
        context = serve(llm)
        url, _ = context.__enter__()
        contexts.append(context)
        urls[kind] = (url, llm)
    yield urls
    for context in contexts:
        context.__exit__(None, None, None)
    for llm in opened:
        llm.close()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


GREEDY = {"temperature": 0, "subtalker_dosample": False, "max_new_tokens": 12}


def read_wav(data: bytes) -> np.ndarray:
    with wave.open(io.BytesIO(data)) as f:
        assert (f.getnchannels(), f.getsampwidth(), f.getframerate()) == (1, 2, 24000)
        return np.frombuffer(f.readframes(f.getnframes()), "<i2")


def test_speech_create_returns_a_wav_and_pcm_of_the_library_audio(servers):
    url, llm = servers["custom_voice"]
    speech = client(url).audio.speech.create(
        model="test-model", voice="vivian", input=TEXT, response_format="wav", extra_body=GREEDY
    )
    samples = read_wav(speech.content)
    assert samples.shape == (12 * FRAME,)
    pcm = client(url).audio.speech.create(
        model="test-model", voice="Vivian", input=TEXT, response_format="pcm", extra_body=GREEDY
    )
    assert np.array_equal(np.frombuffer(pcm.content, "<i2"), samples)
    from inflight.protocol.request import SamplingParams

    params = SamplingParams(temperature=0, repetition_penalty=1.05, max_tokens=12)
    whole = llm.speech(TEXT, params, voice="vivian", subtalker_sample=False)
    expected = np.clip(np.frombuffer(whole.audio, np.float32), -1, 1) * 32767
    assert np.array_equal(samples, expected.round().astype("<i2"))


def test_streamed_audio_is_the_whole_audio(servers):
    url, _ = servers["custom_voice"]
    whole = client(url).audio.speech.create(
        model="test-model", voice="vivian", input=TEXT, response_format="pcm", extra_body=GREEDY
    )
    parts = []
    with client(url).audio.speech.with_streaming_response.create(
        model="test-model",
        voice="vivian",
        input=TEXT,
        response_format="wav",
        stream_format="audio",
        extra_body=GREEDY,
    ) as response:
        assert response.headers["content-type"].startswith("audio/wav")
        for part in response.iter_bytes():
            parts.append(part)
    streamed = b"".join(parts)
    assert streamed[:4] == b"RIFF" and streamed[36:40] == b"data"
    assert streamed[44:] == whole.content


def test_sse_events_parse_and_carry_the_audio_and_usage(servers):
    url, _ = servers["custom_voice"]
    whole = client(url).audio.speech.create(
        model="test-model", voice="vivian", input=TEXT, response_format="pcm", extra_body=GREEDY
    )
    body = {"input": TEXT, "voice": "vivian", "response_format": "pcm", "stream_format": "sse"}
    events = []
    with httpx.stream("POST", url + "/v1/audio/speech", json={**body, **GREEDY}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) > 1 and events[-1]["type"] == "speech.audio.done"
    assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == whole.content
    usage = events[-1]["usage"]
    assert usage["output_tokens"] == 12
    assert usage["total_tokens"] == usage["input_tokens"] + 12 and usage["input_tokens"] > 0


def test_vllm_omnis_stream_and_speaker_fields_give_the_same_events(servers):
    url, _ = servers["custom_voice"]
    streams = []
    for fields in (
        {"voice": "vivian", "stream_format": "sse"},
        {"speaker": "vivian", "stream": True},
    ):
        body = {"input": TEXT, "response_format": "pcm", **fields, **GREEDY}
        with httpx.stream("POST", url + "/v1/audio/speech", json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            streams.append([line for line in response.iter_lines() if line])
    assert streams[0] == streams[1]
    assert json.loads(streams[0][-1][6:])["type"] == "speech.audio.done"


def test_an_input_past_the_context_is_refused_by_name(servers):
    url, llm = servers["custom_voice"]
    response = httpx.post(
        url + "/v1/audio/speech", json={"input": "word " * 300, "voice": "vivian"}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "input" and "shorten the input" in error["message"]


def test_voices_and_models_report_speech(servers):
    url, _ = servers["custom_voice"]
    voices = httpx.get(url + "/v1/audio/voices").json()
    assert voices["voices"] == ["vivian", "dylan"] and voices["task_type"] == "CustomVoice"
    model = client(url).models.list().data[0]
    assert model.model_extra["output_modalities"] == ["audio"]
    health = httpx.get(url + "/health").json()["capabilities"]
    assert health["output_modalities"] == ["audio"] and health["speech"] is True


def test_a_clone_takes_a_base64_wav_and_ignores_openais_voice(servers):
    url, _ = servers["base"]
    clip = (0.1 * np.random.default_rng(0).standard_normal(24000) * 32767).astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as f:
        f.setnchannels(1), f.setsampwidth(2), f.setframerate(24000)
        f.writeframes(clip.tobytes())
    ref = "data:audio/wav;base64," + base64.b64encode(buffer.getvalue()).decode()
    response = client(url).audio.speech.with_raw_response.create(
        model="test-model",
        voice="alloy",
        input=TEXT,
        response_format="wav",
        extra_body={**GREEDY, "ref_audio": ref, "language": "english"},
    )
    assert response.headers["x-inflight-ignored-fields"] == "voice"
    assert len(read_wav(response.content)) % FRAME == 0


@pytest.mark.parametrize(
    "kind, body, param",
    [
        ("custom_voice", {"voice": "alloy"}, "voice"),
        ("custom_voice", {"voice": "vivian", "input": ""}, "input"),
        ("custom_voice", {"voice": "vivian", "input": "x" * 4097}, "input"),
        ("custom_voice", {"voice": "vivian", "response_format": "mp3"}, "response_format"),
        ("custom_voice", {"voice": "vivian", "speed": 1.5}, "speed"),
        ("custom_voice", {"voice": "vivian", "language": "klingon"}, "language"),
        ("custom_voice", {"voice": "vivian", "ref_audio": "AAAA"}, "ref_audio"),
        ("custom_voice", {"voice": "vivian", "task_type": "Base"}, "task_type"),
        ("custom_voice", {"voice": "vivian", "stream_format": "video"}, "stream_format"),
        ("custom_voice", {"voice": "vivian", "volume": 3}, "volume"),
        ("custom_voice", {"voice": "vivian", "max_new_tokens": 1000}, "max_new_tokens"),
        ("base", {"voice": "alloy"}, "ref_audio"),
        ("base", {"voice": "alloy", "ref_audio": "not base64!"}, "ref_audio"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(servers, kind, body, param):
    url, llm = servers[kind]
    response = httpx.post(url + "/v1/audio/speech", json={"input": TEXT, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert llm.kv_cache_usage()[0] == 0


def test_text_endpoints_point_at_the_speech_api(servers):
    url, _ = servers["custom_voice"]
    with pytest.raises(openai.BadRequestError, match="/v1/audio/speech"):
        client(url).chat.completions.create(
            model="test-model", messages=[{"role": "user", "content": "hi"}]
        )
    with pytest.raises(openai.BadRequestError, match="/v1/audio/speech"):
        client(url).completions.create(model="test-model", prompt="hi")

"""Reading images and audio for chat messages: data URLs, http(s) URLs from a real local server
(only where fetching is allowed), OpenAI's input_audio parts, and the size, pixel, length and
count limits, each refusal naming the part."""

import base64
import io
import re
import wave

import numpy as np
import pytest
from PIL import Image

from inflight.runtime.inputs.chat_media import (
    MediaInputError,
    MediaLimits,
    as_text,
    image_from_url,
    take_media,
)

from helpers import serving_files


def png(width=20, height=10) -> bytes:
    rng = np.random.default_rng(0)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def image_server():
    """A real HTTP server on loopback serving /cat.png (and a 404 for anything else)."""
    with serving_files({"/cat.png": ("image/png", png())}) as url:
        yield url


def test_a_data_url_is_read():
    image = image_from_url(data_url(png(20, 10)), MediaLimits())
    assert image.size == (20, 10)


def test_http_urls_are_fetched_only_where_allowed(image_server):
    with pytest.raises(MediaInputError, match="fetching image URLs is disabled"):
        image_from_url(image_server + "/cat.png", MediaLimits())
    allowed = MediaLimits(allow_fetch=True, fetch_timeout=5)
    assert image_from_url(image_server + "/cat.png", allowed).size == (20, 10)
    with pytest.raises(MediaInputError, match="cannot fetch the image"):
        image_from_url(image_server + "/missing.png", allowed)
    with pytest.raises(MediaInputError, match="over 100 bytes"):
        image_from_url(image_server + "/cat.png", MediaLimits(allow_fetch=True, max_bytes=100))


@pytest.mark.parametrize(
    "url, limits, message",
    [
        ("data:text/plain;base64,aGk=", MediaLimits(), "must be data:image"),
        ("data:image/png;base64,%%%", MediaLimits(), "not valid base64"),
        (data_url(b"not a png"), MediaLimits(), "cannot read the image"),
        (data_url(png(20, 10)), MediaLimits(max_pixels=100), "20x10 pixels; the limit is 100"),
        (data_url(png()), MediaLimits(max_bytes=10), "the limit is 10"),
        ("ftp://example.com/cat.png", MediaLimits(), "data: URL or an http(s) URL"),
    ],
)
def test_bad_images_are_refused_naming_why(url, limits, message):
    with pytest.raises(MediaInputError, match=re.escape(message)) as info:
        image_from_url(url, limits, "messages.0.content.1")
    assert info.value.field == "messages.0.content.1"


def test_images_are_taken_out_of_messages_in_order():
    first, second = Image.new("RGB", (4, 4)), Image.new("RGB", (6, 6))
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "image", "image": first},
                {"type": "text", "text": "and"},
                {"type": "image_url", "image_url": {"url": data_url(png())}},
            ],
        },
        {"role": "assistant", "content": "Two pictures."},
        {"role": "user", "content": [{"type": "image", "image": second}]},
    ]
    parts, media = take_media(messages, MediaLimits(), {"image"})
    images = media["image"]
    assert [image.size for image in images] == [(4, 4), (20, 10), (6, 6)]
    assert parts[1]["content"] == [
        {"type": "image"},
        {"type": "text", "text": "and"},
        {"type": "image"},
    ]
    assert parts[0] == messages[0] and parts[2] == messages[2]
    assert as_text(parts, {"image": "<image>"})[1]["content"] == "<image>\n<image>\nand"
    with pytest.raises(MediaInputError, match="3 images in one prompt; the limit is 2"):
        take_media(messages, MediaLimits(max_images=2), {"image"})
    with pytest.raises(MediaInputError, match="content of type 'file'") as info:
        take_media([{"role": "user", "content": [{"type": "file"}]}], MediaLimits(), {"image"})
    assert info.value.field == "messages.0.content.0"
    with pytest.raises(MediaInputError, match="takes no image input") as info:
        take_media(messages, MediaLimits(), {"audio"})
    assert info.value.field == "messages.1.content.0"


def wav(seconds: float, rate: int = 16000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    samples = (0.5 * np.sin(2 * np.pi * 440 * t) * 32767).astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(samples.tobytes())
    return buffer.getvalue()


def test_audio_parts_are_read_in_order():
    clip = np.zeros(800, np.float32)
    encoded = base64.b64encode(wav(0.25)).decode()
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "input_audio", "input_audio": {"data": encoded, "format": "wav"}},
                {"type": "text", "text": "and"},
                {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + encoded}},
                {"type": "audio", "audio": (clip, 8000)},
            ],
        }
    ]
    parts, media = take_media(messages, MediaLimits(), {"audio"})
    first, second, third = media["audio"]
    assert first.shape == second.shape == (4000,) and first.dtype == np.float32
    assert abs(float(first.max()) - 0.5) < 1e-3  # 16-bit PCM scaled to [-1, 1]
    assert third[1] == 8000  # resampled later, by the model's processor
    assert parts[0]["content"] == [
        {"type": "audio"},
        {"type": "text", "text": "and"},
        {"type": "audio"},
        {"type": "audio"},
    ]
    assert as_text(parts, {"audio": "[AUDIO]"})[0]["content"] == "[AUDIO]\n" * 3 + "and"
    with pytest.raises(MediaInputError, match="3 audios in one prompt; the limit is 1"):
        take_media(messages, MediaLimits(max_audios=1), {"audio"})


@pytest.mark.parametrize(
    "part, limits, message",
    [
        (
            {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "mp3"}},
            MediaLimits(),
            "input_audio.format 'mp3' is not supported; send WAV audio",
        ),
        (
            {"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}},
            MediaLimits(),
            "not valid base64",
        ),
        (
            {"type": "input_audio", "input_audio": {"data": "aGVsbG8=", "format": "wav"}},
            MediaLimits(),
            "cannot read the audio clip",
        ),
        (
            {
                "type": "input_audio",
                "input_audio": {"data": base64.b64encode(wav(2.0)).decode(), "format": "wav"},
            },
            MediaLimits(max_audio_seconds=1.5),
            "audio clip is 2.0 s; the limit is 1.5 s",
        ),
        (
            {"type": "audio_url", "audio_url": {"url": "http://127.0.0.1:9/a.wav"}},
            MediaLimits(),
            "fetching audio URLs is disabled",
        ),
        (
            {"type": "audio_url", "audio_url": {"url": data_url(png())}},
            MediaLimits(),
            "must be data:audio",
        ),
    ],
)
def test_bad_audio_is_refused_naming_the_part(part, limits, message):
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]
    with pytest.raises(MediaInputError, match=re.escape(message)) as info:
        take_media(messages, limits, {"audio"})
    assert info.value.field == "messages.0.content.1"

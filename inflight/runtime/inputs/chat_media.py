"""Images and audio in chat messages: reading them (data URLs, base64, and http(s) URLs where
fetching is allowed, within size, time and length limits) and taking them out of the messages
for the chat template.

Used by the Python API (`LLM.chat`) and the HTTP server. A message's content may be a list of
parts: `{"type": "text", "text": ...}`; images as `{"type": "image", "image": <PIL image>}` or
`{"type": "image_url", "image_url": {"url": ...}}` (OpenAI's shape); audio as
`{"type": "audio", "audio": <16 kHz samples, or (samples, sampling rate)>}`,
`{"type": "input_audio", "input_audio": {"data": <base64>, "format": "wav"}}` (OpenAI's
shape) or `{"type": "audio_url", "audio_url": {"url": ...}}` (vLLM's). Audio files are WAV.
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.error
import urllib.request
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from inflight.model.encoders.audio_processor import SAMPLE_RATE, read_wav
from inflight.protocol.request import MEDIA_FIELD, RequestFieldError


class MediaInputError(RequestFieldError):
    """An image or audio clip that cannot be used; `field` names where it came from."""

    def __init__(self, message: str, field: str = MEDIA_FIELD) -> None:
        super().__init__(message, field)


@dataclass(frozen=True)
class MediaLimits:
    """`max_images` and `max_audios` per prompt; images up to `max_pixels` pixels, audio clips
    up to `max_audio_seconds`, either up to `max_bytes` encoded; http(s) URLs fetched only
    when `allow_fetch`, within `fetch_timeout` seconds."""

    max_images: int = 4
    max_audios: int = 4
    max_pixels: int = 4096 * 4096
    max_audio_seconds: float = 600.0
    max_bytes: int = 20 << 20
    allow_fetch: bool = False
    fetch_timeout: float = 10.0

    def check_count(self, kind: str, count: int) -> None:
        """Refuse a prompt of more items of `kind` than its limit, before any is read."""
        limit = {"image": self.max_images, "audio": self.max_audios}.get(kind)
        if limit is not None and count > limit:
            raise MediaInputError(
                f"{count} {kind}s in one prompt; the limit is {limit} (--limit-mm-per-prompt)"
            )

    def check_audio(self, clip: Any, where: str = MEDIA_FIELD) -> None:
        """Refuse a clip (16 kHz samples, or (samples, sampling rate)) longer than
        `max_audio_seconds`."""
        samples, rate = clip if isinstance(clip, tuple) and len(clip) == 2 else (clip, SAMPLE_RATE)
        if not hasattr(samples, "__len__") or not isinstance(rate, int | float) or rate <= 0:
            return  # not a clip: the model's processor names what is wrong
        seconds = len(samples) / rate
        if seconds > self.max_audio_seconds:
            raise MediaInputError(
                f"audio clip is {seconds:.1f} s; the limit is {self.max_audio_seconds:g} s", where
            )


def decode_image(data: bytes, limits: MediaLimits, where: str = MEDIA_FIELD) -> Image.Image:
    """A PIL image of encoded bytes (PNG, JPEG, ...), fully read; MediaInputError otherwise."""
    if len(data) > limits.max_bytes:
        raise MediaInputError(f"image is {len(data)} bytes; the limit is {limits.max_bytes}", where)
    try:
        image = Image.open(io.BytesIO(data))
        if image.width * image.height > limits.max_pixels:
            raise MediaInputError(
                f"image is {image.width}x{image.height} pixels; the limit is "
                f"{limits.max_pixels} pixels",
                where,
            )
        image.load()
    except MediaInputError:
        raise
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise MediaInputError(f"cannot read the image: {exc}", where) from exc
    return image


def decode_audio(data: bytes, limits: MediaLimits, where: str = MEDIA_FIELD) -> np.ndarray:
    """The 16 kHz mono samples of a WAV file's bytes; MediaInputError otherwise."""
    if len(data) > limits.max_bytes:
        raise MediaInputError(
            f"audio clip is {len(data)} bytes; the limit is {limits.max_bytes}", where
        )
    try:
        samples = read_wav(data)
    except ValueError as exc:
        raise MediaInputError(f"cannot read the audio clip: {exc}", where) from exc
    limits.check_audio(samples, where)
    return samples


def _from_url(url: str, kind: str, limits: MediaLimits, where: str) -> bytes:
    """The bytes at a `data:<kind>/...;base64,` URL, or at an http(s) URL when fetching is
    allowed."""
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64") or not header[5:].startswith(f"{kind}/"):
            raise MediaInputError(
                f"an {kind} data URL must be data:{kind}/<type>;base64,...", where
            )
        return _base64(payload, kind, where)
    if url.startswith(("http://", "https://")):
        if not limits.allow_fetch:
            raise MediaInputError(
                f"fetching {kind} URLs is disabled on this server (start it with "
                f"--allow-media-fetch); send the {kind} as a data URL",
                where,
            )
        return _fetch(url, kind, limits, where)
    raise MediaInputError(f"an {kind} URL must be a data: URL or an http(s) URL", where)


def _base64(payload: str, kind: str, where: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaInputError(f"the {kind} data is not valid base64: {exc}", where) from exc


def image_from_url(url: str, limits: MediaLimits, where: str = MEDIA_FIELD) -> Image.Image:
    """The image at a `data:image/...;base64,` URL, or at an http(s) URL when fetching is
    allowed."""
    return decode_image(_from_url(url, "image", limits, where), limits, where)


def _fetch(url: str, kind: str, limits: MediaLimits, where: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=limits.fetch_timeout) as reply:
            data = reply.read(limits.max_bytes + 1)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise MediaInputError(f"cannot fetch the {kind} at {url}: {exc}", where) from exc
    if len(data) > limits.max_bytes:
        raise MediaInputError(f"the {kind} at {url} is over {limits.max_bytes} bytes", where)
    return data


# Content part types, by the kind of media they carry.
_PART_KINDS = {
    "image": "image",
    "image_url": "image",
    "audio": "audio",
    "input_audio": "audio",
    "audio_url": "audio",
}


def _media_parts(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(kind, where) of each media part of a conversation, in order."""
    found = []
    for i, message in enumerate(messages):
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            kind = _PART_KINDS.get(part.get("type")) if isinstance(part, dict) else None
            if kind is not None:
                found.append((kind, f"messages.{i}.content.{j}"))
    return found


def take_media(
    messages: list[dict[str, Any]], limits: MediaLimits, taken: Collection[str]
) -> tuple[list[dict[str, Any]], dict[str, list[Any]]]:
    """The messages with each media part as `{"type": "image"}` or `{"type": "audio"}` (what
    chat templates of such models render as their placeholder), and the media by kind, in
    order. Media of a kind not `taken` (by the model) and too many of a kind are refused before
    any is read. Messages without media come back as they are."""
    found = _media_parts(messages)
    for kind, where in found:
        if kind not in taken:
            raise MediaInputError(
                f"this model takes no {kind} input (it takes {', '.join(taken) or 'text only'})",
                where,
            )
    for kind in {kind for kind, _ in found}:
        limits.check_count(kind, sum(1 for k, _ in found if k == kind))
    out: list[dict[str, Any]] = []
    media: dict[str, list[Any]] = {}
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            where = f"messages.{i}.content.{j}"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": part.get("text", "")})
                continue
            if kind not in _PART_KINDS:
                raise MediaInputError(f"content of type {kind!r} is not supported", where)
            media.setdefault(_PART_KINDS[kind], []).append(_read_part(part, kind, limits, where))
            parts.append({"type": _PART_KINDS[kind]})
        out.append({**message, "content": parts})
    return out, media


def _read_part(part: dict[str, Any], kind: str, limits: MediaLimits, where: str) -> Any:
    """The image (PIL) or audio clip (samples or (samples, rate)) a content part holds."""
    if kind == "image":
        image = part.get("image")
        if not isinstance(image, Image.Image):
            raise MediaInputError("an image part needs a PIL image in 'image'", where)
        return image
    if kind == "audio":
        clip = part.get("audio")
        if not isinstance(clip, np.ndarray | tuple):
            raise MediaInputError(
                "an audio part needs 16 kHz samples or (samples, sampling rate) in 'audio'", where
            )
        limits.check_audio(clip, where)
        return clip
    if kind == "input_audio":
        spec = part.get("input_audio")
        data = spec.get("data") if isinstance(spec, dict) else None
        form = spec.get("format", "wav") if isinstance(spec, dict) else None
        if not isinstance(data, str):
            raise MediaInputError("an input_audio part needs input_audio.data (base64)", where)
        if form != "wav":
            raise MediaInputError(
                f"input_audio.format {form!r} is not supported; send WAV audio ('wav')", where
            )
        return decode_audio(_base64(data, "audio", where), limits, where)
    spec = part.get(kind)
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str):
        raise MediaInputError(f"an {kind} part needs {kind}.url", where)
    if kind == "image_url":
        return image_from_url(url, limits, where)
    return decode_audio(_from_url(url, "audio", limits, where), limits, where)


def as_text(messages: list[dict[str, Any]], placeholders: dict[str, str]) -> list[dict[str, Any]]:
    """Content parts joined into text, each media part as its kind's placeholder on a line
    before the text (for chat templates that render string content only)."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            marks = "".join(f"{placeholders[p['type']]}\n" for p in content if p["type"] != "text")
            text = "".join(p["text"] for p in content if p["type"] == "text")
            content = marks + text
        out.append({**message, "content": content})
    return out

"""Images in chat messages: reading them (data URLs, base64, and http(s) URLs where fetching is
allowed, within size and time limits) and taking them out of the messages for the chat template.

Used by the Python API (`LLM.chat`) and the HTTP server. A message's content may be a list of
parts: `{"type": "text", "text": ...}`, `{"type": "image", "image": <PIL image>}` or
`{"type": "image_url", "image_url": {"url": ...}}` (OpenAI's shape).
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from PIL import Image

from inflight.runtime.media import MEDIA_FIELD
from inflight.runtime.request import RequestFieldError


class MediaInputError(RequestFieldError):
    """An image that cannot be used; `field` names where it came from."""

    def __init__(self, message: str, field: str = MEDIA_FIELD) -> None:
        super().__init__(message, field)


@dataclass(frozen=True)
class MediaLimits:
    """`max_images` per prompt; images up to `max_pixels` pixels and `max_bytes` encoded;
    http(s) URLs fetched only when `allow_fetch`, within `fetch_timeout` seconds."""

    max_images: int = 4
    max_pixels: int = 4096 * 4096
    max_bytes: int = 20 << 20
    allow_fetch: bool = False
    fetch_timeout: float = 10.0

    def check_count(self, kind: str, count: int) -> None:
        """Refuse a prompt of more than `max_images` items, before any is read."""
        if count > self.max_images:
            raise MediaInputError(
                f"{count} {kind}s in one prompt; the limit is {self.max_images} "
                "(--limit-mm-per-prompt)"
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


def image_from_url(url: str, limits: MediaLimits, where: str = MEDIA_FIELD) -> Image.Image:
    """The image at a `data:image/...;base64,` URL, or at an http(s) URL when fetching is
    allowed."""
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64") or not header[5:].startswith("image/"):
            raise MediaInputError("an image data URL must be data:image/<type>;base64,...", where)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise MediaInputError(f"the image data URL is not valid base64: {exc}", where) from exc
        return decode_image(data, limits, where)
    if url.startswith(("http://", "https://")):
        if not limits.allow_fetch:
            raise MediaInputError(
                "fetching image URLs is disabled on this server (start it with "
                "--allow-media-fetch); send the image as a data URL",
                where,
            )
        return decode_image(_fetch(url, limits, where), limits, where)
    raise MediaInputError("an image URL must be a data: URL or an http(s) URL", where)


def _fetch(url: str, limits: MediaLimits, where: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=limits.fetch_timeout) as reply:
            data = reply.read(limits.max_bytes + 1)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise MediaInputError(f"cannot fetch the image at {url}: {exc}", where) from exc
    if len(data) > limits.max_bytes:
        raise MediaInputError(f"the image at {url} is over {limits.max_bytes} bytes", where)
    return data


def count_images(messages: list[dict[str, Any]]) -> int:
    """The image parts of a conversation (none read yet)."""
    return sum(
        isinstance(part, dict) and part.get("type") in ("image", "image_url")
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
    )


def take_images(
    messages: list[dict[str, Any]], limits: MediaLimits
) -> tuple[list[dict[str, Any]], list[Image.Image]]:
    """The messages with each image part as `{"type": "image"}` (what chat templates of
    image models render as their placeholder), and the images in order (too many are refused
    before any is read). Messages without images come back as they are."""
    limits.check_count("image", count_images(messages))
    out, images = [], []
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
            if kind == "image":
                image = part.get("image")
                if not isinstance(image, Image.Image):
                    raise MediaInputError("an image part needs a PIL image in 'image'", where)
            elif kind == "image_url":
                spec = part.get("image_url")
                url = spec.get("url") if isinstance(spec, dict) else spec
                if not isinstance(url, str):
                    raise MediaInputError("an image_url part needs image_url.url", where)
                image = image_from_url(url, limits, where)
            else:
                raise MediaInputError(f"content of type {kind!r} is not supported", where)
            images.append(image)
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, images


def as_text(messages: list[dict[str, Any]], placeholder: str) -> list[dict[str, Any]]:
    """Content parts joined into text, each image as `placeholder` on a line before the text
    (for chat templates that render string content only)."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            images = sum(1 for p in content if p["type"] == "image")
            text = "".join(p["text"] for p in content if p["type"] == "text")
            content = f"{placeholder}\n" * images + text
        out.append({**message, "content": content})
    return out

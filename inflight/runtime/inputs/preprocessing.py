"""From the media a caller hands in (PIL images, audio samples) to the items a request carries,
as the model's processors prepare them: one `MediaInput` per kind the model takes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from inflight.model.audio_processor import SAMPLE_RATE, AudioProcessor, resample
from inflight.model.config import ModelConfig, VisionConfig
from inflight.model.image_processor import ImageProcessor
from inflight.model.qwen2_vl_processor import Qwen2VLImageProcessor
from inflight.runtime.host.media import MediaSpec, PreparedItem, content_key


@dataclass(frozen=True)
class MediaInput:
    """How the model takes one kind of media: its placeholder, and the preparation of an item
    (a ValueError or OSError where the item cannot be read)."""

    spec: MediaSpec
    prepare: Callable[[Any], PreparedItem]


def media_inputs(config: ModelConfig, processor_config: dict[str, Any]) -> dict[str, MediaInput]:
    """The kinds of media a model of `config` takes, with its checkpoint's
    `preprocessor_config.json` (empty: the encoders' usual preprocessing)."""
    found: dict[str, MediaInput] = {}
    vision = config.vision
    if isinstance(vision, VisionConfig):
        pixels = ImageProcessor.from_config(processor_config, vision)
        tokens = vision.tokens_per_image

        def prepare_image(image: Any) -> PreparedItem:
            data = pixels(image)
            return PreparedItem(data, tokens, content_key("image", data))

        found["image"] = MediaInput(MediaSpec("image", vision.image_token_id), prepare_image)
    elif vision is not None:
        patches = Qwen2VLImageProcessor.from_config(processor_config, vision)
        merge = vision.spatial_merge_size

        def prepare_grid(image: Any) -> PreparedItem:
            data, (t, h, w) = patches(image)
            grid = (t, h // merge, w // merge)
            key = content_key("image", data, f"{t}x{h}x{w}")
            return PreparedItem((data, (t, h, w)), t * h * w // merge**2, key, grid)

        found["image"] = MediaInput(MediaSpec("image", vision.image_token_id), prepare_grid)
    audio = config.audio
    if audio is not None:
        mel = AudioProcessor.from_config(processor_config, audio)
        per_window = audio.tokens_per_window

        def prepare_audio(clip: Any) -> PreparedItem:
            data = mel(_samples(clip))
            return PreparedItem(data, data.shape[0] * per_window, content_key("audio", data))

        found["audio"] = MediaInput(MediaSpec("audio", audio.audio_token_id), prepare_audio)
    return found


def _samples(clip: Any) -> np.ndarray:
    """Mono samples at 16 kHz from vLLM's audio forms: an array (16 kHz) or (array, rate)."""
    if isinstance(clip, tuple):
        if len(clip) != 2:
            raise ValueError("an audio clip is an array of samples or (samples, sampling rate)")
        samples, rate = clip
        if isinstance(rate, bool) or not isinstance(rate, int) or rate <= 0:
            raise ValueError(
                f"an audio clip's sampling rate must be a positive integer, got {rate!r}"
            )
        samples = np.asarray(samples, np.float32)
        return samples if rate == SAMPLE_RATE else resample(samples, rate).astype(np.float32)
    if not isinstance(clip, np.ndarray | list):
        raise ValueError(
            f"an audio clip must be an array of 16 kHz samples or (samples, sampling rate), "
            f"got {type(clip).__name__}"
        )
    return np.asarray(clip, np.float32)

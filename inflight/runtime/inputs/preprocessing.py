"""From the media a caller hands in (PIL images, audio samples) to the items a request carries,
as the model's processors prepare them: one `MediaInput` per kind the model takes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from inflight.model.config import ModelConfig
from inflight.model.encoders.base import PreparedItem
from inflight.runtime.host.media import MediaSpec


@dataclass(frozen=True)
class MediaInput:
    """How the model takes one kind of media: its placeholder, and the preparation of an item
    (a ValueError or OSError where the item cannot be read)."""

    spec: MediaSpec
    prepare: Callable[[Any], PreparedItem]


def media_inputs(config: ModelConfig, processor_config: dict[str, Any]) -> dict[str, MediaInput]:
    """The kinds of media a model of `config` takes, with its checkpoint's
    `preprocessor_config.json` (empty: the encoders' usual preprocessing)."""
    return {
        encoder.kind: MediaInput(
            MediaSpec(encoder.kind, encoder.placeholder, *encoder.bounds),
            encoder.preparer(processor_config),
        )
        for encoder in config.encoders
    }

"""What every media encoder's config offers, whichever encoder it is, and an item prepared for
an encoder (torch-free: the runtime's host half reads these)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class PreparedItem:
    """One item preprocessed for its encoder: `data` (what the encoder takes), the embeddings
    it yields for it, its content key, and (M-RoPE) its tokens' grid."""

    data: Any
    tokens: int
    key: bytes
    grid: tuple[int, int, int] | None = None


def content_key(kind: str, data: np.ndarray, extra: str = "") -> bytes:
    """What identifies an item's content: its preprocessed input, shape included (and `extra`,
    what else its encoder reads)."""
    h = hashlib.sha256(f"{kind}:{data.dtype}:{data.shape}:{extra}".encode())
    h.update(np.ascontiguousarray(data).tobytes())
    return h.digest()


# The bounds of an encoder whose items' placeholders stand alone.
Bounds = tuple[tuple[int, ...], tuple[int, ...]]
NO_BOUNDS: Bounds = ((), ())


class EncoderConfig(Protocol):
    """A media encoder's config, as the decoder and the input side take any encoder: the kind
    of media it encodes, the prompt token that stands for one item, and what it builds."""

    @property
    def kind(self) -> str:
        """ "image" or "audio"."""
        ...

    @property
    def placeholder(self) -> int:
        """The token that stands for one item in a prompt."""
        ...

    @property
    def bounds(self) -> Bounds:
        """The tokens before and after an item's placeholder tokens once its one placeholder
        is expanded (Gemma-4's begin- and end-of-image), where the chat template writes none."""
        ...

    def build(self, text_hidden: int) -> nn.Module:
        """The encoder module, for a decoder `text_hidden` wide: its `encode(items)` gives each
        prepared item's embeddings [tokens, text_hidden], its `load_weights(weights)` takes the
        checkpoint's Hugging Face-named tensors."""
        ...

    def preparer(self, processor_config: dict[str, Any]) -> Callable[[Any], PreparedItem]:
        """The preparation of one item (a PIL image, audio samples) as the checkpoint's
        `preprocessor_config.json` asks (empty: the encoder's usual preprocessing); it raises a
        ValueError or OSError where the item cannot be read."""
        ...

"""The model contract: one step's batch as a forward pass reads it, the caches it reads and
writes across steps, and what the runtime asks of every causal language model."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from inflight.model.attention import AttentionBackend
from inflight.model.config import ModelConfig
from inflight.model.layers.lora import LoRAMapping
from inflight.model.layers.lora_adapters import LoRAAdapters
from inflight.model.layers.mamba import MambaRows, MambaStates
from inflight.model.layers.rotary import Angles, RotaryEmbedding
from inflight.model.metadata import AttentionMetadata, KVCache


@dataclass
class MediaEmbeds:
    """Packed tokens whose input is an encoder's output (an image's or a clip's, in place of
    its placeholders) instead of their token's embedding."""

    indices: torch.Tensor  # [M] their packed indices
    # [M, hidden]; a DeepStack model's images [M, (1 + k) * hidden]: then the k features after
    # the embedding join the tokens' hidden states after the first k decoder layers.
    embeds: torch.Tensor
    # M-RoPE models: their 3-D positions [3, M] (the other tokens' three coordinates are equal,
    # their 1-D positions).
    mrope_positions: torch.Tensor | None = None
    # Keep their hidden states entering decoder layer `keep_layer` (after the ones before it,
    # less any DeepStack feature the last one adds) in `kept` [M, hidden]: what a talker reads
    # of a prompt's media.
    keep_layer: int | None = None
    kept: torch.Tensor | None = None

    def between_layers(self, hidden: int) -> BetweenLayers | None:
        """What the decoder does with these tokens between its layers, if anything: keep
        their hidden states, add DeepStack features."""
        deepstack = None
        if self.embeds.shape[-1] > hidden:
            deepstack = self.embeds[:, hidden:].reshape(self.embeds.shape[0], -1, hidden)
        if deepstack is None and self.keep_layer is None:
            return None

        def after(layer: int, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
            if self.keep_layer == layer + 1:
                self.kept = (x if residual is None else x + residual)[self.indices]
            # A layer's hidden state is x + residual: its DeepStack feature joins x.
            if deepstack is not None and 0 <= layer < deepstack.shape[1]:
                x = x.index_add(0, self.indices, deepstack[:, layer].to(x.dtype))
            return x

        return after


# Called with a decoder layer's index and its output (x, residual; the hidden state is their
# sum), and with -1 and the embeddings before the first: x as the next layer takes it.
BetweenLayers = Callable[[int, torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass
class ForwardBatch:
    """One step's packed tokens (a ragged batch: decode rows first, see `metadata.py`)
    and what the forward pass reads beside them. The optional parts are those of the features
    a step's rows use: each row's LoRA adapter, media embeddings in place of placeholder
    tokens, each row's recurrent state slot (hybrid models)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] rotary positions
    attention: AttentionMetadata
    lora: LoRAMapping | None = None
    media: MediaEmbeds | None = None
    recurrent: MambaRows | None = None

    def between_layers(self, hidden: int) -> BetweenLayers | None:
        """What its media ask of the decoder between layers (`MediaEmbeds.between_layers`)."""
        return None if self.media is None else self.media.between_layers(hidden)

    def embed(
        self, embed_tokens: torch.nn.Module, rotary: RotaryEmbedding
    ) -> tuple[torch.Tensor, Angles]:
        """The packed tokens' input embeddings [T, hidden] and rotary angles: the tokens'
        own, with media tokens taking their encoder's output (and, M-RoPE, their 3-D angles)."""
        x = embed_tokens(self.input_ids)
        angles = rotary.angles(self.positions, x.dtype)
        media = self.media
        if media is None:
            return x, angles
        x = x.index_copy(0, media.indices, media.embeds[:, : x.shape[-1]].to(x.dtype))
        if media.mrope_positions is not None:
            cos, sin = rotary.mrope_angles(media.mrope_positions, x.dtype)
            angles = (
                angles[0].index_copy(0, media.indices, cos),
                angles[1].index_copy(0, media.indices, sin),
            )
        return x, angles


@dataclass
class ModelCaches:
    """What a model's forward passes read and write from one step to the next: a (key, value)
    pair per attention layer in its attention backend's layout, and a hybrid's recurrent
    states (a slot per resident)."""

    kv: list[KVCache]
    backend: AttentionBackend
    states: MambaStates | None = None


class MediaEncoder(Protocol):
    def encode(self, items: list[object]) -> list[torch.Tensor]:
        """Each item's embeddings [tokens, hidden] (items as its processor prepared them)."""
        ...


class CausalLM(Protocol):
    """A causal language model as the runtime drives it. `config`: its shape; `max_loras`: its
    LoRA adapter slots (0: LoRA off); `lora`: those slots, which adapters it loads into and the
    mapping of a step's rows onto them."""

    config: ModelConfig
    max_loras: int
    lora: LoRAAdapters

    def __call__(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for every packed token."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    @property
    def num_attention_layers(self) -> int:
        """The (key, value) pairs its forward takes in `ModelCaches.kv`."""
        ...

    def allocate_states(
        self, num_slots: int, dtype: torch.dtype, device: torch.device
    ) -> MambaStates | None:
        """Zeroed recurrent state slots (None: the model keeps no state beside its KV)."""
        ...

    def media_encoders(self) -> dict[str, MediaEncoder]:
        """The encoder of each kind of media it takes (empty: text only)."""
        ...

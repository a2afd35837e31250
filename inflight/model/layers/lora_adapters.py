"""A model's LoRA adapters: `max_loras` slots in every linear layer of its decoder layers (see
`lora.py` for one layer's), which adapter each slot holds, and the mapping of a step's tokens
onto them.

An adapter names its factors by layer and by the Hugging Face module they adapt ("q_proj"); a
fused linear layer (q/k/v stacked as `qkv_proj`) takes its parts' factors in the order of its
`sources`, whose module names are those parts'.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from inflight.model.layers.linear import Linear
from inflight.model.layers.lora import INDEXED_MAX_TOKENS, LoRAMapping, LoRASlots
from inflight.model.layers.platform import Platform


@dataclass(frozen=True)
class LoRAAdapter:
    """A LoRA adapter's low-rank factors, their shapes checked against one base model's config:
    the targeted module `m` of layer `i` computes y += scale * (x A^T) B^T."""

    rank: int
    scale: float
    # (layer index, target module) -> (A [rank, in], B [out, rank]), in the stored dtype.
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


class LoRAAdapters:
    """`max_loras` adapter slots of ranks up to `max_rank` in every linear layer of `layers` (a
    model's decoder layers, in order), attached to them as their `lora_slots`; none (LoRA off,
    at no cost) for `max_loras` 0. `part_sizes`: the output rows of each part of a fused linear
    layer, by its module name ("qkv_proj"); `platform`: the model's, whose native CPU ops run
    the side path where they built (see `LoRASlots`)."""

    def __init__(
        self,
        layers: Sequence[nn.Module],
        part_sizes: Mapping[str, Sequence[int]],
        max_loras: int,
        max_rank: int,
        platform: Platform,
    ) -> None:
        if max_loras < 0 or max_rank < 1:
            raise ValueError(
                f"max_loras must be >= 0 and max_lora_rank >= 1, got {max_loras}, {max_rank}"
            )
        self.max_loras, self.max_rank = max_loras, max_rank
        self.num_layers = len(layers)
        self.platform = platform
        self._loaded = [False] * max_loras
        self._linears = list(_linears(layers)) if max_loras else []
        for _, name, linear in self._linears:
            parts = part_sizes.get(name, [linear.out_features])
            linear.lora_slots = LoRASlots(
                linear.in_features, parts, max_loras, max_rank, platform.cpu_ops
            )

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put `adapter` in `slot` (replacing what it held), in the model's device and dtype."""
        self._check_slot(slot)
        if adapter.rank > self.max_rank:
            raise ValueError(
                f"LoRA adapter rank {adapter.rank} is above max_lora_rank={self.max_rank}"
            )
        layers = max((layer for layer, _ in adapter.weights), default=-1) + 1
        if layers > self.num_layers:
            raise ValueError(f"LoRA adapter has {layers} layers, the model {self.num_layers}")
        # A write that fails part way leaves the slot unusable until a load succeeds.
        self._loaded[slot] = False
        for i, _, linear in self._linears:
            parts = [adapter.weights.get((i, _module(source))) for source in linear.sources]
            linear.lora_slots.write(slot, parts, adapter.rank, adapter.scale)
        self._loaded[slot] = True

    def unload(self, slot: int) -> None:
        """Empty `slot`: a forward pass may no longer name it."""
        self._check_slot(slot)
        self._loaded[slot] = False
        for _, _, linear in self._linears:
            linear.lora_slots.clear(slot)

    def reset(self) -> None:
        """Every slot empty. A model built on the meta device holds uninitialized slots
        (to_empty), and a step reads empty slots beside the ones it runs: they must hold zeros."""
        for _, _, linear in self._linears:
            linear.lora_slots.reset()

    def mapping(self, rows: Sequence[tuple[int, int]]) -> LoRAMapping:
        """The mapping of a step whose rows, in packed order, are (slot or -1 for the base
        model, number of tokens), in the form the layers' side path runs; every slot named
        must hold an adapter."""
        for slot in {slot for slot, _ in rows if slot != -1}:
            self._check_slot(slot)
            if not self._loaded[slot]:
                raise ValueError(f"LoRA slot {slot} holds no adapter")
        if self.platform.cpu_ops is not None:
            return LoRAMapping.native(rows)
        device, dtype = self.platform.device, self.platform.dtype
        if device.type == "cuda" and sum(tokens for _, tokens in rows) <= INDEXED_MAX_TOKENS:
            return LoRAMapping.indexed(rows, device)
        return LoRAMapping.masked(rows, self.max_loras, dtype, device)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"LoRA slot {slot} does not exist: this model has {self.max_loras}")


def _linears(layers: Sequence[nn.Module]) -> Iterator[tuple[int, str, Linear]]:
    """(layer index, module name, layer) of every linear layer of the decoder layers."""
    for i, layer in enumerate(layers):
        for name, module in layer.named_modules():
            if isinstance(module, Linear):
                yield i, name.rpartition(".")[2], module


def _module(source: str) -> str:
    """The Hugging Face module a checkpoint tensor belongs to ("q_proj" of
    "layers.0.self_attn.q_proj.weight")."""
    return source.split(".")[-2]

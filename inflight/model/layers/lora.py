"""Multi-LoRA: a linear layer's low-rank side path, with a different adapter (or none) per token.

The base matmul runs over every token of a step, whatever the layer's quantization method; then
each token's adapter adds scale * (x A^T) B^T to its output. The side path's flops are a few
percent of the base matmul's, so what it costs is its number of ops and what they read, which
must not grow with the number of adapters in a step. Two ways, chosen by the model:

- Native (the CPU float32 path, `cpu_ops.lora_add`): one call per layer computes every short
  run's tokens, each with its own slot's factors and in a fixed order whatever else the step
  holds; a long run of one slot's tokens (a prefill chunk) runs as dense matmuls over its slice,
  where per-op overhead is small against its flops. On a 2-core CPU a pair of torch matmuls per
  adapter, or a padded gather into batched matmuls, added 40-90 % to a 16-row decode step.
- Indexed (CUDA steps of up to `INDEXED_MAX_TOKENS` tokens): one Triton kernel per layer
  (`kernels/triton/lora.py`, a segmented shrink-and-expand on tensor cores) reads each token's
  slot from the device, so a captured CUDA graph replays it with any mix of adapters.
- Masked (longer CUDA steps, and a CPU without the native ops): every token runs through every
  slot's factors and a one-hot mask zeroes the other slots' ranks: (2 + parts) matmul-sized ops
  per layer, at max_loras times the side path's flops, small beside the base matmul's.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from inflight.model.kernels.cpu import ops as cpu_ops
from inflight.model.kernels.cpu.decoder import LoraFactors
from inflight.model.transfer import to_device

# A run of at least this many tokens of one slot runs as dense matmuls on the native path.
# Measured on SmolLM2's shapes (bench/lora_matmul.py).
LONG_RUN = 32
# A CUDA step of more tokens runs masked: the indexed kernel recomputes x A^T per block of output
# columns, which past a few thousand tokens costs more than the masked matmuls (measured on an
# H200 over Qwen3-0.6B's shapes, bench/lora_matmul.py --cuda: 4.3 ms against 9.1 at 1024
# tokens, 15.4 against 9.5 at 4096).
INDEXED_MAX_TOKENS = 2048


def _check_rows(rows: Sequence[tuple[int, int]]) -> None:
    for slot, tokens in rows:
        if tokens < 1 or slot < -1:
            raise ValueError(f"a row needs a slot >= -1 and tokens >= 1, got {(slot, tokens)}")


def _per_token(rows: Sequence[tuple[int, int]]) -> np.ndarray:
    """Each token's slot, the rows checked."""
    _check_rows(rows)
    return np.repeat([slot for slot, _ in rows], [tokens for _, tokens in rows])


@dataclass(frozen=True)
class LoRAMapping:
    """Which adapter slot each packed token of a step runs with (-1 or a zero mask row: the base
    model alone), in the form the model's side path reads. Built once per step, shared by every
    linear layer."""

    num_tokens: int
    # Native form: (slot, tokens) of each long run of one slot's tokens, and [T] int32 on the
    # CPU, each other token's slot (-1 for the base model and for the runs' tokens; None where
    # that leaves none). Indexed form: every token's slot, [T] int32 on the CUDA device.
    runs: tuple[tuple[int, slice], ...] = ()
    token_slots: torch.Tensor | None = None
    # Masked form: [T, max_loras] in the model's dtype and device, each token's one-hot slot.
    mask: torch.Tensor | None = None
    # The rows it was built from, in packed order: (slot or -1, tokens).
    rows: tuple[tuple[int, int], ...] = field(default=(), compare=False)

    def row_slots(self) -> list[int]:
        """Each packed token's slot (-1: the base model), on the host."""
        return _per_token(self.rows).tolist()

    @property
    def per_token(self) -> bool:
        """Every adapter token is in `token_slots` (no runs, no mask): the per-token native
        kernel applies them all, as the CPU decoder step runs it."""
        return not self.runs and self.mask is None

    @classmethod
    def native(cls, rows: Sequence[tuple[int, int]]) -> LoRAMapping:
        """`rows` in packed order: each row's slot (-1: the base model) and number of tokens, a
        row's tokens being one contiguous run of the step's."""
        _check_rows(rows)
        total = sum(tokens for _, tokens in rows)
        token_slots = np.full(total, -1, np.int32)
        runs: list[tuple[int, slice]] = []
        start = 0
        # Adjacent rows of one slot merge into one run (a long chunk split over rows).
        for slot, tokens in _merged(rows):
            if slot >= 0:
                if tokens >= LONG_RUN:
                    runs.append((slot, slice(start, start + tokens)))
                else:
                    token_slots[start : start + tokens] = slot
            start += tokens
        short = torch.from_numpy(token_slots) if (token_slots >= 0).any() else None
        return cls(total, tuple(runs), short, rows=tuple(rows))

    @classmethod
    def indexed(cls, rows: Sequence[tuple[int, int]], device: torch.device) -> LoRAMapping:
        slots = _per_token(rows)
        return cls(len(slots), token_slots=to_device(slots, torch.int32, device), rows=tuple(rows))

    @classmethod
    def masked(
        cls,
        rows: Sequence[tuple[int, int]],
        max_loras: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> LoRAMapping:
        mask = to_device(one_hot_mask(rows, max_loras), dtype, device)
        return cls(mask.shape[0], mask=mask, rows=tuple(rows))


def _merged(rows: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for slot, tokens in rows:
        if merged and merged[-1][0] == slot:
            merged[-1][1] += tokens
        else:
            merged.append([slot, tokens])
    return [(slot, tokens) for slot, tokens in merged]


def one_hot_mask(rows: Sequence[tuple[int, int]], max_loras: int) -> np.ndarray:
    """The masked form's mask on the host, [T, max_loras] float32: 1 at each token's slot, a
    zero row for the base model (`rows` as for `LoRAMapping.native`)."""
    slots = _per_token(rows)
    if slots.size and slots.max() >= max_loras:
        raise ValueError(f"LoRA slot {slots.max()} does not exist: {max_loras} slots")
    mask = np.zeros((len(slots), max_loras), np.float32)
    on = slots >= 0
    mask[np.flatnonzero(on), slots[on]] = 1.0
    return mask


class LoRASlots(nn.Module):
    """The adapters one linear layer can run: `max_loras` slots of factors in the model's device
    and dtype, A as [parts, slots, max_rank, in] and B^T as [slots, max_rank, out] (the scale
    folded into B), part p's B^T in its own columns of the output.

    Both side paths read ranks an adapter does not have (the masked path reads every slot
    whole), so what lies beyond an adapter's rank, a part it leaves alone and every empty slot
    must be zeros: load and clear write whole slots, and a model allocated uninitialized must
    `clear` every slot first. `lib`: the native CPU ops, on the CPU float32 path where they
    built; without them the layer runs masked mappings only.
    """

    def __init__(
        self,
        in_features: int,
        part_sizes: Sequence[int],
        max_loras: int,
        max_rank: int,
        lib: ctypes.CDLL | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.part_sizes = tuple(part_sizes)
        self.max_loras, self.max_rank = max_loras, max_rank
        self.lib = lib
        starts = np.cumsum([0, *part_sizes]).tolist()
        self.part_starts = tuple(starts)
        # int64 for the native kernels, which read ranks and starts in place
        self.starts = np.asarray(starts, np.int64)
        self._columns = [slice(lo, hi) for lo, hi in zip(starts, starts[1:], strict=False)]
        shape_a = (len(part_sizes), max_loras, max_rank, in_features)
        self.register_buffer("a", torch.zeros(shape_a), persistent=False)
        self.register_buffer("bt", torch.zeros(max_loras, max_rank, starts[-1]), persistent=False)
        # Each slot's adapter's rank, 0 where it leaves this layer alone (or the slot is empty).
        self.ranks = np.zeros(max_loras, np.int32)

    @torch.no_grad()
    def write(
        self,
        slot: int,
        parts: Sequence[tuple[torch.Tensor, torch.Tensor] | None],
        rank: int,
        scale: float,
    ) -> None:
        """Put one adapter in `slot`: per part of the output, its (A [rank, in], B [out, rank])
        or None where the adapter leaves the part alone."""
        self.clear(slot)
        if all(factors is None for factors in parts):
            return
        for p, (columns, factors) in enumerate(zip(self._columns, parts, strict=True)):
            if factors is None:
                continue
            lora_a, lora_b = factors
            size = columns.stop - columns.start
            if lora_a.shape != (rank, self.in_features) or lora_b.shape != (size, rank):
                self.clear(slot)
                raise ValueError(
                    f"LoRA factors of shapes {tuple(lora_a.shape)}, {tuple(lora_b.shape)} do "
                    f"not fit a part of {self.in_features} -> {size} at rank {rank}"
                )
            self.a[p, slot, :rank].copy_(lora_a)
            # Scaled in float32, rounded once to the model's dtype.
            self.bt[slot, :rank, columns].copy_(lora_b.T.float() * scale)
        if not (self.a[:, slot].isfinite().all() and self.bt[slot].isfinite().all()):
            # The masked path multiplies every slot's factors: an inf here would turn other
            # adapters' tokens into NaN.
            self.clear(slot)
            raise ValueError("LoRA factors must be finite")
        self.ranks[slot] = rank

    def native_factors(self) -> LoraFactors:
        """The slots as the native decoder step reads them: in place, so that adapters loaded
        later count."""
        return LoraFactors(self.a, self.bt, self.ranks, self.starts)

    @torch.no_grad()
    def reset(self) -> None:
        """Every slot empty."""
        self.ranks[:] = 0
        self.a.zero_()
        self.bt.zero_()

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        self.ranks[slot] = 0
        self.a[:, slot].zero_()
        self.bt[slot].zero_()

    def add(self, y: torch.Tensor, x: torch.Tensor, mapping: LoRAMapping) -> None:
        """y [T, out] += each token's adapter update of x [T, in], in place; the tokens the
        mapping gives no adapter keep their bits."""
        if mapping.mask is not None:
            self._add_masked(y, x, mapping.mask)
            return
        if mapping.token_slots is not None and mapping.token_slots.is_cuda:
            from inflight.model.kernels.triton import lora as triton_lora

            triton_lora.lora_add(
                y, x.contiguous(), mapping.token_slots, self.a, self.bt, self.part_starts
            )
            return
        if self.lib is None:
            raise ValueError("a native LoRA mapping needs the native CPU ops; this layer has none")
        for slot, tokens in mapping.runs:
            rank = int(self.ranks[slot])
            if not rank:
                continue
            for p, columns in enumerate(self._columns):
                h = x[tokens] @ self.a[p, slot, :rank].T
                y[tokens, columns].addmm_(h, self.bt[slot, :rank, columns])
        if mapping.token_slots is not None:
            cpu_ops.lora_add(
                self.lib, y, x, mapping.token_slots, self.a, self.bt, self.ranks, self.starts
            )

    def _add_masked(self, y: torch.Tensor, x: torch.Tensor, mask: torch.Tensor) -> None:
        tokens, slots, rank = x.shape[0], self.max_loras, self.max_rank
        parts = len(self.part_sizes)
        h = (x @ self.a.view(-1, self.in_features).T).view(tokens, parts, slots, rank)
        h.mul_(mask.view(tokens, 1, slots, 1))
        for p, columns in enumerate(self._columns):
            # Views, not copies: slots and ranks merge into one dimension on both sides.
            update = h[:, p].reshape(tokens, slots * rank)
            y[:, columns].addmm_(update, self.bt[:, :, columns].reshape(slots * rank, -1))

"""How a speech row picks its codes, in the order transformers' `generate` applies its
processors (the reference the greedy frames are checked against): the repetition penalty over
the row's first codes so far, the codes the talker never emits masked, no end before the
second frame; then temperature, top-k, top-p and a draw from the row's own generator (greedy:
the argmax). All rows at once, on the device: a step waits for its codes once."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from inflight.model.transfer import to_device_packed


@dataclass(frozen=True)
class Draw:
    """One row's sampling: `temperature` 0 is greedy; `top_k` 0 is off."""

    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator | None


def penalize(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """transformers' repetition penalty for all rows at once: each row's codes seen before
    (`seen` [rows, vocab]) have their logits divided by its `penalty` [rows] where positive,
    multiplied where negative."""
    p = penalty[:, None]
    return torch.where(seen, torch.where(logits < 0, logits * p, logits / p), logits)


@dataclass
class RowSampling:
    """Rows' settings as the device reads them [rows] each: `zeroed` marks greedy rows."""

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    zeroed: torch.Tensor

    def copy_(self, other: RowSampling) -> None:
        """Take `other`'s rows into this one's first rows (a graph's static settings)."""
        for name in ("temperature", "top_p", "top_k", "zeroed"):
            values = getattr(other, name)
            getattr(self, name)[: values.shape[0]].copy_(values)


class Draws:
    """A step's rows' sampling: their settings on the device, copied once (a copy from pageable
    memory would wait for the device at each of the frame's picks), and their noise."""

    def __init__(self, draws: list[Draw], vocab: int, device: torch.device) -> None:
        self.draws = draws
        self.greedy = all(d.temperature == 0 for d in draws)
        floats = [
            np.array([d.temperature or 1.0 for d in draws], np.float32),
            np.array([d.top_p for d in draws], np.float32),
        ]
        ints = [
            np.array([d.top_k if 0 < d.top_k < vocab else vocab for d in draws]),
            np.array([d.temperature == 0 for d in draws], np.int64),
        ]
        (temperature, top_p), (top_k, zeroed) = (
            to_device_packed(floats, torch.float32, device),
            to_device_packed(ints, torch.int64, device),
        )
        self.sampling = RowSampling(temperature, top_p, top_k, zeroed.bool())

    def noise(self, picks: int, vocab: int, device: torch.device) -> torch.Tensor | None:
        """Each row's exponential noise for `picks` picks [rows, picks, vocab], drawn from its
        generator in one go (the same draws alone or beside others, eager or in a graph);
        None where every row is greedy."""
        if self.greedy:
            return None
        noise = torch.ones(len(self.draws), picks, vocab, device=device)
        for i, d in enumerate(self.draws):
            if d.temperature != 0:
                noise[i].exponential_(generator=d.generator)
        return noise


def pick_rows(logits: torch.Tensor, rows: RowSampling, noise: torch.Tensor | None) -> torch.Tensor:
    """A code per row [rows] of processed logits [rows, vocab], on the device without waiting
    for it (no branch on values: a CUDA graph can hold it). Greedy rows take the argmax; the
    others their top-k and top-p after temperature, drawn by an exponential race on their
    `noise` [rows, vocab] (None: every row is greedy)."""
    if noise is None:
        return logits.argmax(-1)
    vocab = logits.shape[-1]
    scaled = logits.float() / rows.temperature[:, None]
    ordered, order = scaled.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab, device=logits.device)
    ordered = ordered.masked_fill(ranks >= rows.top_k[:, None], float("-inf"))
    probs = ordered.softmax(-1)
    # Past the top-p mass: the codes whose more likely codes already hold top_p (never the first).
    ahead = probs.cumsum(-1) - probs
    probs = probs.masked_fill((ahead >= rows.top_p[:, None]) & (ranks > 0), 0.0)
    chosen = (probs / noise).argmax(-1).masked_fill(rows.zeroed, 0)
    return order.gather(1, chosen[:, None])[:, 0]

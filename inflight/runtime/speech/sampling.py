"""How a speech row picks its codes, in the order transformers' `generate` applies its
processors (the reference the greedy frames are checked against): the repetition penalty over
the row's first codes so far, the codes the talker never emits masked, no end before the
second frame; then temperature, top-k, top-p and a draw from the row's own generator (greedy:
the argmax). All rows at once, on the device: a step waits for its codes once."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from inflight.model.transfer import to_device, to_device_packed


@dataclass(frozen=True)
class Draw:
    """One row's sampling: `temperature` 0 is greedy; `top_k` 0 is off."""

    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator | None


def penalize(logits: torch.Tensor, history: list[int], penalty: float) -> None:
    """transformers' repetition penalty, in place on one row [vocab]: a code seen before has
    its logit divided by `penalty` where positive, multiplied where negative."""
    if penalty == 1.0 or not history:
        return
    ids = to_device(sorted(set(history)), torch.int64, logits.device)
    seen = logits[ids]
    logits[ids] = torch.where(seen < 0, seen * penalty, seen / penalty)


class Draws:
    """A step's rows' sampling as the device reads it: their settings as tensors, copied once
    (a copy from pageable memory would wait for the device at each of the frame's picks)."""

    def __init__(self, draws: list[Draw], vocab: int, device: torch.device) -> None:
        self.draws = draws
        self.greedy = all(d.temperature == 0 for d in draws)
        if self.greedy:
            return
        (self.temperature, self.top_p), (self.top_k, self.zeroed) = (
            to_device_packed(
                [
                    np.array([d.temperature or 1.0 for d in draws], np.float32),
                    np.array([d.top_p for d in draws], np.float32),
                ],
                torch.float32,
                device,
            ),
            to_device_packed(
                [
                    np.array([d.top_k if 0 < d.top_k < vocab else vocab for d in draws]),
                    np.array([d.temperature == 0 for d in draws], np.int64),
                ],
                torch.int64,
                device,
            ),
        )


def pick_rows(logits: torch.Tensor, rows: Draws) -> torch.Tensor:
    """A code per row [rows] of processed logits [rows, vocab], on the device without waiting
    for it: greedy rows take the argmax; the others their top-k and top-p after temperature,
    drawn by an exponential race whose noise comes from each row's generator (so a row's codes
    depend on its own seed alone)."""
    if rows.greedy:
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
    noise = torch.empty_like(probs)
    for i, d in enumerate(rows.draws):
        noise[i].exponential_(generator=d.generator)
    chosen = (probs / noise).argmax(-1).masked_fill(rows.zeroed.bool(), 0)
    return order.gather(1, chosen[:, None])[:, 0]

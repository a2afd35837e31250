"""How a speech row picks its codes, in the order transformers' `generate` applies its
processors (the reference the greedy frames are checked against): the repetition penalty over
the row's first codes so far, the codes the talker never emits masked, no end before the
second frame; then temperature, top-k, top-p and a draw from the row's own generator (greedy:
the argmax)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    ids = torch.tensor(sorted(set(history)), device=logits.device)
    seen = logits[ids]
    logits[ids] = torch.where(seen < 0, seen * penalty, seen / penalty)


def draw(logits: torch.Tensor, how: Draw) -> int:
    """A code from one row's processed logits [vocab]."""
    if how.temperature == 0:
        return int(logits.argmax())
    logits = logits / how.temperature
    if 0 < how.top_k < logits.shape[-1]:
        kth = torch.topk(logits, how.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if how.top_p < 1.0:
        ordered, order = torch.sort(logits, descending=False)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - how.top_p
        drop[-1] = False  # the most likely code always stays
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=how.generator))


def pick_rows(logits: torch.Tensor, draws: list[Draw]) -> torch.Tensor:
    """A code per row [rows] of logits [rows, vocab]: one argmax for an all-greedy batch."""
    if all(d.temperature == 0 for d in draws):
        return logits.argmax(-1)
    picks = [draw(row, how) for row, how in zip(logits.float(), draws, strict=True)]
    return torch.tensor(picks, device=logits.device)

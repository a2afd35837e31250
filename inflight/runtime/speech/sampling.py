"""How a speech row picks its codes, in the order transformers' `generate` applies its
processors (the reference the greedy frames are checked against): the repetition penalty over
the row's first codes so far, the codes the talker never emits masked, no end before the
second frame; then temperature, top-k, top-p and a draw from the row's own generator (greedy:
the argmax). All rows at once, on the device: a step waits for its codes once."""

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


def pick_rows(logits: torch.Tensor, draws: list[Draw]) -> torch.Tensor:
    """A code per row [rows] of processed logits [rows, vocab], on the device without waiting
    for it: greedy rows take the argmax; the others their top-k and top-p after temperature,
    drawn by an exponential race whose noise comes from each row's generator (so a row's codes
    depend on its own seed alone)."""
    if all(d.temperature == 0 for d in draws):
        return logits.argmax(-1)
    rows, vocab = logits.shape
    device = logits.device
    temperature = torch.tensor([d.temperature or 1.0 for d in draws], device=device)
    top_k = torch.tensor([d.top_k if 0 < d.top_k < vocab else vocab for d in draws], device=device)
    top_p = torch.tensor([d.top_p for d in draws], device=device)
    scaled = logits.float() / temperature[:, None]
    ordered, order = scaled.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab, device=device)
    ordered = ordered.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = ordered.softmax(-1)
    # Past the top-p mass: the codes whose more likely codes already hold top_p (never the first).
    ahead = probs.cumsum(-1) - probs
    probs = probs.masked_fill((ahead >= top_p[:, None]) & (ranks > 0), 0.0)
    noise = torch.empty_like(probs)
    for i, d in enumerate(draws):
        noise[i].exponential_(generator=d.generator)
    chosen = (probs / noise).argmax(-1)
    greedy = torch.tensor([d.temperature == 0 for d in draws], device=device)
    chosen = chosen.masked_fill(greedy, 0)
    return order.gather(1, chosen[:, None])[:, 0]

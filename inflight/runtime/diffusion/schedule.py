"""Which segments a block-diffusion step runs (torch-free).

A resident is always either encoding (tokens wait to join its KV: its prompt, then each
finished canvas) or denoising a canvas. A step takes the residents in the order they were
seated, each within what is left of the token budget: an encoding resident a chunk of its
waiting tokens, and, where the chunk is the last of them and a canvas still fits, its next
canvas's step in the same forward (the encode writes each layer's KV before the canvas reads
it); a denoising resident its canvas's next step, a canvas's length counted whole. A resident
that does not fit waits: its state does not change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    """One resident's share of a step: `encode` of its waiting tokens (0: none), then a step
    of its canvas where `denoise`."""

    index: int  # the resident's place in the list planned
    encode: int
    denoise: bool


def plan_segments(
    waiting: Sequence[int],
    canvas: int,
    budget: int,
    whole: Sequence[Sequence[tuple[int, int]]] = (),
) -> list[Segment]:
    """The step's segments, for residents with `waiting[i]` tokens to encode (0: denoising).
    `whole[i]`: runs [start, end) of resident i's waiting tokens that one chunk must hold
    whole (an image whose tokens attend to each other both ways)."""
    segments = []
    for index, pending in enumerate(waiting):
        take = min(pending, budget)
        for start, end in whole[index] if index < len(whole) else ():
            if start < take < end:
                take = start
            elif start == 0 and take < end:
                take = 0  # the run does not fit this step
        budget -= take
        denoise = take == pending and budget >= canvas
        if denoise:
            budget -= canvas
        if take or denoise:
            segments.append(Segment(index, take, denoise))
        if budget <= 0:
            break
    return segments

"""What a step is made of on the host: the sampler's picks (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass


# Built for every row of every step: slots and no `frozen`, whose __init__ costs ~10x.
@dataclass(slots=True)
class SampledRow:
    """The sampler's pick for one row, on the host: the token, and with logprobs asked for, its
    log-probability and the top alternatives."""

    token_id: int
    logprob: float | None = None
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None

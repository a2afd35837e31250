"""What a step is made of on the host (torch-free): the rows the scheduler plans, what the
sampler draws for them, and the sampler's picks.

Built for every row of every step: slots and no `frozen`, whose __init__ costs ~10x.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from inflight.protocol.request import SamplingParams
from inflight.protocol.stepped import ScheduledSequence
from inflight.runtime.host.residents import Resident


@dataclass(slots=True)
class ScheduledRow:
    """One resident's work in a step: `token_ids` computed after `past_len` tokens in KV."""

    resident: Resident
    token_ids: Sequence[int]
    past_len: int
    samples: bool  # samples a token (a decode row, or a prompt's last chunk)
    scores: bool = False  # scores its prompt tokens (prompt logprobs)
    device_token: bool = False  # a decode row whose input is a token still on the device
    pick_index: int = 0  # with `device_token`: which of its slot's picks on the device it reads
    position: int = 0  # a sampling row: the index in the output of the token it draws
    # A decode row's speculative drafts, computed after its last token (`token_ids` ends with
    # them): the row samples a token at each of its 1 + len(drafts) positions.
    drafts: tuple[int, ...] = ()
    # Speculative decoding's bookkeeping (see `speculative.py`): the epoch its resident was in
    # when it was planned, and for a fallback row, how many drafts of the row in flight before
    # it must be accepted for it to stand (-1: not a fallback row).
    epoch: int = 0
    fallback: int = -1
    pick_base: int = 0  # where in its slot's picks on the device its own picks are kept

    @property
    def block_table(self) -> np.ndarray:
        return self.resident.kv.table

    @property
    def window_table(self) -> np.ndarray | None:
        """The sliding layers' table, where the window group keeps their KV apart."""
        window = self.resident.kv.window
        return None if window is None else window.table

    def work(self) -> ScheduledSequence:
        return ScheduledSequence(
            self.resident.ref,
            len(self.token_ids),
            self.past_len,
            self.samples,
            self.scores,
            len(self.drafts),
        )


@dataclass
class ScheduledStep:
    """A step's rows: decode rows of one token first, then rows verifying drafts, then prefill
    chunks."""

    step_id: int
    rows: list[ScheduledRow]

    @property
    def verifies(self) -> bool:
        """Whether a row verifies drafts (its computed length waits on what it accepts)."""
        return any(row.drafts for row in self.rows)


def decode_row(r: Resident, drafts: tuple[int, ...] = ()) -> ScheduledRow:
    """The next decode row of a resident whose prompt is computed (its last token read on the
    device while a pick is pending there), verifying `drafts`."""
    token = 0 if r.pending else r.output[-1]
    return ScheduledRow(
        r,
        (token, *drafts),
        r.computed,
        True,
        device_token=r.pending > 0,
        pick_index=r.pick_index,
        drafts=drafts,
    )


def commit(row: ScheduledRow) -> None:
    """Planning a row commits it: its resident's computed length advances, and a sampling row
    counts its picks (1 + drafts) pending on the device, the last of which the next row reads."""
    r = row.resident
    r.computed += len(row.token_ids)
    if row.samples:
        row.position = len(r.output) + r.pending
        r.pending += 1 + len(row.drafts)
        r.pick_index = len(row.drafts)


def plain_decode_rows(decodes: Sequence[Resident]) -> list[ScheduledRow]:
    """A one-token decode row per resident, committed: `decode_row` then `commit` without
    drafts, in one pass (every step plans one per resident)."""
    rows = []
    for r in decodes:
        pending = r.pending
        token = 0 if pending else r.output[-1]
        position = len(r.output) + pending
        row = ScheduledRow(r, (token,), r.computed, True, device_token=pending > 0)
        row.pick_index, row.position = r.pick_index, position
        rows.append(row)
        r.computed += 1
        r.pending = pending + 1
        r.pick_index = 0
    return rows


@dataclass(slots=True)
class SamplingRow:
    """What the sampler draws one token with: the row's parameters and output position (and
    sequence of its request, for seeded noise); with penalties, the tokens they count."""

    params: SamplingParams
    position: int  # index of the output token being drawn (0 for the first)
    sequence: int = 0  # which of the request's n sequences
    # With penalties: the prompt, and the output tokens before `position`.
    prompt: Sequence[int] = ()
    output: Sequence[int] = ()


@dataclass(slots=True)
class SampledRow:
    """The sampler's pick for one row, on the host: the token, and with logprobs asked for, its
    log-probability and the top alternatives."""

    token_id: int
    logprob: float | None = None
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None


def sampling_rows(rows: Sequence[ScheduledRow]) -> list[SamplingRow]:
    """What the sampler draws for a step's sampling rows, in order: a row verifying drafts at
    each of its positions as plain decoding would there, penalties reading the prompt and the
    output before each (the drafts before it included)."""
    sampling: list[SamplingRow] = []
    for row in rows:
        r = row.resident
        params, index = r.request.params, r.index
        if not row.drafts and not params.penalized:  # most rows: one plain draw
            sampling.append(SamplingRow(params, row.position, index))
            continue
        positions = range(row.position, row.position + 1 + len(row.drafts))
        if params.penalized:
            known = r.output[: row.position]
            sampling += [
                SamplingRow(params, p, index, r.prompt, known + list(row.drafts[:i]))
                for i, p in enumerate(positions)
            ]
        else:
            sampling += [SamplingRow(params, p, index) for p in positions]
    return sampling


def reads_tokens(step: ScheduledStep) -> bool:
    """Whether a sampling row of the step reads the tokens before it on the host: under a
    structured-outputs constraint (its matcher) or penalties (its token counts)."""
    return any(
        row.samples
        and (row.resident.features.matcher is not None or row.resident.request.params.penalized)
        for row in step.rows
    )

"""Speculative decoding: drafted tokens verified by the next step (torch-free).

A decode row with drafts computes its last token and its k drafts as 1 + k query tokens of the
same ragged step, and the sampler picks a token at each of the 1 + k positions exactly as
non-speculative decoding would there (the same per-row parameters, the same seeded noise of that
output position). The output processor then takes the picks in order while each equals the next
draft: the first that differs, or the pick after the last draft, is the target's own token. So
the output is the one plain decoding would produce, token for token with greedy or seeded rows,
in distribution otherwise: a deterministic draft d is accepted with probability p(d), and a
rejected position yields a draw from p without d, which is the rejection sampling of
speculative decoding with a one-hot draft distribution. The KV of rejected drafts is dropped by
lowering the row's computed length; later steps overwrite it.

Drafters: prompt lookup ("ngram", no weights) and a draft model (`draft_model.py`: a smaller
checkpoint of the same vocabulary, greedy, its KV in the target's blocks). Both are
deterministic, which is what makes the verification above exact.

`SpeculativeDecoding` is the whole protocol's one home: it decides how many drafts each decode
row may take (none while the row is constrained by structured outputs or penalized, its mask or
penalties at a draft position depending on the draft; opted out; or backing off after drafts
that were rejected; never more than its length budget can take), has its drafter propose them
for all the step's rows at once, plans the fallback rows, and verifies the picks.

With overlapped steps (the next step planned while the device runs this one), a row's last
token is on the device when its next row is planned, and where that step verifies drafts, what
it accepts is unknown too. Prompt lookup drafts ahead all the same: its next row is planned as
if every draft in flight is accepted, the lookup runs over the known tokens and those drafts,
and the first token it finds stands for the token on the device (its drafts are the tokens
after it). Where a draft in flight is rejected, the row planned on it is void: dropped when
taken in, its KV overwritten by the next row, computed from what was accepted. So steps stay
overlapped. A rejection would cost the row the step after it, but that step also holds a
fallback row for each draft in flight: the j-th computes, as a plain decode row, the target's
pick at position j of the row in flight (read on the device), which is the row's next token
if exactly j drafts are accepted. When the verification is taken in, the fallback row for what
it accepted stands in for the void row, and the others are dropped. Those dropped wrote KV
past what stands, or (for an accepted draft, whose pick equals it) the KV of the same token at
the same position again: the output is still plain decoding's. Rows of a step are nearly free
on the device at the batch sizes where speculation pays. The draft model cannot draft past a
token it has not seen: with it, the session takes the step in flight in before planning the
next where a row is `ready` to draft or that step verifies drafts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from inflight.protocol.deployment import SpeculativeConfig
from inflight.runtime.host.features import RowFeature
from inflight.runtime.host.residents import Resident, SpeculativeState
from inflight.runtime.host.rows import SampledRow, ScheduledRow, ScheduledStep, commit, decode_row

log = logging.getLogger(__name__)

# After a verification that accepted nothing, a row drafts again after this many plain steps,
# doubled on each further miss (up to the cap), and reset by any accepted draft: on text the
# drafter does not predict, verification costs at most a few percent of the steps.
_BACKOFF_START = 2
_BACKOFF_CAP = 32


class Drafter(Protocol):
    # Whether it drafts a row whose last token is still on the device (see above).
    ahead: bool

    def propose(self, rows: Sequence[tuple[Resident, int]]) -> list[tuple[int, ...]]:
        """Up to k drafts for each (resident, k) decode row (k may be 0: no drafts, though a
        drafter with state may still catch up on the row's tokens). A drafter `ahead` is also
        given rows with picks pending on the device: it drafts past them as if every draft of
        the row in flight (`SpeculativeState.unverified`) is accepted."""
        ...

    def rewind(self, r: Resident, valid: int) -> None:
        """Only the first `valid` tokens of the resident's sequence stand (drafts beyond were
        rejected)."""
        ...


def lookup_drafts(tokens: Sequence[int], k: int, low: int, high: int) -> list[int]:
    """Prompt lookup: for n from `high` down to `low`, the last n tokens' latest earlier
    occurrence in `tokens`, and the (up to k) tokens that followed it; [] when none occurs."""
    size = len(tokens)
    if size <= low or k < 1:
        return []
    seq = np.asarray(tokens, dtype=np.int64)
    # Where earlier occurrences of the last token end (each with a token after it), narrowed to
    # the occurrences of the last n tokens as n grows: one pass over the sequence in all.
    ends = np.flatnonzero(seq[: size - 1] == seq[-1])
    best = None
    for n in range(1, min(high, size - 1) + 1):
        if n > 1:
            ends = ends[ends >= n - 1]
            ends = ends[seq[ends - (n - 1)] == seq[size - n]]
        if not ends.size:
            break
        if n >= low:
            best = int(ends[-1])
    return [] if best is None else seq[best + 1 : best + 1 + k].tolist()


class PromptLookup:
    """The "ngram" drafter."""

    ahead = True

    def __init__(self, config: SpeculativeConfig) -> None:
        self.low, self.high = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, rows: Sequence[tuple[Resident, int]]) -> list[tuple[int, ...]]:
        drafts: list[tuple[int, ...]] = []
        for r, k in rows:
            if not k:
                drafts.append(())
                continue
            # With a pick on the device, the lookup's first token stands for it.
            guessed = 1 if r.pending else 0
            unverified = speculative_state(r).unverified
            tokens = (*r.tokens(0), *unverified) if guessed else r.tokens(0)
            found = lookup_drafts(tokens, k + guessed, self.low, self.high)
            drafts.append(tuple(found[guessed:]))
        return drafts

    def rewind(self, r: Resident, valid: int) -> None:
        """Stateless."""


@dataclass
class SpeculativeMetrics:
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of them, accepted
    verifications: int = 0  # rows verified (each with one or more drafts)
    voided: int = 0  # rows dropped because the row before them rejected a draft
    fallbacks: int = 0  # of those, rows whose fallback row stood in their place


class SpeculativeDecoding(RowFeature):
    """Decode rows with drafts (see the module docstring): the rows' plan within the step's
    token budget, the verification of their picks, the backoff, and the metrics. Every resident
    gets its `SpeculativeState` at seating."""

    def __init__(self, config: SpeculativeConfig, drafter: Drafter | None = None) -> None:
        self.config = config
        self.drafter = drafter or PromptLookup(config)
        self.metrics = SpeculativeMetrics()
        # Picks kept on the device per slot: its latest row's (1 + drafts), then one per
        # fallback row.
        self.pick_width = 1 + 2 * config.num_speculative_tokens

    def seat(self, resident: Resident, held: object) -> None:
        resident.features.speculative = SpeculativeState()

    @property
    def ahead(self) -> bool:
        """Whether rows draft while their last token is on the device."""
        return self.drafter.ahead

    # -- planning ------------------------------------------------------------------------------

    def plan(self, decodes: list[Resident], budget: int) -> tuple[list[ScheduledRow], int]:
        """Each decode row with the drafts it takes (its length budget and the step's allowing),
        a fallback row for each draft of a row in flight (see the module docstring), then the
        rows committed: rows of one token first, then those verifying drafts."""
        lengths = []
        for r in decodes:
            k = self.draft_length(r, budget)
            budget -= k
            lengths.append(k)
        drafted = self._propose(list(zip(decodes, lengths, strict=True)))
        plain: list[ScheduledRow] = []
        verifying: list[ScheduledRow] = []
        fallbacks: list[ScheduledRow] = []
        for r, drafts in zip(decodes, drafted, strict=True):
            (verifying if drafts else plain).append(decode_row(r, drafts))
            state = speculative_state(r)
            state.hedged = False
            if r.pending and state.unverified and budget >= len(state.unverified):
                fallbacks += self._fallbacks(r)
                budget -= len(state.unverified)
        for row in (*plain, *verifying):
            state = speculative_state(row.resident)
            commit(row)
            row.epoch = state.epoch
            state.unverified = row.drafts
        return [*plain, *fallbacks, *verifying], budget

    def ready(self, r: Resident) -> bool:
        """Whether decode row `r` drafts at its next step if its tokens are all known then:
        not while it waits, nor under a structured-outputs constraint or penalties (its mask or
        penalties at a draft position would depend on the draft), nor where it opted out."""
        params = r.request.params
        if speculative_state(r).wait > 0 or r.features.matcher is not None:
            return False
        if params.penalized or not params.speculative:
            return False
        return self._room(r) > 0

    def draft_length(self, r: Resident, budget: int) -> int:
        """How many drafts decode row `r` takes in the next step, at most `budget` (0 while its
        last token is on the device, unless the drafter drafts ahead). Every call is a step of
        the row's backoff."""
        state = speculative_state(r)
        if state.wait > 0:
            state.wait -= 1
            return 0
        if (r.pending and not self.ahead) or not self.ready(r):
            return 0
        return min(self.config.num_speculative_tokens, budget, self._room(r))

    @staticmethod
    def _room(r: Resident) -> int:
        """Drafts the row's length budget can take: it emits up to 1 + k tokens after those
        pending, and those past `max_tokens` would be dropped."""
        return r.max_new_tokens - len(r.output) - r.pending - 1

    def _propose(self, rows: list[tuple[Resident, int]]) -> list[tuple[int, ...]]:
        """The drafter's proposals. A drafter that fails costs its rows their drafts only (their
        output is plain decoding's all the same): they back off as after a miss."""
        try:
            return self.drafter.propose(rows)
        except Exception:
            log.exception("the drafter failed; its rows decode without drafts")
            for r, k in rows:
                if k:
                    state = speculative_state(r)
                    state.backoff = state.wait = _BACKOFF_CAP
            return [()] * len(rows)

    def _fallbacks(self, r: Resident) -> list[ScheduledRow]:
        """A fallback row for each draft the resident's row in flight may reject: the j-th
        computes the target's pick at that row's position j (read on the device), as the next
        row would if exactly j drafts are accepted. Planned before the row drafted past them
        (the resident's counts are those of the row in flight)."""
        state = speculative_state(r)
        k = len(state.unverified)
        state.hedged = True
        return [
            ScheduledRow(
                r,
                (0,),
                r.computed - k + j,
                True,
                device_token=True,
                pick_index=j,
                position=len(r.output) + r.pending - k + j,
                epoch=state.epoch + 1,
                fallback=j,
                pick_base=self.fallback_pick(j),
            )
            for j in range(k)
        ]

    def fallback_pick(self, j: int) -> int:
        """Where the pick of fallback row `j` is kept among its slot's picks."""
        return 1 + self.config.num_speculative_tokens + j

    def waits(self, inflight: ScheduledStep, residents: Iterable[Resident]) -> bool:
        """Whether the next step's drafts need the step in flight taken in first: a drafter that
        cannot draft ahead, where that step verifies drafts or a decode row would draft."""
        if self.ahead:
            return False
        return inflight.verifies or any(not r.prefilling and self.ready(r) for r in residents)

    # -- taking picks in -----------------------------------------------------------------------

    def take(
        self, row: ScheduledRow, picks: Sequence[SampledRow]
    ) -> tuple[Sequence[SampledRow], int] | None:
        """None for a void row: planned on drafts the row before rejected, or a fallback row
        for what that row did not do (a step's fallback rows come before the row verifying
        drafts that may move its resident's epoch on). Else the tokens a row that verified
        drafts emits: its picks while each equals the next draft, then the first that does not
        (or the pick after the last draft); and how many drafts it rejected, whose KV is given
        back: the next step computes from the first. A row launched after this one was planned
        as if every draft was accepted: where one was not, it is void, and its KV is given back
        too."""
        r, state = row.resident, speculative_state(row.resident)
        if row.epoch != state.epoch or row.fallback != state.fallback:
            return None
        r.pending -= len(picks)
        state.fallback = -1  # a fallback row that stands: the rows after it are plain again
        if not row.drafts:
            return picks, 0
        accepted = 0
        while accepted < len(row.drafts) and picks[accepted].token_id == row.drafts[accepted]:
            accepted += 1
        rejected = len(row.drafts) - accepted
        voided = rejected > 0 and r.pending > 0
        if voided:
            # The picks still pending are the void row's: one row, 1 + its drafts tokens.
            r.computed -= r.pending
            r.pending = 0
            state.epoch += 1
            state.unverified = ()
        r.computed -= rejected
        recovered = voided and state.hedged
        if recovered:
            # The fallback row for `accepted` computes the target's pick at the rejection.
            state.fallback = accepted
            r.computed += 1
            r.pending = 1
            r.pick_index = self.fallback_pick(accepted)
        self._record(r, len(row.drafts), accepted, voided, recovered)
        return picks[: accepted + 1], rejected

    def _record(
        self, r: Resident, drafted: int, accepted: int, voided: bool, recovered: bool
    ) -> None:
        """A row verified `drafted` drafts and accepted the first `accepted` (its output does
        not hold them yet); `voided`: the row planned after it was dropped; `recovered`: a
        fallback row stands in its place."""
        self.drafter.rewind(r, r.prompt_len + len(r.output) + accepted)
        m = self.metrics
        m.drafted += drafted
        m.accepted += accepted
        m.verifications += 1
        m.voided += voided
        m.fallbacks += recovered
        state = speculative_state(r)
        if accepted:
            state.backoff = 0
        else:
            state.backoff = min(_BACKOFF_CAP, max(_BACKOFF_START, 2 * state.backoff))
            state.wait = state.backoff

    def snapshot(self) -> dict[str, float]:
        m = self.metrics
        return {
            "drafted_tokens": m.drafted,
            "accepted_tokens": m.accepted,
            "verifications": m.verifications,
            "voided_rows": m.voided,
            "fallback_rows": m.fallbacks,
            "acceptance_rate": m.accepted / m.drafted if m.drafted else 0.0,
            # Tokens a verified row emits per step: its accepted drafts plus the target's own.
            "mean_accepted_length": (1 + m.accepted / m.verifications if m.verifications else 0.0),
        }


def speculative_state(r: Resident) -> SpeculativeState:
    """The resident's speculative state (every resident has one where speculation is on)."""
    state = r.features.speculative
    assert state is not None
    return state

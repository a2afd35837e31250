"""The stepped-execution contract between a scheduler and the runtime (no torch here).

A scheduler drives a `SteppedExecution` one tick at a time: it `admit`s requests, which become
residents reached through a stable `ResidentRef(slot, epoch)`; every `step` is one forward pass
that prefills seated joiners (in chunks, within the token budget) and decodes one token for every
other resident; a resident that finishes is evicted in the step that finishes it, its terminal
`StreamChunk` and its `FinishedSnapshot` are reported in that step's `StepResult`, and once
every sequence of a request has ended, `outputs.materialize` makes its output of the snapshots.
Neither side calls back into the other.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple, Protocol

from inflight.protocol.outputs import FinishedSnapshot, StreamChunk
from inflight.protocol.request import GenerationRequest


class ResidentRef(NamedTuple):
    """A resident's identity: a slot that never moves while it lives, and that slot's epoch.

    Each reuse of a slot bumps its epoch, so a ref kept past its resident's eviction is stale and
    every use of it fails loudly. (A named tuple: refs key dicts several times per row per step,
    and a tuple hashes in C.)
    """

    slot: int
    epoch: int


class StaleResidentRef(LookupError):
    pass


class AdmissionAnswer(Enum):
    ADMITTED = "admitted"
    NO_CAPACITY = "no_capacity"  # transient: nothing was modified; ask again after an eviction
    REJECTED = "rejected"  # permanent: the request itself is invalid for this runtime


@dataclass(frozen=True)
class Admission:
    """`refs`: one resident per sequence of the request (n of them), all seated at once."""

    answer: AdmissionAnswer
    refs: tuple[ResidentRef, ...] = ()
    reason: str = ""

    @property
    def ref(self) -> ResidentRef | None:
        """The first sequence's resident (the only one unless n > 1)."""
        return self.refs[0] if self.refs else None


# Built for every row of every step: slots and no `frozen`, whose __init__ costs ~10x.
@dataclass(slots=True)
class ScheduledSequence:
    """One resident's share of a step: `query_len` tokens computed after `past_len` in KV."""

    ref: ResidentRef
    query_len: int
    past_len: int
    samples: bool  # whether this step samples a token for it (decode, or the last prefill chunk)
    scores: bool = False  # whether it scores these prompt tokens (prompt logprobs)
    drafts: int = 0  # speculative drafts it verifies (a decode row: query_len is 1 + drafts)

    @property
    def is_prefill(self) -> bool:
        return self.query_len - self.drafts > 1 or not self.samples


@dataclass
class StepResult:
    """One unit of commit.

    `deltas` holds every resident that produced tokens or text this step, including those that
    finished, whose chunk is then terminal (`finished` and `finish_reason` set) where it ended on
    its own (stop or length); `finished` holds the snapshot of each resident evicted this step
    (cancelled and failed ones too). Their refs are stale once the step returns.
    """

    step_id: int
    work: list[ScheduledSequence] = field(default_factory=list)
    deltas: dict[ResidentRef, StreamChunk] = field(default_factory=dict)
    finished: dict[ResidentRef, FinishedSnapshot] = field(default_factory=dict)


@dataclass(frozen=True)
class ExecutionCapabilities:
    """What a runtime declares to the scheduler that drives it.

    `stepped`: it can run one tick at a time (false for a deployment whose features cannot:
    its deployment plan says, see `ifb_unsupported_reason`). `seated_admission`: a request can
    join a batch that is already generating. `max_batch_size`: the most residents it can hold.
    `per_row_fields`: request fields it applies per row, which therefore never keep two
    requests from sharing a step (dotted names such as "params.temperature"). The blocking path
    is an engine whose batches hold one request each, over the same execution.
    """

    stepped: bool
    seated_admission: bool
    max_batch_size: int
    per_row_fields: frozenset[str] = frozenset()


class SteppedExecution(Protocol):
    def residents(self) -> list[ResidentRef]:
        """Live residents, in the order they were seated."""
        ...

    def admit(self, request: GenerationRequest) -> Admission:
        """Seat a request as residents (one per sequence, all or none), or say why not;
        NO_CAPACITY modifies nothing."""
        ...

    def step(self, cancelled: Collection[ResidentRef] = ()) -> StepResult:
        """Run one tick. Residents in `cancelled` are evicted as CANCELLED before it runs."""
        ...

    def finish(self) -> None:
        """End the execution once no residents remain."""
        ...

    def abort(self) -> list[ResidentRef]:
        """Evict every resident (after a failed step); returns the refs it evicted."""
        ...


class ExecutionFactory(Protocol):
    """A runtime as a scheduler sees it: its capabilities, the check of a request, its fault,
    and a new execution per batch."""

    @property
    def capabilities(self) -> ExecutionCapabilities: ...

    @property
    def fault(self) -> str | None:
        """Why it can serve nothing more (a lost tensor-parallel rank), or None."""
        ...

    def check(self, request: GenerationRequest) -> GenerationRequest:
        """The request carrying its admission intent (`GenerationRequest.intent`), or a
        ValueError naming what this runtime cannot serve; any thread may call it, and a request
        it checked already comes back as it is."""
        ...

    def new_session(self) -> SteppedExecution: ...

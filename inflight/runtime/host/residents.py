"""`Resident`: one seated sequence's state, shared by the step's three parts (torch-free).

The scheduler owns its KV reservation and its progress (`computed`, `pending`); the output
processor owns what it produced (`output`, `text`) and what of its KV is published
(`kv.committed`, `kv.digests`). Each feature the sequence uses keeps its own state object in
`features`: speculative decoding's drafts and backoff, the constraint's matcher, the encoder
outputs of its media, its LoRA adapter's slot. They reach it through the scheduler's table of
residents.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from inflight.protocol.outputs import FinishReason, LogprobEntry
from inflight.protocol.request import GenerationRequest
from inflight.protocol.stepped import ResidentRef
from inflight.runtime.host.detokenizer import IncrementalDetokenizer


@dataclass(slots=True)
class SequenceKV:
    """A sequence's KV blocks, one per `block_size` of its tokens in order, and how much of them
    is written and findable: `committed` tokens' KV written by completed steps, the first
    `cached_tokens` of its prompt leased from the context cache, `digests` the chain digests of
    its published full blocks. Its blocks are taken at admission and never change while it
    lives, but for a sliding-window model's (`kv_window.py`): it takes them as its tokens need
    them, from the `reserved` blocks the pool holds back for it, and gives back its first
    `released` once no query can see them (their entries are then stale)."""

    blocks: list[int]
    table: np.ndarray  # `blocks` as an array
    committed: int = 0
    cached_tokens: int = 0
    digests: list[bytes] = field(default_factory=list)
    released: int = 0
    reserved: int = 0
    # Where some layers slide and others do not: the sliding layers' blocks, in the window
    # group's pool, as a sliding-window model's are (their progress is this sequence's).
    window: SequenceKV | None = None

    @property
    def held(self) -> list[int]:
        """The blocks it holds a reference to."""
        return self.blocks[self.released :]


@dataclass(slots=True)
class OutputText:
    """What the output processor keeps of a sequence's output beside its tokens: its text so
    far, and the log-probabilities it was asked for (of its output, of its prompt)."""

    detokenizer: IncrementalDetokenizer
    logprobs: list[LogprobEntry] | None = None
    prompt_logprobs: list[LogprobEntry | None] | None = None
    # The output has ended (why, and the stop string or token), while a feature keeps its
    # sequence seated (`RowFeature.keeps`): it is in no more steps' rows.
    ended: tuple[FinishReason, str | int | None] | None = None


@dataclass(slots=True)
class SpeculativeState:
    """A sequence's part in speculative decoding (see `speculative.py`)."""

    wait: int = 0  # steps to decode without drafts
    backoff: int = 0  # the length of the last such wait
    # The drafts of its latest launched row (read while picks are pending): with overlapped
    # steps, the next row is planned as if they are all accepted; where they are not, that row
    # is void and `epoch` moves on (a row planned in an earlier epoch is dropped when taken in).
    unverified: tuple[int, ...] = ()
    epoch: int = 0
    # The step after such a row holds a fallback row for each of its drafts (`hedged`); once a
    # draft is rejected, the one that stands is `fallback`.
    hedged: bool = False
    fallback: int = -1
    draft_computed: int = 0  # tokens of its sequence in the draft model's KV


@dataclass(slots=True)
class FeatureStates:
    """One state object per feature a sequence uses (None, or -1: it does not use it)."""

    speculative: SpeculativeState | None = None
    matcher: Any = None  # its structured-outputs constraint's llguidance matcher
    # The encoder output of each of its request's media items (None where its KV is cached),
    # from the step that starts its prefill.
    media: list[Any] | None = None
    adapter: int = -1  # the model's LoRA slot it runs with (-1: the base model)
    # The blocks of its system prompt it pins once it ends (save_system_prompt_kv_cache).
    pin_blocks: int = 0
    # Its reply's audio so far, float32 little-endian samples (a spoken reply's), or None.
    audio: bytearray | None = None
    # A spoken reply's prompt media: the thinker hidden states its talker reads, kept by the
    # steps that prefilled them (device/inputs.py `KeptMedia`).
    kept_media: list[Any] = field(default_factory=list)


# Compared by identity: a resident is one sequence's seat, whatever it holds.
@dataclass(slots=True, eq=False)
class Resident:
    ref: ResidentRef
    request: GenerationRequest
    index: int  # which of its request's n sequences
    kv: SequenceKV
    max_new_tokens: int
    computed: int = 0  # tokens (prompt, then output) whose KV launched steps write
    pending: int = 0  # picks on the device, not yet seen by the host (1 + drafts a row)
    pick_index: int = 0  # which of its slot's picks on the device its next row reads
    output: list[int] = field(default_factory=list)
    text: OutputText | None = None  # set by the output processor at seating
    # A later sequence of an n > 1 request, until the first has launched the prompt blocks
    # they share: it waits for them.
    leader: Resident | None = None
    features: FeatureStates = field(default_factory=FeatureStates)

    @property
    def ended(self) -> tuple[FinishReason, str | int | None] | None:
        """Why its output ended, where a feature keeps it seated past that (`OutputText`)."""
        return None if self.text is None else self.text.ended

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.prompt_token_ids

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_token_ids)

    def tokens(self, start: int, end: int | None = None) -> tuple[int, ...]:
        """Tokens start .. end (default: all known) of its sequence, prompt then output."""
        prompt_len = self.prompt_len
        end = prompt_len + len(self.output) if end is None else end
        if end <= prompt_len:
            return self.prompt[start:end]
        head = self.prompt[start:] if start < prompt_len else ()
        return (*head, *self.output[max(0, start - prompt_len) : end - prompt_len])

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.request.prompt_token_ids)

"""`Resident`: one seated request's state, shared by the step's three parts (torch-free).

The scheduler owns its KV (blocks, block table) and its progress (`computed`, `pending`); the
output processor owns what it produced (`output`, detokenizer, logprobs, the matcher of its
structured-outputs constraint) and what of its KV is published (`committed`, `digests`); the
executor reads the matcher to mask what the row may sample. They reach it through the
scheduler's table of residents.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from inflight.protocol.outputs import LogprobEntry
from inflight.protocol.request import GenerationRequest
from inflight.protocol.stepped import ResidentRef
from inflight.runtime.host.detokenizer import IncrementalDetokenizer


@dataclass(slots=True)
class Resident:
    ref: ResidentRef
    request: GenerationRequest
    blocks: list[int]
    block_table: np.ndarray  # `blocks` as an array: never changes while the resident lives
    max_new_tokens: int
    prompt_len: int
    computed: int = 0  # tokens (prompt, then output) whose KV launched steps write
    pending: int = 0  # picks on the device, not yet seen by the host (1 + drafts a row)
    cached_tokens: int = 0  # prompt tokens whose KV came from the context cache
    committed: int = 0  # tokens whose KV a completed step has written
    digests: list[bytes] = field(default_factory=list)  # chain digests of its full blocks
    output: list[int] = field(default_factory=list)
    detokenizer: IncrementalDetokenizer | None = None
    logprobs: list[LogprobEntry] | None = None
    prompt_logprobs: list[LogprobEntry | None] | None = None
    matcher: Any = None  # its structured-outputs constraint's llguidance matcher, if any
    index: int = 0  # which of its request's n sequences
    lora_slot: int = -1  # the model's adapter slot it runs with (-1: the base model)
    # Speculative decoding: steps to decode without drafts, and the length of the last such
    # wait (see `speculative.Speculator`).
    spec_wait: int = 0
    spec_backoff: int = 0
    # The drafts of its latest launched row (read while picks are pending): with overlapped
    # steps, the next row is planned as if they are all accepted; where they are not, that row
    # is void and `epoch` moves on (a row planned in an earlier epoch is dropped when taken in).
    unverified: tuple[int, ...] = ()
    epoch: int = 0
    # The step after such a row holds a fallback row for each of its drafts (`hedged`); once
    # a draft is rejected, the one that stands is `fallback` (see `speculative.py`).
    hedged: bool = False
    fallback: int = -1
    pick_index: int = 0  # which of its slot's picks on the device its next row reads
    draft_computed: int = 0  # tokens of its sequence in the draft model's KV
    # The encoder output of each of its request's media items (None where its KV is cached),
    # from the step that starts its prefill (see `Executor._encode`).
    media_embeds: list[Any] | None = None
    # A later sequence of an n > 1 request, until the first has launched the prompt blocks
    # they share: it waits for them.
    leader: Resident | None = None

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.prompt_token_ids

    def tokens(self, start: int, end: int | None = None) -> tuple[int, ...]:
        """Tokens start .. end (default: all known) of its sequence, prompt then output."""
        end = self.prompt_len + len(self.output) if end is None else end
        if end <= self.prompt_len:
            return self.prompt[start:end]
        head = self.prompt[start:] if start < self.prompt_len else ()
        return (*head, *self.output[max(0, start - self.prompt_len) : end - self.prompt_len])

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt_len

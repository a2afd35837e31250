"""`Scheduler`: admission of requests as residents, and the plan of each step (torch-free).

Admission runs in three stages: `check` validates a request and sizes it (an `AdmissionIntent`;
a ValueError names what is wrong), `reserve` takes a resident slot and every KV block the
request can need, prompt plus max_tokens, leasing its cached prefix (None when they are not
free, having taken nothing), and `seat` makes the reservation a resident.

`schedule` plans one step: a decode row for every resident whose prompt is computed (with its
speculative drafts, if any: those rows come after the plain ones), then prefill chunks of the
others in seating order within `max_num_tokens`. Planning a step commits it: the rows' computed
lengths advance, and each sampling row counts its picks (1 + drafts) pending on the device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from inflight.protocol.options import check_runtime_serves
from inflight.protocol.request import GenerationRequest, PromptTooLongError, RequestFieldError
from inflight.protocol.stepped import ResidentRef, ScheduledSequence
from inflight.runtime.host.adapters import AdapterRegistry
from inflight.runtime.host.context_cache import ContextCache, root_digest
from inflight.runtime.host.kv_cache import BlockPool
from inflight.runtime.host.media import MediaSpec, check_media
from inflight.runtime.host.residents import Resident
from inflight.runtime.host.slots import ResidentSlots
from inflight.runtime.host.speculative import Speculator
from inflight.runtime.host.structured import GrammarCompiler


@dataclass(frozen=True)
class AdmissionIntent:
    """A validated request and what it needs: its output budget and KV blocks.

    Each of its n sequences holds `sequence_blocks` blocks; the `shared_blocks` first ones, the
    full blocks of its prompt but the last token, are the first sequence's, which the others
    lease (so `blocks_needed` counts them once)."""

    request: GenerationRequest
    max_new_tokens: int
    blocks_needed: int
    sequence_blocks: int
    shared_blocks: int = 0
    grammar: str | None = None  # its structured-outputs constraint, compiled


@dataclass(frozen=True)
class Reservation:
    """A slot and the KV blocks of each of the request's sequences."""

    intent: AdmissionIntent
    refs: tuple[ResidentRef, ...]
    blocks: tuple[list[int], ...]
    cached_blocks: int = 0  # leading blocks of the first sequence leased from the context cache
    digests: tuple[bytes, ...] = ()  # their chain digests
    lora_slot: int = -1  # the adapter slot its sequences run with (-1: the base model)


# Built for every row of every step: slots and no `frozen`, whose __init__ costs ~10x.
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
    epoch: int = 0  # its resident's epoch when planned (see `Resident.unverified`)
    # A fallback row (see `speculative.py`): valid only if the row in flight before it accepts
    # exactly this many of its drafts (-1: not a fallback row).
    fallback: int = -1
    pick_base: int = 0  # where in its slot's picks on the device its own picks are kept

    @property
    def block_table(self) -> np.ndarray:
        return self.resident.block_table

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
    """A step's rows, decode rows first."""

    step_id: int
    rows: list[ScheduledRow]

    @property
    def verifies(self) -> bool:
        """Whether a row verifies drafts (its computed length waits on what it accepts)."""
        return any(row.drafts for row in self.rows)


class Scheduler:
    def __init__(
        self,
        blocks: BlockPool,
        slots: ResidentSlots,
        context_cache: ContextCache | None,
        grammars: GrammarCompiler,
        adapters: AdapterRegistry | None,
        speculator: Speculator | None = None,
        *,
        max_model_len: int,
        vocab_size: int,
        max_num_tokens: int,
        media: Mapping[str, MediaSpec] | None = None,
        recurrent: bool = False,
    ) -> None:
        self.blocks = blocks
        self.slots = slots
        self.context_cache = context_cache
        self.grammars = grammars
        self.adapters = adapters
        # Request fields served beside the sampling parameters, per row: with LoRA, each row
        # runs with its own adapter (or none).
        self.row_fields = frozenset() if adapters is None else frozenset({"lora_name"})
        self.speculator = speculator
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_num_tokens = max_num_tokens
        self.media = media or {}  # the media the model takes, by kind
        # A hybrid Mamba model's sequences carry recurrent state beside their KV: a KV prefix
        # (cached, or shared by n sequences) holds no state, so each sequence computes its whole
        # prompt (context-cache lookups are skipped, and counted).
        self.recurrent = recurrent
        if recurrent and max_num_tokens <= slots.capacity:
            raise ValueError(
                f"a hybrid Mamba model needs max_num_tokens ({max_num_tokens}) above "
                f"max_batch_size ({slots.capacity}): its prefill chunks are the difference"
            )
        self.residents: dict[ResidentRef, Resident] = {}

    # -- admission ------------------------------------------------------------------------------

    def check(self, request: GenerationRequest) -> AdmissionIntent:
        """Validate a request against this runtime (ValueError naming the problem) and size what
        it needs. Any thread may call it: it reads what never changes after load, and the
        (locked) adapter registry."""
        check_runtime_serves(request, self.row_fields)
        name = request.lora_name
        if self.adapters is not None and name is not None and not self.adapters.known(name):
            raise RequestFieldError(
                f"unknown LoRA adapter {name!r}; served: {self.adapters.names()}", "lora_name"
            )
        prompt, params = request.prompt_token_ids, request.params
        vocab, limit = self.vocab_size, self.max_model_len
        if not prompt:
            raise ValueError("prompt is empty: at least one token is needed")
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary (size {vocab})")
        check_media(request, self.media)
        if len(prompt) >= limit:
            raise PromptTooLongError(
                f"prompt is {len(prompt)} tokens; max_model_len is {limit}, which leaves room "
                f"for prompts of at most {limit - 1} tokens"
            )
        for name, ids in (
            ("logit_bias", params.logit_bias.keys()),
            ("stop_token_ids", params.stop_token_ids),
        ):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise RequestFieldError(
                    f"{name} token id {bad} is outside the vocabulary (size {vocab})", name
                )
        if params.n > self.slots.capacity:
            raise RequestFieldError(
                f"n ({params.n}) exceeds max_batch_size ({self.slots.capacity}): each of the n "
                "sequences is a resident of the batch",
                "n",
            )
        room = limit - len(prompt)
        if params.max_tokens is not None and params.max_tokens > room:
            raise RequestFieldError(
                f"prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len ({limit})",
                "max_tokens",
            )
        max_new = room if params.max_tokens is None else params.max_tokens
        # KV for every token, the last output token's too: with overlap, the step launched
        # before the request is seen to finish still feeds that token back.
        blocks = self.blocks.blocks_for(len(prompt) + max_new)
        # The n sequences share the full blocks of the prompt but its last token (which each
        # computes itself, so that each draws its first token from its own row).
        shared = (
            (len(prompt) - 1) // self.blocks.block_size
            if params.n > 1 and not self.recurrent
            else 0
        )
        total = blocks + (params.n - 1) * (blocks - shared)
        if total > self.blocks.num_blocks:
            raise RequestFieldError(
                f"request needs {total} KV blocks but the whole cache holds "
                f"{self.blocks.num_blocks}; lower max_tokens or raise the KV cache size",
                "max_tokens",
            )
        spec = params.structured_outputs
        grammar = None if spec is None else self.grammars.compile(spec)
        return AdmissionIntent(request, max_new, total, blocks, shared, grammar)

    def reserve(self, intent: AdmissionIntent) -> Reservation | None:
        """Take a slot per sequence and every KV block the request can need, leasing its cached
        prefix; or None, having changed nothing (a request never holds part of its slots)."""
        pool, cache, n = self.blocks, self.context_cache, intent.request.params.n
        hits: list[int] = []
        digests: list[bytes] = []
        if cache is not None and self._looks_up(intent.request):
            root = root_digest(intent.request.lora_name)
            hits, digests = cache.match(intent.request.prompt_token_ids, root, intent.request.media)
        fresh = intent.blocks_needed - len(hits)
        revived = sum(1 for block in hits if not pool.in_use(block))
        if pool.num_free - revived < fresh or self.slots.num_free < n:
            return None
        lora_slot = -1
        if intent.request.lora_name is not None:
            assert self.adapters is not None
            try:
                slot = self.adapters.acquire(intent.request.lora_name, users=n)
            except KeyError as exc:  # unregistered since it was checked
                raise ValueError(f"LoRA adapter {exc} is no longer served") from exc
            if slot is None:
                return None  # every adapter slot runs an adapter in use
            lora_slot = slot
        refs: list[ResidentRef | None] = []
        held: list[int] = []  # each block reference taken so far
        try:
            for _ in range(n):
                refs.append(self.slots.acquire())
            for block in hits:
                pool.lease(block)
                held.append(block)
            first = hits + (pool.allocate(intent.sequence_blocks - len(hits)) or [])
            held += first[len(hits) :]
            shared = first[: intent.shared_blocks]
            blocks = [first]
            for _ in range(n - 1):
                for block in shared:
                    pool.lease(block)
                    held.append(block)
                more = pool.allocate(intent.sequence_blocks - len(shared)) or []
                held += more
                blocks.append(shared + more)
        except BaseException:
            # A reservation that fails half-way (a bug) gives back what it took: a request
            # that failed at admission must not keep slots or blocks from everyone after it.
            pool.release(held)
            for ref in refs:
                if ref is not None:
                    self.slots.release(ref)
            if lora_slot >= 0:
                assert self.adapters is not None
                for _ in range(n):
                    self.adapters.release(lora_slot)
            raise
        assert None not in refs and all(len(b) == intent.sequence_blocks for b in blocks)
        return Reservation(intent, tuple(refs), tuple(blocks), len(hits), tuple(digests), lora_slot)

    def seat(self, reservation: Reservation) -> list[Resident]:
        """The request's residents, one per sequence. Sequences after the first wait until the
        first has computed the prompt they share, then compute its rest themselves."""
        intent, request = reservation.intent, reservation.intent.request
        cached = reservation.cached_blocks * self.blocks.block_size
        if self.context_cache is not None and self._looks_up(request):
            self.context_cache.record_lookup(len(request.prompt_token_ids), cached)
        elif self.context_cache is not None and self.recurrent and request.params.reuse_context:
            self.context_cache.record_skipped()
        shared = intent.shared_blocks * self.blocks.block_size
        residents: list[Resident] = []
        for index, (ref, blocks) in enumerate(
            zip(reservation.refs, reservation.blocks, strict=True)
        ):
            start = cached if index == 0 else shared
            resident = Resident(
                ref=ref,
                request=request,
                blocks=blocks,
                block_table=np.asarray(blocks, dtype=np.int64),
                max_new_tokens=intent.max_new_tokens,
                prompt_len=len(request.prompt_token_ids),
                computed=start,
                committed=start,
                cached_tokens=cached if index == 0 else 0,
                digests=list(reservation.digests) if index == 0 else [],
                index=index,
                leader=residents[0] if index else None,
                lora_slot=reservation.lora_slot,
            )
            self.residents[ref] = resident
            residents.append(resident)
        return residents

    def _looks_up(self, request: GenerationRequest) -> bool:
        """Whether the request's prompt prefix is looked up in the context cache: asked for, no
        prompt logprobs (which need every prompt position computed), and a model whose
        sequences keep no recurrent state."""
        params = request.params
        return params.reuse_context and params.prompt_logprobs is None and not self.recurrent

    # -- stepping -------------------------------------------------------------------------------

    def schedule(self, step_id: int) -> ScheduledStep | None:
        """Step `step_id`'s rows (None when there is nothing to compute), committed as planned."""
        rows: list[ScheduledRow] = []
        verifying: list[ScheduledRow] = []
        decodes = [r for r in self.residents.values() if not r.prefilling]
        budget = self.max_num_tokens - len(decodes)
        drafted: list[tuple[int, ...]] = [()] * len(decodes)
        if self.speculator is not None:
            lengths = []
            for r in decodes:
                k = self.speculator.draft_length(r, budget)
                budget -= k
                lengths.append(k)
            drafted = self.speculator.propose(list(zip(decodes, lengths, strict=True)))
        for r, drafts in zip(decodes, drafted, strict=True):
            # A pending token is read on the device; the host does not know it yet.
            token = 0 if r.pending else r.output[-1]
            row = ScheduledRow(
                r,
                (token, *drafts),
                r.computed,
                True,
                device_token=r.pending > 0,
                pick_index=r.pick_index,
                drafts=drafts,
            )
            # Rows of one query token come first: they form the batch's decode group.
            (verifying if drafts else rows).append(row)
            r.hedged = False
            if r.pending and r.unverified and budget >= len(r.unverified):
                rows += self._fallbacks(r)
                budget -= len(r.unverified)
        rows += verifying
        for r in self.residents.values():
            if budget <= 0:
                break
            if not r.prefilling:
                continue
            if r.leader is not None:
                if r.leader.computed < r.computed:
                    continue  # the shared prompt blocks are not all launched yet
                r.leader = None
            n = min(r.prompt_len - r.computed, budget)
            if self.recurrent:
                # Chunks of a fixed size whatever the batch: a row's prefill is split the same
                # way alone and beside others, so its state (and output) is the same bits. The
                # first prefill of a step always fits (budget >= max_num_tokens - max_batch).
                n = min(r.prompt_len - r.computed, self.max_num_tokens - self.slots.capacity)
                if n > budget:
                    continue
            budget -= n
            samples = r.computed + n == r.prompt_len and r.max_new_tokens > 0
            scores = r.request.params.prompt_logprobs is not None and r.index == 0
            chunk = r.prompt[r.computed : r.computed + n]
            rows.append(ScheduledRow(r, chunk, r.computed, samples, scores))
        if not rows:
            return None
        for row in rows:
            r = row.resident
            if row.fallback >= 0:
                continue  # computes a token its resident's computed length already counts
            r.computed += len(row.token_ids)
            row.epoch = r.epoch
            if row.samples:
                # Drafts still on the device count as accepted: if they are not, this row is
                # void (see `Resident.unverified`).
                row.position = len(r.output) + r.pending
                r.pending += 1 + len(row.drafts)
                r.unverified = row.drafts
                r.pick_index = len(row.drafts)  # its last pick, the next row's input
        return ScheduledStep(step_id, rows)

    def _fallbacks(self, r: Resident) -> list[ScheduledRow]:
        """A fallback row for each draft the resident's row in flight may reject: the j-th
        computes the target's pick at that row's position j (read on the device), as the next
        row would if exactly j drafts are accepted (see `speculative.py`). Planned before the
        row drafted past them (the resident's counts are those of the row in flight)."""
        assert self.speculator is not None
        k = len(r.unverified)
        r.hedged = True
        return [
            ScheduledRow(
                r,
                (0,),
                r.computed - k + j,
                True,
                device_token=True,
                pick_index=j,
                position=len(r.output) + r.pending - k + j,
                epoch=r.epoch + 1,
                fallback=j,
                pick_base=self.speculator.fallback_pick(j),
            )
            for j in range(k)
        ]

    def drafts_wait(self, inflight: ScheduledStep) -> bool:
        """Whether the next step's drafts need the step in flight taken in first: a drafter that
        cannot draft ahead, where that step verifies drafts or a decode row would draft."""
        spec = self.speculator
        if spec is None or spec.ahead:
            return False
        return inflight.verifies or any(
            not r.prefilling and spec.ready(r) for r in self.residents.values()
        )

    def is_live(self, resident: Resident) -> bool:
        """Whether `resident` is still seated (a launched step may outlive its residents)."""
        return self.residents.get(resident.ref) is resident

    def evict(self, resident: Resident) -> None:
        """Unseat a resident and give its KV blocks and slot back."""
        del self.residents[resident.ref]
        self.blocks.release(resident.blocks)
        self.slots.release(resident.ref)
        if resident.lora_slot >= 0:
            assert self.adapters is not None
            self.adapters.release(resident.lora_slot)

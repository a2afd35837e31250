"""`Scheduler`: admission of requests as residents, and the plan of each step (torch-free).

Admission runs in three stages: `check` validates a request and sizes it (its
`AdmissionIntent`; a ValueError names what is wrong), `reserve` takes a resident slot and every
KV block the request can need, prompt plus max_tokens, leasing its cached prefix, and what each
per-row feature reserves (None when something is not free, having taken nothing), and `seat`
makes the reservation a resident per sequence.

`schedule` plans one step: a decode row for every resident whose prompt is computed (as the
runtime's `Decoding` plans them: with speculative drafts, those rows come after the plain ones),
then prefill chunks of the others in seating order within `max_num_tokens`. Planning a step
commits it: the rows' computed lengths advance, and each sampling row counts its picks
(1 + drafts) pending on the device.

A model whose every attention layer slides (its `KVWindow`) reserves a bounded number of
blocks per sequence instead: each step first gives back the blocks before its residents'
windows, cuts their prompt chunks to the window's `chunk`, and hands its rows the blocks their
new tokens need; its sequences share no prompt blocks (see `kv_window.py`). A model whose layers
only partly slide keeps its sliding layers' KV so in a pool of its own (the window group:
`window_group`, `window_blocks`), beside its full layers' blocks, which it reserves whole: a
sequence has a table in each; a cached prefix serves as far as the sliding layers' blocks of
its last window are cached in their pool too.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from inflight.protocol.options import check_runtime_serves
from inflight.protocol.request import (
    AdmissionIntent,
    GenerationRequest,
    RequestFieldError,
    completion_past_context,
    prompt_past_context,
)
from inflight.protocol.stepped import ResidentRef
from inflight.runtime.host.context_cache import ContextCache, root_digest
from inflight.runtime.host.decoding import Decoding
from inflight.runtime.host.features import RowFeature
from inflight.runtime.host.kv_cache import BlockPool
from inflight.runtime.host.kv_window import KVWindow
from inflight.runtime.host.residents import Resident, SequenceKV
from inflight.runtime.host.rows import ScheduledRow, ScheduledStep, commit
from inflight.runtime.host.slots import ResidentSlots

_scheduler_ids = itertools.count(1)


@dataclass(frozen=True)
class PrefillPolicy:
    """How prompts are prefilled. `chunk`: every chunk of this many tokens (the last one
    shorter) whatever the batch (a hybrid's: a row's recurrent state is then computed the same
    way alone and beside others), None: as much as the step's budget takes. `shares_prefix`:
    whether a prompt's KV prefix may come from elsewhere (the context cache, or the first of
    its request's n sequences); not where sequences keep recurrent state beside their KV, which
    no KV prefix holds."""

    chunk: int | None = None
    shares_prefix: bool = True

    def size(self, remaining: int, budget: int) -> int:
        """The tokens of a prompt's next chunk (0: none this step)."""
        if self.chunk is None:
            return min(remaining, budget)
        size = min(remaining, self.chunk)
        return size if size <= budget else 0


@dataclass(frozen=True)
class Reservation:
    """A slot and the KV blocks of each of the request's sequences, and what each feature took
    for them (in the scheduler's order of features)."""

    request: GenerationRequest
    intent: AdmissionIntent
    refs: tuple[ResidentRef, ...]
    blocks: tuple[list[int], ...]
    cached_blocks: int = 0  # leading blocks of the first sequence leased from the context cache
    digests: tuple[bytes, ...] = ()  # their chain digests
    held: tuple[object, ...] = ()
    # Sliding windows: the first sequence's leading cached blocks before its window (not
    # leased), and the blocks the pool holds back for each sequence's later tokens.
    released: int = 0
    reserved: tuple[int, ...] = ()
    # The window group's: each sequence's blocks in its pool, and as above.
    window_blocks: tuple[list[int], ...] = ()
    window_released: int = 0
    window_reserved: tuple[int, ...] = ()


class Scheduler:
    def __init__(
        self,
        blocks: BlockPool,
        slots: ResidentSlots,
        context_cache: ContextCache | None,
        features: Sequence[RowFeature],
        decoding: Decoding,
        prefill: PrefillPolicy,
        *,
        max_model_len: int,
        vocab_size: int,
        max_num_tokens: int,
        served_options: frozenset[str] = frozenset(),
        window: KVWindow | None = None,
        window_group: KVWindow | None = None,
        window_blocks: BlockPool | None = None,
    ) -> None:
        self.id = next(_scheduler_ids)  # what the intents it checks name
        self.blocks = blocks
        self.slots = slots
        self.context_cache = context_cache
        self.features = tuple(features)
        self.decoding = decoding
        self.prefill = prefill
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_num_tokens = max_num_tokens
        self.served_options = served_options  # the request options of the table it serves
        self.window = window  # where every attention layer slides
        # Where only some do: how their KV follows their window, in a pool of its own.
        self.window_group = window_group
        self.window_blocks = window_blocks
        # Each way a sequence's KV follows a window: the window, its pool, and whether it is
        # the window group's (the sequence's `kv.window`) or the sequence's whole KV.
        self._windows: list[tuple[KVWindow, BlockPool, bool]] = []
        if window is not None:
            self._windows.append((window, blocks, False))
        if window_group is not None:
            assert window_blocks is not None
            self._windows.append((window_group, window_blocks, True))
        # A prompt's chunks are cut to a window's `chunk` (its quota counts on it).
        self._longest_chunk = min((w.chunk for w, _, _ in self._windows), default=max_num_tokens)
        self.residents: dict[ResidentRef, Resident] = {}

    # -- admission ------------------------------------------------------------------------------

    def check(self, request: GenerationRequest) -> AdmissionIntent:
        """Validate a request against this runtime (ValueError naming the problem) and size what
        it needs. Any thread may call it: it reads what never changes after load, and what the
        features lock."""
        check_runtime_serves(request, self.served_options)
        prompt, params = request.prompt_token_ids, request.params
        vocab, limit = self.vocab_size, self.max_model_len
        if not prompt:
            raise ValueError("prompt is empty: at least one token is needed")
        if min(prompt) < 0 or max(prompt) >= vocab:  # in C: the token-by-token search only then
            bad = next(t for t in prompt if not 0 <= t < vocab)
            raise ValueError(f"prompt token id {bad} is outside the vocabulary (size {vocab})")
        if len(prompt) >= limit:
            raise prompt_past_context(limit, len(prompt), limit - 1, "a token of output")
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
            raise completion_past_context(limit, len(prompt), params.max_tokens)
        max_new = room if params.max_tokens is None else params.max_tokens
        # KV for every token, the last output token's too: with overlap, the step launched
        # before the request is seen to finish still feeds that token back.
        tokens = len(prompt) + max_new
        window = self.window
        if window is None:
            blocks = self.blocks.blocks_for(tokens)
        else:
            blocks = window.sequence_blocks(tokens)
        # The n sequences share the full blocks of the prompt but its last token (which each
        # computes itself, so that each draws its first token from its own row).
        shared = 0
        # (Not where some layers slide: each sequence computes its prompt's sliding KV.)
        sliding = window is not None or self.window_group is not None
        if params.n > 1 and self.prefill.shares_prefix and not sliding:
            shared = (len(prompt) - 1) // self.blocks.block_size
        total = blocks + (params.n - 1) * (blocks - shared)
        if total > self.blocks.num_blocks:
            raise RequestFieldError(
                f"request needs {total} KV blocks but the whole cache holds "
                f"{self.blocks.num_blocks}; lower max_tokens or raise the KV cache size",
                "max_tokens",
            )
        for feature in self.features:
            feature.check(request)
        return AdmissionIntent(self.id, max_new, total, blocks, shared)

    def intent(self, request: GenerationRequest) -> AdmissionIntent:
        """The request's intent: as this scheduler's check found it (checking it now if no
        check of this scheduler's did)."""
        if request.intent is not None and request.intent.checked_by == self.id:
            return request.intent
        return self.check(request)

    def checked(self, request: GenerationRequest) -> GenerationRequest:
        """The request carrying its intent (itself, where it carries this scheduler's)."""
        intent = self.intent(request)
        return request if intent is request.intent else replace(request, intent=intent)

    def reserve(self, request: GenerationRequest, intent: AdmissionIntent) -> Reservation | None:
        """Take a slot per sequence, every KV block the request can need (leasing its cached
        prefix) and what each feature needs; or None, having changed nothing (a request never
        holds part of what it needs)."""
        pool, n, window = self.blocks, request.params.n, self.window
        if self.context_cache is not None:
            # Admission is where blocks are taken: prefixes unpinned meanwhile free theirs.
            self.context_cache.apply_unpins()
        hits: list[int] = []
        digests: list[bytes] = []
        if self._looks_up(request):
            root = root_digest(request.lora_name)
            hits, digests = self.context_cache.match(request.prompt_token_ids, root, request.media)
        group, window_hits = self.window_group, []
        if group is not None:
            assert self.window_blocks is not None
            count, window_hits = self._window_hits(digests)
            hits, digests = hits[:count], digests[:count]
            if self.window_blocks.num_free < n * group.quota:  # whatever it leases
                return None
        if window is None:
            fresh = intent.blocks_needed - len(hits)
            revived = sum(1 for block in hits if not pool.in_use(block))
            short = pool.num_free - revived < fresh
        else:
            short = pool.num_free < intent.blocks_needed  # whatever it leases: see kv_window.py
        if short or self.slots.num_free < n:
            return None
        claimed = self._claim(request, n)
        if claimed is None:
            return None
        held, refs = claimed
        if window is not None:
            return self._hold_back_all(request, intent, window, hits, digests, held, refs)
        taken: list[int] = []  # each block reference taken so far
        try:
            for block in hits:
                pool.lease(block)
                taken.append(block)
            first = hits + (pool.allocate(intent.sequence_blocks - len(hits)) or [])
            taken += first[len(hits) :]
            shared = first[: intent.shared_blocks]
            blocks = [first]
            for _ in range(n - 1):
                for block in shared:
                    pool.lease(block)
                    taken.append(block)
                more = pool.allocate(intent.sequence_blocks - len(shared)) or []
                taken += more
                blocks.append(shared + more)
        except BaseException:
            # A reservation that fails half-way gives back what it took: a request that failed
            # at admission must not keep slots or blocks from everyone after it.
            pool.release(taken)
            self._unclaim(request, held, refs)
            raise
        assert all(len(b) == intent.sequence_blocks for b in blocks)
        reservation = Reservation(
            request, intent, tuple(refs), tuple(blocks), len(hits), tuple(digests), tuple(held)
        )
        if group is not None:
            reservation = self._hold_back_window(reservation, group, window_hits)
        return reservation

    def _window_hits(self, digests: list[bytes]) -> tuple[int, list[int]]:
        """Of a cached prefix (its blocks' `digests`), how many blocks serve a model whose
        layers only partly slide: those whose last window's blocks the window group's pool
        holds too; and those blocks of its pool."""
        group, pool = self.window_group, self.window_blocks
        assert group is not None and pool is not None
        for count in range(len(digests), 0, -1):
            first = group.first_seen(count * pool.block_size)
            found = [pool.lookup(digest) for digest in digests[first:count]]
            if None not in found:
                return count, [block for block in found if block is not None]
        return 0, []

    def _hold_back_window(
        self, reservation: Reservation, group: KVWindow, hits: list[int]
    ) -> Reservation:
        """The window group's part of a reservation: its cached blocks of the prefix's last
        window leased, and each sequence's quota, less those, held back in its pool."""
        pool = self.window_blocks
        assert pool is not None
        tokens = reservation.cached_blocks * pool.block_size
        n = reservation.request.params.n
        tables, skipped, reserved = _hold_back(pool, group, tokens, hits, group.quota, n)
        return replace(
            reservation, window_blocks=tables, window_released=skipped, window_reserved=reserved
        )

    def _claim(
        self, request: GenerationRequest, n: int
    ) -> tuple[list[object], list[ResidentRef]] | None:
        """What each feature reserves for the request, then a slot for each of its `n`
        sequences (free: the caller counted them); None, having taken nothing, where a feature
        has no room."""
        held: list[object] = []
        refs: list[ResidentRef] = []
        try:
            for feature in self.features:
                claim = feature.reserve(request, n)
                if claim is None:
                    self._unreserve(request, held)
                    return None
                held.append(claim)
            for _ in range(n):
                ref = self.slots.acquire()
                assert ref is not None
                refs.append(ref)
        except BaseException:
            self._unclaim(request, held, refs)
            raise
        return held, refs

    def _unclaim(
        self, request: GenerationRequest, held: list[object], refs: list[ResidentRef]
    ) -> None:
        for ref in refs:
            self.slots.release(ref)
        self._unreserve(request, held)

    def _hold_back_all(
        self,
        request: GenerationRequest,
        intent: AdmissionIntent,
        window: KVWindow,
        hits: list[int],
        digests: list[bytes],
        held: list[object],
        refs: list[ResidentRef],
    ) -> Reservation:
        """A sliding-window model's blocks, where the pool has room for them: the cached
        blocks in the first query's window leased, and each sequence's quota, less what it
        leased, held back in the pool for its later tokens (see kv_window.py)."""
        pool, n = self.blocks, request.params.n
        tokens = len(hits) * pool.block_size
        leased = hits[window.first_seen(tokens) :]
        blocks, skipped, reserved = _hold_back(
            pool, window, tokens, leased, intent.sequence_blocks, n
        )
        return Reservation(
            request,
            intent,
            tuple(refs),
            blocks,
            len(hits),
            tuple(digests),
            tuple(held),
            released=skipped,
            reserved=reserved,
        )

    def _unreserve(self, request: GenerationRequest, held: list[object]) -> None:
        for feature, claim in zip(self.features, held, strict=False):
            feature.unreserve(request, request.params.n, claim)

    def seat(self, reservation: Reservation) -> list[Resident]:
        """The request's residents, one per sequence. Sequences after the first wait until the
        first has computed the prompt they share, then compute its rest themselves."""
        request, intent = reservation.request, reservation.intent
        cached = reservation.cached_blocks * self.blocks.block_size
        if self._looks_up(request):
            self.context_cache.record_lookup(
                len(request.prompt_token_ids), cached, reservation.digests
            )
        elif (
            self.context_cache is not None
            and request.params.reuse_context
            and not self.prefill.shares_prefix  # asked for, but the model reuses no prefix
        ):
            self.context_cache.record_skipped()
        shared = intent.shared_blocks * self.blocks.block_size
        residents: list[Resident] = []
        for index, (ref, blocks) in enumerate(
            zip(reservation.refs, reservation.blocks, strict=True)
        ):
            start = cached if index == 0 else shared
            window_kv = None
            if reservation.window_blocks:
                taken = reservation.window_blocks[index]
                window_kv = SequenceKV(
                    taken,
                    np.asarray(taken, dtype=np.int64),
                    released=reservation.window_released if index == 0 else 0,
                    reserved=reservation.window_reserved[index],
                )
            kv = SequenceKV(
                blocks,
                np.asarray(blocks, dtype=np.int64),
                committed=start,
                cached_tokens=cached if index == 0 else 0,
                digests=list(reservation.digests) if index == 0 else [],
                released=reservation.released if index == 0 else 0,
                reserved=reservation.reserved[index] if reservation.reserved else 0,
                window=window_kv,
            )
            resident = Resident(
                ref,
                request,
                index,
                kv,
                intent.max_new_tokens,
                computed=start,
                leader=residents[0] if index else None,
            )
            for feature, claim in zip(self.features, reservation.held, strict=True):
                feature.seat(resident, claim)
            self.residents[ref] = resident
            residents.append(resident)
        return residents

    def _looks_up(self, request: GenerationRequest) -> bool:
        """Whether the request's prompt prefix is looked up in the context cache: there is one,
        the request asks for it, wants no prompt logprobs (which need every prompt position
        computed, as a feature may), and the model's KV prefixes are reusable."""
        params = request.params
        return (
            self.context_cache is not None
            and params.reuse_context
            and params.prompt_logprobs is None
            and self.prefill.shares_prefix
            and not any(feature.reads_prompt(request) for feature in self.features)
        )

    # -- stepping -------------------------------------------------------------------------------

    def schedule(self, step_id: int) -> ScheduledStep | None:
        """Step `step_id`'s rows (None when there is nothing to compute), committed as planned."""
        decodes: list[Resident] = []
        prefilling: list[Resident] = []
        for r in self.residents.values():
            if r.ended is not None:
                continue
            (prefilling if r.prefilling else decodes).append(r)
            for window, pool, grouped in self._windows:
                window.release(_sliding_kv(r, grouped), pool, r.kv.committed)
        rows, budget = self.decoding.plan(decodes, self.max_num_tokens - len(decodes))
        prefills: list[ScheduledRow] = []
        longest = self._longest_chunk
        for r in prefilling:
            if budget <= 0:
                break
            if self._waits_for_leader(r):
                continue
            n = self.prefill.size(min(r.prompt_len - r.computed, longest), budget)
            if not n:
                continue
            budget -= n
            samples = r.computed + n == r.prompt_len and r.max_new_tokens > 0
            chunk = r.prompt[r.computed : r.computed + n]
            prefills.append(ScheduledRow(r, chunk, r.computed, samples, _scores(r)))
        # Committed once all are planned: a sequence waiting for its leader's prompt blocks
        # waits for a step that launched them, not one that launches them beside it.
        for row in prefills:
            commit(row)
        rows += prefills
        for window, pool, grouped in self._windows:
            for row in rows:
                window.grow(_sliding_kv(row.resident, grouped), row.resident.computed, pool)
        return ScheduledStep(step_id, rows) if rows else None

    @staticmethod
    def _waits_for_leader(r: Resident) -> bool:
        """Whether a later sequence of an n > 1 request still waits for the first to launch the
        prompt blocks they share."""
        if r.leader is None:
            return False
        if r.leader.computed < r.computed:
            return True
        r.leader = None
        return False

    def is_live(self, resident: Resident) -> bool:
        """Whether `resident` is still seated (a launched step may outlive its residents)."""
        return self.residents.get(resident.ref) is resident

    def evict(self, resident: Resident) -> None:
        """Unseat a resident and give its KV blocks, its slot and what its features held back."""
        del self.residents[resident.ref]
        _give_back(resident.kv, self.blocks)
        if resident.kv.window is not None:
            assert self.window_blocks is not None
            _give_back(resident.kv.window, self.window_blocks)
        self.slots.release(resident.ref)
        for feature in self.features:
            feature.evict(resident)

    def siblings(self, resident: Resident) -> list[Resident]:
        """The other live sequences of the resident's request."""
        request = resident.request
        return [r for r in self.residents.values() if r.request is request and r is not resident]


def _hold_back(
    pool: BlockPool, window: KVWindow, hit_tokens: int, leased: list[int], quota: int, n: int
) -> tuple[tuple[list[int], ...], int, tuple[int, ...]]:
    """Where KV follows a window: `leased` (the cached blocks of the first query's window, the
    prefix being `hit_tokens` long) leased in `pool`, and each of the n sequences' quota, less
    those, held back there for its later tokens. The sequences' tables (the first's starts at
    its first cached block: those before its window are stale entries, not held), how many
    entries it skips, and what is held back for each."""
    skipped = window.first_seen(hit_tokens)
    for block in leased:
        pool.lease(block)
    reserved = (quota - len(leased), *[quota] * (n - 1))
    if not pool.reserve(sum(reserved)):
        raise RuntimeError("a KV pool lost the room that admission counted")
    return ([0] * skipped + leased, *[[] for _ in range(n - 1)]), skipped, reserved


def _give_back(kv: SequenceKV, pool: BlockPool) -> None:
    """Release a sequence's blocks in `pool`, and what the pool held back for it."""
    pool.release(kv.held)
    pool.unreserve(kv.reserved)


def _sliding_kv(r: Resident, grouped: bool) -> SequenceKV:
    """The KV of the resident's that follows a window: the window group's, or all of it."""
    if not grouped:
        return r.kv
    assert r.kv.window is not None
    return r.kv.window


def _scores(r: Resident) -> bool:
    """Whether the resident's prefill rows score its prompt (the first sequence of a request
    asking for prompt logprobs)."""
    return r.text is not None and r.text.prompt_logprobs is not None

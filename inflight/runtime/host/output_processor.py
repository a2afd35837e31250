"""`OutputProcessor`: takes a completed step in (torch-free).

For every row of the step it commits the KV the step wrote (publishing newly full blocks to the
context cache), records prompt scores, and accepts the sampled token: detokenize, check EOS, stop
tokens, stop strings and the length budget, and evict a resident that finished, reporting its
`FinishedSnapshot` in the step's result. A row that verified speculative drafts accepts its
picks in order while each equals the next draft (see `speculative.py`), and gives back the KV of
the drafts it rejected.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from inflight.model.checkpoints.tokenizer import Tokenizer
from inflight.protocol.outputs import (
    FinishedSnapshot,
    FinishReason,
    LogprobEntry,
    StreamChunk,
    TopLogprob,
)
from inflight.protocol.stepped import StepResult
from inflight.runtime.host.context_cache import chain_digest, media_keys, root_digest
from inflight.runtime.host.detokenizer import IncrementalDetokenizer
from inflight.runtime.host.kv_cache import BlockPool
from inflight.runtime.host.residents import Resident
from inflight.runtime.host.rows import SampledRow
from inflight.runtime.host.scheduler import ScheduledRow, ScheduledStep, Scheduler
from inflight.runtime.host.speculative import Speculator
from inflight.runtime.host.structured import GrammarCompiler

log = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Tokenizer,
        blocks: BlockPool,
        grammars: GrammarCompiler,
        publish_blocks: bool,
        speculator: Speculator | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.speculator = speculator
        self.tokenizer = tokenizer
        self.grammars = grammars
        self.blocks = blocks
        self.publish_blocks = publish_blocks  # the context cache is on
        self._eos = frozenset(tokenizer.eos_token_ids)

    def track(self, r: Resident, grammar: str | None) -> None:
        """Start a newly seated resident's output (and its constraint's matcher)."""
        params = r.request.params
        if grammar is not None:
            r.matcher = self.grammars.matcher(grammar)
        r.detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            r.prompt,
            params.skip_special_tokens,
            params.stop,
            params.include_stop_str_in_output,
        )
        r.logprobs = None if params.logprobs is None else []
        # The first sequence scores the prompt for the request.
        scored = params.prompt_logprobs is not None and r.index == 0
        r.prompt_logprobs = [None] if scored else None

    def complete(
        self,
        step: ScheduledStep,
        picks: Sequence[SampledRow],
        scores: dict[int, list[SampledRow]],
        result: StepResult,
    ) -> None:
        """Take a step's results in: `picks` holds the sampled tokens of the sampling rows, in
        row order (one per row, 1 + its drafts for a row verifying drafts); `scores` the prompt
        scores of the scoring rows, by row index."""
        result.work = [row.work() for row in step.rows]
        offset = 0
        for i, row in enumerate(step.rows):
            emitted: Sequence[SampledRow] = ()
            if row.samples:
                width = 1 + len(row.drafts)
                emitted = picks[offset : offset + width]
                offset += width
            r = row.resident
            if not self.scheduler.is_live(r):
                continue  # evicted since this step was launched: its row was wasted work
            if row.epoch != r.epoch or row.fallback != r.fallback:
                # Planned on drafts the row before rejected, or a fallback row for what that
                # row did not do: void. (A step's fallback rows come before the row verifying
                # drafts that may move its resident's epoch on.)
                continue
            r.fallback = -1  # a fallback row that stands: the rows after it are plain again
            r.pending -= len(emitted)
            rejected = 0
            if row.drafts:
                emitted, rejected = self._verify(r, row, emitted)
            r.committed += len(row.token_ids) - rejected
            if self.publish_blocks:
                self._publish(r)
            if i in scores:
                assert r.prompt_logprobs is not None
                r.prompt_logprobs += [self._logprob_entry(s) for s in scores[i]]
            if emitted:
                for pick in emitted:
                    if self._accept(r, pick, result):
                        break
            elif not r.prefilling and r.max_new_tokens == 0:
                # A scoring-only request (max_tokens=0) ends once its prompt is computed.
                result.finished[r.ref] = self.finish(r, FinishReason.LENGTH, None)

    def finish(
        self, r: Resident, reason: FinishReason, stop_reason: str | int | None
    ) -> FinishedSnapshot:
        """Evict a resident and take its snapshot."""
        self.scheduler.evict(r)
        assert r.detokenizer is not None
        return FinishedSnapshot(
            request=r.request,
            token_ids=list(r.output),
            text=r.detokenizer.text,
            finish_reason=reason,
            stop_reason=stop_reason,
            logprobs=r.logprobs,
            prompt_logprobs=r.prompt_logprobs,
            cached_tokens=r.cached_tokens,
            index=r.index,
        )

    def _publish(self, r: Resident) -> None:
        """Make the resident's newly completed blocks findable (this step has written them)."""
        bs = self.blocks.block_size
        # Runs for every row of every step: the common case (no block completed) costs O(1).
        full = min(r.committed, r.prompt_len + len(r.output)) // bs
        while len(r.digests) < full:
            i = len(r.digests)
            start, end = i * bs, (i + 1) * bs
            if end > r.prompt_len and not r.request.params.cache_generated_tokens:
                return
            parent = r.digests[-1] if r.digests else root_digest(r.request.lora_name)
            digest = chain_digest(
                parent, r.tokens(start, end), media_keys(r.request.media, start, end)
            )
            # If another block already holds this digest, ours stays private.
            self.blocks.publish(r.blocks[i], digest)
            r.digests.append(digest)

    def _verify(
        self, r: Resident, row: ScheduledRow, picks: Sequence[SampledRow]
    ) -> tuple[Sequence[SampledRow], int]:
        """The tokens a row that verified drafts emits: its picks while each equals the next
        draft, then the first that does not (or the pick after the last draft); and how many
        drafts it rejected, whose KV is given back: the next step computes from the first.
        A row launched after this one was planned as if every draft was accepted: where one
        was not, it is void, and its KV is given back too."""
        assert self.speculator is not None
        accepted = 0
        while accepted < len(row.drafts) and picks[accepted].token_id == row.drafts[accepted]:
            accepted += 1
        rejected = len(row.drafts) - accepted
        voided = rejected > 0 and r.pending > 0
        if voided:
            # The picks still pending are the void row's: one row, 1 + its drafts tokens.
            r.computed -= r.pending
            r.pending = 0
            r.epoch += 1
            r.unverified = ()
        r.computed -= rejected
        if voided and r.hedged:
            # The fallback row for `accepted` computes the target's pick at the rejection.
            r.fallback = accepted
            r.computed += 1
            r.pending = 1
            r.pick_index = self.speculator.fallback_pick(accepted)
        self.speculator.record(r, len(row.drafts), accepted, voided, r.hedged and voided)
        return picks[: accepted + 1], rejected

    def _accept(self, r: Resident, sampled: SampledRow, result: StepResult) -> bool:
        """Take one output token in; whether it ended the resident."""
        token = sampled.token_id
        params = r.request.params
        r.output.append(token)
        chunk = result.deltas.get(r.ref)
        if chunk is None:
            chunk = result.deltas[r.ref] = StreamChunk(prompt_tokens=r.prompt_len, index=r.index)
        chunk.token_ids.append(token)
        if r.logprobs is not None:
            entry = self._logprob_entry(sampled)
            r.logprobs.append(entry)
            chunk.logprobs = [*(chunk.logprobs or []), entry]
        assert r.detokenizer is not None
        reason, stop_reason = None, None
        if token in params.stop_token_ids:
            reason, stop_reason = FinishReason.STOP, token
        elif not params.ignore_eos and token in self._eos:
            reason = FinishReason.STOP
        else:
            text, matched = r.detokenizer.add(token)
            chunk.text += text
            if matched is not None:
                reason, stop_reason = FinishReason.STOP, matched
            elif r.matcher is not None:
                reason = self._advance(r, token)
        if reason is None and len(r.output) >= r.max_new_tokens:
            reason = FinishReason.LENGTH
        if reason is None:
            return False
        if stop_reason is None or isinstance(stop_reason, int):
            chunk.text += r.detokenizer.flush()
        result.finished[r.ref] = self.finish(r, reason, stop_reason)
        return True

    @staticmethod
    def _advance(r: Resident, token: int) -> FinishReason | None:
        """Advance the resident's matcher by its token: STOP once its output is complete in the
        constraint's language (the mask then allows EOS alone, which need not be sampled)."""
        if not r.matcher.consume_token(token):
            # The mask allows only what the matcher accepts, so this is a fault of ours: it
            # fails this row alone.
            log.error("structured outputs of %s: %s", r.ref, r.matcher.get_error())
            return FinishReason.ERROR
        return FinishReason.STOP if r.matcher.is_stopped() else None

    def _logprob_entry(self, sampled: SampledRow) -> LogprobEntry:
        tok = self.tokenizer

        def text(token_id: int) -> str:
            return tok.decode([token_id], skip_special_tokens=False)

        top = tuple(
            TopLogprob(t, lp, text(t), tok.token_bytes(t))
            for t, lp in zip(sampled.top_ids or [], sampled.top_logprobs or [], strict=True)
        )
        t = sampled.token_id
        return LogprobEntry(t, sampled.logprob, text(t), tok.token_bytes(t), top)

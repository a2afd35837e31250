"""`OutputProcessor`: takes a completed step in (torch-free).

For every row of the step it commits the KV the step wrote (publishing newly full blocks to the
context cache), records prompt scores, and accepts the sampled tokens: detokenize, check EOS,
stop tokens, stop strings, what each per-row feature says of the token (a constraint's end) and
the length budget, and evict a resident that finished, reporting its `FinishedSnapshot` in the
step's result. The runtime's `Decoding` says which rows no longer stand and what a row's picks
emit (a row verifying speculative drafts emits its accepted drafts and gives back the KV of the
rejected ones). A sequence that fails ends its whole request: its siblings are evicted with it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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
from inflight.runtime.host.decoding import Decoding
from inflight.runtime.host.detokenizer import IncrementalDetokenizer
from inflight.runtime.host.features import RowFailure, RowFeature
from inflight.runtime.host.kv_cache import BlockPool
from inflight.runtime.host.residents import OutputText, Resident
from inflight.runtime.host.rows import SampledRow, ScheduledStep
from inflight.runtime.host.scheduler import Scheduler


class OutputProcessor:
    """`publish_blocks`: the context cache is on (and the model's KV prefixes reusable): full
    blocks become findable once a completed step has written them (in the window group's pool
    too, `window_blocks`, where the sequence still holds the block there)."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Tokenizer,
        blocks: BlockPool,
        features: Sequence[RowFeature],
        decoding: Decoding,
        publish_blocks: bool,
        window_blocks: BlockPool | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.blocks = blocks
        self.window_blocks = window_blocks  # the window group's pool, if any
        self.features = tuple(features)
        # The features that take tokens in: each output token of every row visits them.
        self._accepting = tuple(f for f in features if type(f).accept is not RowFeature.accept)
        self._keeping = tuple(f for f in features if type(f).keeps is not RowFeature.keeps)
        self.decoding = decoding
        self._publish: Callable[[Resident], None] = (
            self._publish_full_blocks if publish_blocks else _publish_nothing
        )
        self._eos = frozenset(tokenizer.eos_token_ids)

    def track(self, r: Resident) -> None:
        """Start a newly seated resident's output."""
        params = r.request.params
        detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            r.prompt,
            params.skip_special_tokens,
            params.stop,
            params.include_stop_str_in_output,
        )
        # The first sequence scores the prompt for the request.
        scored = params.prompt_logprobs is not None and r.index == 0
        r.text = OutputText(
            detokenizer, None if params.logprobs is None else [], [None] if scored else None
        )

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
            picked: Sequence[SampledRow] = ()
            if row.samples:
                picked = picks[offset : offset + 1 + len(row.drafts)]
                offset += len(picked)
            r = row.resident
            # Evicted since this step was launched (its row was wasted work), ended, or void.
            if not self.scheduler.is_live(r) or r.ended is not None:
                continue
            taken = self.decoding.take(row, picked)
            if taken is None:
                continue
            emitted, rejected = taken
            r.kv.committed += len(row.token_ids) - rejected
            self._publish(r)
            assert r.text is not None
            if i in scores:
                r.text.prompt_logprobs += [self._logprob_entry(s) for s in scores[i]]
            for pick in emitted:
                if self._accept(r, pick, result):
                    break
            if not emitted and not r.prefilling and r.max_new_tokens == 0:
                # A scoring-only request (max_tokens=0) ends once its prompt is computed.
                self.finish(r, FinishReason.LENGTH, None, result)

    def finish(
        self,
        r: Resident,
        reason: FinishReason,
        stop_reason: str | int | None,
        result: StepResult,
        error: str = "",
    ) -> None:
        """Evict a resident, its snapshot in `result`. One that ended on its own (stop,
        length) gets its terminal chunk; one that failed (ERROR) takes its request's other
        sequences with it: the request has failed. One that ended on its own which a feature
        keeps seated is only marked `ended` (the feature finishes it later)."""
        ends = reason in (FinishReason.STOP, FinishReason.LENGTH)
        if ends and r.ended is None and any(f.keeps(r, reason, stop_reason) for f in self._keeping):
            assert r.text is not None
            r.text.ended = (reason, stop_reason)
            return
        result.finished[r.ref] = self._evict(r, reason, stop_reason, error)
        if ends:
            chunk = result.deltas.get(r.ref)
            if chunk is None:
                chunk = result.deltas[r.ref] = StreamChunk(
                    prompt_tokens=r.prompt_len, cached_tokens=r.kv.cached_tokens, index=r.index
                )
            chunk.finished, chunk.finish_reason = True, reason.value
        elif reason is FinishReason.ERROR:
            for sibling in self.scheduler.siblings(r):
                result.finished[sibling.ref] = self._evict(
                    sibling, FinishReason.ERROR, None, f"sequence {r.index} failed: {error}"
                )

    def _evict(
        self, r: Resident, reason: FinishReason, stop_reason: str | int | None, error: str
    ) -> FinishedSnapshot:
        """Evict a resident and take its snapshot."""
        self.scheduler.evict(r)
        assert r.text is not None
        return FinishedSnapshot(
            request=r.request,
            token_ids=list(r.output),
            text=r.text.detokenizer.text,
            finish_reason=reason,
            stop_reason=stop_reason,
            logprobs=r.text.logprobs,
            prompt_logprobs=r.text.prompt_logprobs,
            cached_tokens=r.kv.cached_tokens,
            index=r.index,
            error=error,
            audio=bytes(r.features.audio or b""),
        )

    def _publish_full_blocks(self, r: Resident) -> None:
        """Make the resident's newly completed blocks findable (this step has written them)."""
        kv, bs = r.kv, self.blocks.block_size
        # Runs for every row of every step: the common case (no block completed) returns here.
        if len(kv.digests) >= kv.committed // bs:
            return
        full = min(kv.committed, r.prompt_len + len(r.output)) // bs
        while len(kv.digests) < full:
            i = len(kv.digests)
            start, end = i * bs, (i + 1) * bs
            if end > r.prompt_len and not r.request.params.cache_generated_tokens:
                return
            parent = kv.digests[-1] if kv.digests else root_digest(r.request.lora_name)
            digest = chain_digest(
                parent, r.tokens(start, end), media_keys(r.request.media, start, end)
            )
            # If another block already holds this digest, ours stays private.
            self.blocks.publish(kv.blocks[i], digest)
            window = kv.window
            if window is not None and window.released <= i < len(window.blocks):
                assert self.window_blocks is not None
                self.window_blocks.publish(window.blocks[i], digest)
            kv.digests.append(digest)

    def _accept(self, r: Resident, sampled: SampledRow, result: StepResult) -> bool:
        """Take one output token in; whether it ended the resident."""
        token = sampled.token_id
        params, text = r.request.params, r.text
        assert text is not None
        r.output.append(token)
        chunk = result.deltas.get(r.ref)
        if chunk is None:
            prompt_tokens = len(r.request.prompt_token_ids)  # not the property: every row
            chunk = result.deltas[r.ref] = StreamChunk(
                prompt_tokens=prompt_tokens, cached_tokens=r.kv.cached_tokens, index=r.index
            )
        chunk.token_ids.append(token)
        if text.logprobs is not None:
            entry = self._logprob_entry(sampled)
            text.logprobs.append(entry)
            chunk.logprobs = [*(chunk.logprobs or []), entry]
        reason, stop_reason, error = None, None, ""
        # Below min_tokens nothing stops the row (the sampler rules out its ending tokens).
        stops = len(r.output) > params.min_tokens
        if stops and token in params.stop_token_ids:
            reason, stop_reason = FinishReason.STOP, token
        elif stops and not params.ignore_eos and token in self._eos:
            reason = FinishReason.STOP
        else:
            released, matched = text.detokenizer.add(token, stops)
            chunk.text += released
            if matched is not None:
                reason, stop_reason = FinishReason.STOP, matched
        try:
            for feature in self._accepting:
                reason = reason or feature.accept(r, token)
        except RowFailure as exc:
            reason, error = FinishReason.ERROR, str(exc)
        if reason is None and len(r.output) >= r.max_new_tokens:
            reason = FinishReason.LENGTH
        if reason is None:
            return False
        if stop_reason is None or isinstance(stop_reason, int):
            chunk.text += text.detokenizer.flush()
        self.finish(r, reason, stop_reason, result, error)
        return True

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


def _publish_nothing(r: Resident) -> None:
    """Without the context cache (or with a model whose KV prefixes hold no state): nothing."""

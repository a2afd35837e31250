"""`Executor`: runs a scheduled step on the device (batch building, forward, sampling).

It owns the model runner (the forward passes: see `model_runner.py`), the sampler, the media
encoders and each slot's last sampled token on the device. `launch` queues a step's forward
pass and `sample` its sampling, each returning at once where the device is asynchronous; `fetch`
waits for its sampled tokens. Under tensor parallelism this is rank 0's: `launch` sends each
step's plan to the worker ranks, which run the same forward pass, and samples alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from inflight.model.contract import MediaEmbeds
from inflight.model.encoders.vision import prune_image_tokens
from inflight.model.layers.mamba import MambaRows
from inflight.model.transfer import to_device
from inflight.protocol.request import MediaItem
from inflight.runtime.device.batch_builder import RowInput, build_ragged_batch
from inflight.runtime.device.cuda_graphs import replayable
from inflight.runtime.device.encoder_cache import EncoderCache
from inflight.runtime.device.model_runner import HeadRows, ModelRunner, StepPlan, head_rows
from inflight.runtime.device.parallel import Workers
from inflight.runtime.device.sampler import Sampled, Sampler, SamplingRow
from inflight.runtime.host.media import mrope_positions, mrope_shift
from inflight.runtime.host.rows import SampledRow
from inflight.runtime.host.scheduler import ScheduledRow, ScheduledStep
from inflight.runtime.host.structured import GrammarCompiler

# Prompt positions scored per LM-head call: bounds the [positions, vocab] logits held at once.
_SCORE_SLICE = 128


@dataclass
class LaunchedStep:
    """A step whose forward pass is queued on the device, then its sampling."""

    step: ScheduledStep
    logits: torch.Tensor | None = None  # of its sampling rows, until they are sampled
    sampled: Sampled | None = None
    # Row index -> the scores of the prompt tokens that row's chunk predicts (computed at once).
    scores: dict[int, list[SampledRow]] = field(default_factory=dict)


class Executor:
    """`workers`: the worker ranks of a tensor-parallel runtime, sent each step's plan."""

    def __init__(
        self,
        runner: ModelRunner,
        sampler: Sampler,
        grammars: GrammarCompiler,
        *,
        max_batch_size: int,
        pick_width: int = 1,
        encoder_cache: EncoderCache | None = None,
        workers: Workers | None = None,
    ) -> None:
        self.runner = runner
        self.sampler = sampler
        self.grammars = grammars
        self.block_size = runner.block_size
        self.max_batch_size = max_batch_size
        self._bitmask: np.ndarray | None = None  # the constrained rows' masks, made on first use
        self.device = device = runner.device
        self.workers = workers
        # Each slot's latest picks, where the next step reads its input token without a host
        # trip: the picks of its latest row (1 + drafts), then those of fallback rows.
        self.picks = torch.zeros((max_batch_size, pick_width), dtype=torch.int64, device=device)
        self.encoder_cache = encoder_cache
        self.encoders = runner.model.media_encoders()
        # M-RoPE models shift the rotary positions of the tokens after an image.
        self.mrope = runner.model.config.rope.mrope_section is not None

    # -- media ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def _encode(self, rows: list[ScheduledRow]) -> None:
        """Give each resident whose prefill starts in this step the encoder outputs of its
        media (None for an item whose placeholders precede the row, their KV being cached):
        from the encoder cache where it holds them, the step's other items encoded together,
        one encoder run per kind."""
        starting = [
            row for row in rows if row.resident.request.media and row.resident.media_embeds is None
        ]
        if not starting:
            return
        assert self.encoder_cache is not None
        found: dict[bytes, torch.Tensor | None] = {}
        missing: dict[str, dict[bytes, MediaItem]] = {}
        for row in starting:
            for item in row.resident.request.media:
                if item.offset + item.length > row.past_len and item.key not in found:
                    found[item.key] = self.encoder_cache.get(item.key)
                    if found[item.key] is None:
                        missing.setdefault(item.kind, {})[item.key] = item
        # A pageable copy waits for the step in flight: once a step and kind, for all its items
        # (pinning a new size costs ~100 ms on an H200, measured).
        for kind, items in missing.items():
            encoded = self.encoders[kind].encode([item.data for item in items.values()])
            for key, output in zip(items, encoded, strict=True):
                self.encoder_cache.put(key, output)
                found[key] = output
        for row in starting:
            row.resident.media_embeds = [
                _kept(found.get(item.key), item.length) for item in row.resident.request.media
            ]

    # -- steps ----------------------------------------------------------------------------------

    @property
    def fault(self) -> str | None:
        """Why the worker ranks stopped serving (tensor parallelism), or None."""
        return None if self.workers is None else self.workers.fault

    def launch(self, step: ScheduledStep) -> LaunchedStep:
        """Queue the step's forward pass, its prompt scoring and its logits on the device;
        `sample` then queues its sampling."""
        if self.workers is None:
            return self._launch(step)
        try:
            return self._launch(step)
        except Exception as exc:
            # A rank was lost, or rank 0 failed after its plan went out: the ranks are out of
            # step for good.
            self.workers.fail(self.workers.lost() or f"a step failed on rank 0 ({exc})")
            raise RuntimeError(self.workers.fault) from exc

    def _launch(self, step: ScheduledStep) -> LaunchedStep:
        rows, device = step.rows, self.device
        # Only a model with media input looks for media in its steps.
        media = self._media_embeds(rows) if self.encoder_cache is not None else None
        # A hybrid's tokens of one sequence never run as separate decode rows: each would read
        # the same recurrent state.
        graphs = self.runner.graphs
        unfold = (
            graphs is not None
            and media is None
            and not self.runner.recurrent
            and replayable(rows, graphs.buckets[-1])
        )
        shift = None
        if self.mrope and any(row.resident.request.media for row in rows):
            shift = np.concatenate(
                [
                    mrope_shift(row.resident.request.media, row.past_len, len(row.token_ids))
                    for row in rows
                ]
            )
        # Decode rows whose last token is still on the device read it from there (the first
        # of a row's tokens; rows come packed in order).
        pending, offset, width = [], 0, self.picks.shape[1]
        for row in rows:
            if row.device_token:
                pending.append((offset, row.resident.ref.slot * width + row.pick_index))
            offset += len(row.token_ids)
        launched = LaunchedStep(step)
        heads, scoring = self._plan_heads(rows, launched)
        if self.workers is not None:
            inputs = [
                RowInput(r.token_ids, r.past_len, r.block_table, r.samples, r.scores, r.drafts)
                for r in rows
            ]
            self.workers.send(StepPlan(inputs, unfold, bool(pending), heads))
        batch = build_ragged_batch(rows, self.block_size, device, unfold, shift)
        forward = batch.forward
        if pending:
            positions, picks = to_device(pending, torch.int64, device).unbind(1)
            forward.input_ids[positions] = self.picks.view(-1)[picks]
            if self.workers is not None:
                self.runner.share_ids(batch)
        forward.media = media
        if self.runner.model.max_loras:
            # One per row of the batch: a row verifying drafts (any row, unfolded) is packed as
            # one row per token.
            lora_slots = [
                r.resident.lora_slot
                for r in rows
                for _ in range(len(r.token_ids) if unfold or r.drafts else 1)
            ]
            if max(lora_slots) >= 0:
                lengths = forward.attention.query_lens_host
                forward.lora = self.runner.model.lora.mapping(
                    list(zip(lora_slots, lengths, strict=True))
                )
        if self.runner.recurrent:
            # A row's first chunk starts its sequence's state from zero.
            slots = [row.resident.ref.slot for row in rows]
            forward.recurrent = MambaRows.build(slots, [row.past_len == 0 for row in rows], device)
        hidden = self.runner.execute(batch)
        for i, rows_of_call in enumerate(heads):
            logits = self.runner.logits(head_rows(hidden, rows_of_call))
            if i < len(scoring):
                index, start, end = scoring[i]
                row = rows[index]
                prompt, past = row.resident.prompt, row.past_len
                targets = prompt[past + start + 1 : past + end + 1]
                top_n = row.resident.request.params.prompt_logprobs or 0
                launched.scores[index] += self.sampler.score(logits, targets, top_n)
            else:
                launched.logits = logits
        return launched

    @staticmethod
    def _plan_heads(
        rows: list[ScheduledRow], launched: LaunchedStep
    ) -> tuple[list[HeadRows], list[tuple[int, int, int]]]:
        """The step's LM-head calls, over the hidden rows the forward keeps (in row order: all
        of a scoring row's tokens, else a sampler's last, or its last 1 + drafts where it
        verifies drafts): first the scoring rows' prompt tokens in slices (each predicting the
        prompt token after it; the `scoring` entries say which row, by index, and which prompt
        positions), then every sampling row at once. Gives each scoring row of `launched` its
        (empty) list of scores: one pass over the rows, in the step loop."""
        heads: list[HeadRows] = []
        scoring: list[tuple[int, int, int]] = []
        sample_rows: list[int] = []
        offset = 0
        for i, row in enumerate(rows):
            if row.scores:
                kept = len(row.token_ids)
                launched.scores[i] = []
                count = min(kept, len(row.resident.prompt) - 1 - row.past_len)
                for start in range(0, count, _SCORE_SLICE):
                    end = min(count, start + _SCORE_SLICE)
                    heads.append((offset + start, offset + end))
                    scoring.append((i, start, end))
                if row.samples:
                    sample_rows.append(offset + kept - 1)
            else:
                kept = (1 + len(row.drafts)) if row.samples else 0
                sample_rows.extend(range(offset, offset + kept))
            offset += kept
        if sample_rows:
            # All kept rows sample unless some were kept for scoring.
            heads.append((0, offset) if len(sample_rows) == offset else sample_rows)
        return heads, scoring

    def _media_embeds(self, rows: list[ScheduledRow]) -> MediaEmbeds | None:
        """The step's media placeholder tokens: their packed indices, the encoder output each
        takes and (M-RoPE) their 3-D positions; None when the step holds none. Encodes what
        the step starts first."""
        self._encode(rows)
        indices: list[int] = []
        parts: list[torch.Tensor] = []
        grids: list[np.ndarray] = []
        offset = 0
        for row in rows:
            r, start = row.resident, row.past_len
            end = start + len(row.token_ids)
            if r.media_embeds and start < r.prompt_len:
                media = r.request.media
                for i, (item, encoded) in enumerate(zip(media, r.media_embeds, strict=True)):
                    lo, hi = max(start, item.offset), min(end, item.offset + item.length)
                    if lo >= hi:
                        continue
                    indices += range(offset + lo - start, offset + hi - start)
                    output, kept = encoded
                    parts.append(output[lo - item.offset : hi - item.offset])
                    if self.mrope:
                        positions = mrope_positions(media, i)
                        if kept is not None:
                            positions = positions[:, kept]
                        grids.append(positions[:, lo - item.offset : hi - item.offset])
            offset += len(row.token_ids)
        if not parts:
            return None
        return MediaEmbeds(
            to_device(indices, torch.int64, self.device),
            torch.cat(parts),
            to_device(np.concatenate(grids, axis=1), torch.int64, self.device) if grids else None,
        )

    @staticmethod
    def reads_tokens(launched: LaunchedStep) -> bool:
        """Whether a sampling row of the step reads the tokens before it on the host: under a
        structured-outputs constraint (its matcher) or penalties (its token counts)."""
        return any(
            row.samples
            and (row.resident.matcher is not None or row.resident.request.params.penalized)
            for row in launched.step.rows
        )

    def sample(self, launched: LaunchedStep) -> None:
        """Queue the sampling of a launched step. Constrained rows are masked by what their
        matchers allow now, penalized rows penalized by their tokens so far: with overlapped
        steps this runs after the step before has been taken in (its tokens advanced the
        matchers and the outputs), while the device computes the forward."""
        if launched.logits is None:
            return
        samplers = [row for row in launched.step.rows if row.samples]
        # A row verifying drafts samples at each of its positions as plain decoding would there;
        # penalties read the prompt and the output before each (the drafts before it included).
        sampling, firsts = [], []
        for row in samplers:
            firsts.append(len(sampling))
            resident = row.resident
            params, index = resident.request.params, resident.index
            positions = range(row.position, row.position + 1 + len(row.drafts))
            if params.penalized:
                known = resident.output[: row.position]
                sampling += [
                    SamplingRow(params, p, index, resident.prompt, known + list(row.drafts[:i]))
                    for i, p in enumerate(positions)
                ]
            else:
                sampling += [SamplingRow(params, p, index) for p in positions]
        launched.sampled = self.sampler.sample(
            launched.logits, sampling, self._masks(samplers, firsts)
        )
        launched.logits = None
        # Every pick, where the next step's rows read theirs (see `ScheduledRow.pick_index`).
        width = self.picks.shape[1]
        kept = [
            row.resident.ref.slot * width + row.pick_base + i
            for row in samplers
            for i in range(1 + len(row.drafts))
        ]
        self.picks.view(-1)[to_device(kept, torch.int64, self.device)] = launched.sampled.tokens

    def _masks(
        self, samplers: list[ScheduledRow], firsts: list[int]
    ) -> tuple[list[int], torch.Tensor] | None:
        """The sampled positions under a structured-outputs constraint (`firsts`: each sampling
        row's first position; a constrained row has no drafts), and the packed bitmask of what
        each may sample next (on the device); None when no row is constrained. A row whose
        matcher has stopped (its resident finished in the step before: its row is wasted) is
        left free."""
        constrained = [
            i
            for i, row in enumerate(samplers)
            if row.resident.matcher is not None and not row.resident.matcher.is_stopped()
        ]
        if not constrained:
            return None
        if self._bitmask is None:
            self._bitmask = self.grammars.bitmask(self.max_batch_size)
        bitmask = self._bitmask[: len(constrained)]
        self.grammars.fill([samplers[i].resident.matcher for i in constrained], bitmask)
        return [firsts[i] for i in constrained], to_device(bitmask, torch.int32, self.device)

    def fetch(self, launched: LaunchedStep) -> list[SampledRow]:
        """The step's sampled tokens on the host, one per sampling row (waits for the device)."""
        return self.sampler.fetch(launched.sampled) if launched.sampled is not None else []


def _kept(
    output: torch.Tensor | None, length: int
) -> tuple[torch.Tensor, np.ndarray | None] | None:
    """An item's encoder output as its prompt takes it: the tokens the visual-token pruner
    keeps (with their indices; None: all are kept)."""
    if output is None:
        return None
    kept = prune_image_tokens(output, length)
    return (output, None) if kept is None else (output[kept], kept.cpu().numpy())

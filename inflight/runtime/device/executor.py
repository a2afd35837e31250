"""`Executor`: runs a scheduled step on the device (batch building, forward, sampling).

It owns the model runner (the forward passes: see `model_runner.py`), the sampler, the forward
inputs of the runtime's per-row features (`inputs.py`) and each slot's last sampled tokens on
the device. `launch` queues a step's forward pass and `sample` its sampling, each returning at
once where the device is asynchronous; `fetch` waits for its sampled tokens. Under tensor
parallelism rank 0 runs `parallel.ParallelExecutor`, which sends each step's plan to the worker
ranks before its forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from inflight.model.transfer import to_device
from inflight.runtime.device.batch_builder import RaggedBatch, build_ragged_batch
from inflight.runtime.device.cuda_graphs import replayable
from inflight.runtime.device.inputs import ForwardInput
from inflight.runtime.device.model_runner import HeadRows, ModelRunner, head_rows
from inflight.runtime.device.sampler import Sampled, Sampler
from inflight.runtime.host.residents import Resident
from inflight.runtime.host.rows import SampledRow, ScheduledRow, ScheduledStep, sampling_rows
from inflight.runtime.host.structured import Constraints

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
    # Residents whose rows could not run (dropped from `step`), and why.
    failed: dict[Resident, str] = field(default_factory=dict)


class Executor:
    def __init__(
        self,
        runner: ModelRunner,
        sampler: Sampler,
        constraints: Constraints,
        inputs: Sequence[ForwardInput],
        *,
        max_batch_size: int,
        pick_width: int = 1,
    ) -> None:
        self.runner = runner
        self.sampler = sampler
        self.constraints = constraints
        self.inputs = tuple(inputs)
        self.block_size = runner.block_size
        self.device = device = runner.device
        # Each slot's latest picks, where the next step reads its input token without a host
        # trip: the picks of its latest row (1 + drafts), then those of fallback rows.
        self.picks = torch.zeros((max_batch_size, pick_width), dtype=torch.int64, device=device)

    @property
    def fault(self) -> str | None:
        """Why the device can serve no more (a lost tensor-parallel rank), or None."""
        return None

    def launch(self, step: ScheduledStep) -> LaunchedStep:
        """Queue the step's forward pass, its prompt scoring and its logits on the device;
        `sample` then queues its sampling. Rows a forward input cannot prepare (media that
        fail to encode) are dropped from the step, their residents in `failed`."""
        launched = LaunchedStep(step)
        for forward_input in self.inputs:
            launched.failed |= forward_input.prepare(step.rows)
        if launched.failed:
            step.rows = [row for row in step.rows if row.resident not in launched.failed]
        rows = step.rows
        if not rows:
            return launched
        graphs = self.runner.graphs
        unfold = (
            graphs is not None
            and self.runner.unfolds
            and all(forward_input.unfolds(rows) for forward_input in self.inputs)
            and replayable(rows, graphs.buckets[-1])
        )
        heads, scoring = self._plan_heads(rows, launched)
        batch = build_ragged_batch(rows, self.block_size, self.device, unfold)
        self._read_device_tokens(rows, batch)
        for forward_input in self.inputs:
            forward_input.add(rows, batch)
        hidden = self._forward(rows, batch, unfold, heads)
        for i, rows_of_call in enumerate(heads):
            logits = self.runner.logits(head_rows(hidden, rows_of_call))
            if i < len(scoring):
                index, start, end = scoring[i]
                row = rows[index]
                targets = row.resident.prompt[row.past_len + start + 1 : row.past_len + end + 1]
                top_n = row.resident.request.params.prompt_logprobs or 0
                launched.scores[index] += self.sampler.score(logits, targets, top_n)
            else:
                launched.logits = logits
        return launched

    def _forward(
        self, rows: list[ScheduledRow], batch: RaggedBatch, unfold: bool, heads: list[HeadRows]
    ) -> torch.Tensor:
        """The step's forward pass (under tensor parallelism, the plan goes to the workers
        first): the hidden states the LM-head calls read."""
        return self.runner.execute(batch)

    def _read_device_tokens(self, rows: list[ScheduledRow], batch: RaggedBatch) -> None:
        """Decode rows whose last token is still on the device read it there (the first of a
        row's tokens; rows come packed in order)."""
        pending, offset, width = [], 0, self.picks.shape[1]
        for row in rows:
            if row.device_token:
                pending.append((offset, row.resident.ref.slot * width + row.pick_index))
            offset += len(row.token_ids)
        if pending:
            positions, picks = to_device(pending, torch.int64, self.device).unbind(1)
            batch.forward.input_ids[positions] = self.picks.view(-1)[picks]

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

    def sample(self, launched: LaunchedStep) -> None:
        """Queue the sampling of a launched step. Constrained rows are masked by what their
        matchers allow now, penalized rows penalized by their tokens so far: with overlapped
        steps this runs after the step before has been taken in (its tokens advanced the
        matchers and the outputs), while the device computes the forward."""
        if launched.logits is None:
            return
        samplers = [row for row in launched.step.rows if row.samples]
        masks = None
        constrained = self.constraints.masks(samplers)
        if constrained is not None:
            # A constrained row has no drafts: its one position is its row's first.
            rows, bitmask = constrained
            firsts = self._first_positions(samplers)
            masks = [firsts[i] for i in rows], to_device(bitmask, torch.int32, self.device)
        launched.sampled = self.sampler.sample(launched.logits, sampling_rows(samplers), masks)
        launched.logits = None
        # Every pick, where the next step's rows read theirs (see `ScheduledRow.pick_index`).
        width = self.picks.shape[1]
        kept = [
            row.resident.ref.slot * width + row.pick_base + i
            for row in samplers
            for i in range(1 + len(row.drafts))
        ]
        self.picks.view(-1)[to_device(kept, torch.int64, self.device)] = launched.sampled.tokens

    @staticmethod
    def _first_positions(samplers: list[ScheduledRow]) -> list[int]:
        """Each sampling row's first sampled position among the step's (1 + drafts a row)."""
        firsts, position = [], 0
        for row in samplers:
            firsts.append(position)
            position += 1 + len(row.drafts)
        return firsts

    def fetch(self, launched: LaunchedStep) -> list[SampledRow]:
        """The step's sampled tokens on the host, one per sampling row (waits for the device)."""
        return self.sampler.fetch(launched.sampled) if launched.sampled is not None else []

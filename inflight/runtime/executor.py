"""`Executor`: runs a scheduled step on the device (batch building, forward, sampling).

It owns the model, its KV cache tensors, the attention backend, the CUDA graphs of decode steps,
the sampler, and each slot's last sampled token on the device. `launch` queues a step's forward
pass and `sample` its sampling, each returning at once where the device is asynchronous; `fetch`
waits for its sampled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from inflight.model.attention import AttentionBackend, AttentionMetadata, KVCache
from inflight.model.config import ModelConfig
from inflight.model.layers.lora import LoRAMapping
from inflight.model.llama import LlamaForCausalLM
from inflight.model.transfer import to_device
from inflight.runtime.batch_builder import RaggedBatch, build_ragged_batch
from inflight.runtime.cuda_graphs import DecodeGraphs, DecodeInputs, graph_buckets, replayable
from inflight.runtime.outputs import SampledRow
from inflight.runtime.sampler import Sampled, Sampler, SamplingRow
from inflight.runtime.scheduler import ScheduledRow, ScheduledStep
from inflight.runtime.structured import GrammarCompiler

# Prompt positions scored per LM-head call: bounds the [positions, vocab] logits held at once.
_SCORE_SLICE = 128


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
) -> list[KVCache]:
    shape = backend.kv_cache_shape(num_blocks, block_size, config.num_kv_heads, config.head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(config.num_layers)
    ]


@dataclass
class LaunchedStep:
    """A step whose forward pass is queued on the device, then its sampling."""

    step: ScheduledStep
    logits: torch.Tensor | None = None  # of its sampling rows, until they are sampled
    sampled: Sampled | None = None
    # Row index -> the scores of the prompt tokens that row's chunk predicts (computed at once).
    scores: dict[int, list[SampledRow]] = field(default_factory=dict)


class Executor:
    """Given graph inputs, decode-only steps replay captured CUDA graphs (see `cuda_graphs.py`)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[KVCache],
        backend: AttentionBackend,
        sampler: Sampler,
        grammars: GrammarCompiler,
        *,
        block_size: int,
        max_batch_size: int,
        device: torch.device,
        graph_inputs: DecodeInputs | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.sampler = sampler
        self.grammars = grammars
        self.block_size = block_size
        self.max_batch_size = max_batch_size
        self._bitmask: np.ndarray | None = None  # the constrained rows' masks, made on first use
        self.device = device
        # Each slot's latest sampled token, where the next step reads it without a host trip.
        self.last_tokens = torch.zeros(max_batch_size, dtype=torch.int64, device=device)
        self.graphs: DecodeGraphs | None = None
        if graph_inputs is not None:
            with torch.inference_mode():
                self.graphs = DecodeGraphs(
                    self._forward, graph_inputs, graph_buckets(graph_inputs.input_ids.shape[0])
                )

    # -- the model ------------------------------------------------------------------------------

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        lora: LoRAMapping | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, self.kv_caches, meta, self.backend, lora)

    @torch.inference_mode()
    def execute(self, batch: RaggedBatch, lora_slots: list[int] | None = None) -> torch.Tensor:
        """Final hidden states of the tokens in `batch.logits_indices`, in that order;
        `lora_slots`: each batch row's LoRA slot (-1: the base model), None where no row has
        one."""
        if self.graphs is not None:
            hidden = self.graphs.run(batch, lora_slots)
            if hidden is not None:
                return hidden
        self.backend.plan(batch.meta)
        lora = None
        if lora_slots is not None:
            rows = zip(lora_slots, batch.meta.query_lens_host, strict=True)
            lora = self.model.lora_mapping(list(rows))
        hidden = self._forward(batch.input_ids, batch.positions, batch.meta, lora)
        return hidden[batch.logits_indices]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    # -- steps ----------------------------------------------------------------------------------

    def launch(self, step: ScheduledStep) -> LaunchedStep:
        """Queue the step's forward pass, its prompt scoring and its logits on the device;
        `sample` then queues its sampling."""
        rows, device = step.rows, self.device
        unfold = self.graphs is not None and replayable(rows, self.graphs.buckets[-1])
        batch = build_ragged_batch(rows, self.block_size, device, unfold)
        # Decode rows whose last token is still on the device read it from there (the first
        # of a row's tokens; rows come packed in order).
        pending, offset = [], 0
        for row in rows:
            if row.device_token:
                pending.append((offset, row.resident.ref.slot))
            offset += len(row.token_ids)
        if pending:
            positions, slots = to_device(pending, torch.int64, device).unbind(1)
            batch.input_ids[positions] = self.last_tokens[slots]
        lora_slots = None
        if self.model.max_loras:
            # One per row of the batch: a row verifying drafts (any row, unfolded) is packed as
            # one row per token.
            lora_slots = [
                r.resident.lora_slot
                for r in rows
                for _ in range(len(r.token_ids) if unfold or r.drafts else 1)
            ]
            if max(lora_slots) < 0:
                lora_slots = None
        hidden = self.execute(batch, lora_slots)
        # Hidden rows come in row order: all of a scoring row's tokens, else a sampler's last
        # (its last 1 + drafts where it verifies drafts).
        launched = LaunchedStep(step)
        sample_rows: list[int] = []
        offset = 0
        for i, row in enumerate(rows):
            if row.scores:
                kept = len(row.token_ids)
                launched.scores[i] = self._score(row, hidden[offset : offset + kept])
                if row.samples:
                    sample_rows.append(offset + kept - 1)
            else:
                kept = (1 + len(row.drafts)) if row.samples else 0
                sample_rows.extend(range(offset, offset + kept))
            offset += kept
        if sample_rows:
            if len(sample_rows) < hidden.shape[0]:  # some rows were kept for scoring
                hidden = hidden[to_device(sample_rows, torch.int64, device)]
            launched.logits = self.logits(hidden)
        return launched

    @staticmethod
    def constrained(launched: LaunchedStep) -> bool:
        """Whether a sampling row of the step is under a structured-outputs constraint."""
        return any(row.samples and row.resident.matcher is not None for row in launched.step.rows)

    def sample(self, launched: LaunchedStep) -> None:
        """Queue the sampling of a launched step. Constrained rows are masked by what their
        matchers allow now: with overlapped steps this runs after the step before has been
        taken in (its tokens advanced the matchers), while the device computes the forward."""
        if launched.logits is None:
            return
        samplers = [row for row in launched.step.rows if row.samples]
        # A row verifying drafts samples at each of its positions as plain decoding would there.
        sampling, firsts = [], []
        for row in samplers:
            firsts.append(len(sampling))
            params, index = row.resident.request.params, row.resident.index
            sampling += [
                SamplingRow(params, row.position + i, index) for i in range(1 + len(row.drafts))
            ]
        launched.sampled = self.sampler.sample(
            launched.logits, sampling, self._masks(samplers, firsts)
        )
        launched.logits = None
        # Each row's last pick: after its last draft where it verifies drafts, the token the
        # next row reads if every draft is accepted (else that row is void).
        slots = [row.resident.ref.slot for row in samplers]
        tokens = launched.sampled.tokens
        if len(firsts) < len(sampling):
            lasts = [first + len(row.drafts) for first, row in zip(firsts, samplers, strict=True)]
            slots_t, lasts_t = to_device([slots, lasts], torch.int64, self.device)
            tokens = tokens[lasts_t]
        else:
            slots_t = to_device(slots, torch.int64, self.device)
        self.last_tokens[slots_t] = tokens

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

    def _score(self, row: ScheduledRow, hidden: torch.Tensor) -> list[SampledRow]:
        """Log-probabilities of the prompt tokens a chunk predicts (position p predicts p + 1),
        from the hidden states of its tokens."""
        prompt, past = row.resident.prompt, row.past_len
        top_n = row.resident.request.params.prompt_logprobs or 0
        count = min(len(row.token_ids), len(prompt) - 1 - past)
        scored: list[SampledRow] = []
        for start in range(0, count, _SCORE_SLICE):
            end = min(count, start + _SCORE_SLICE)
            targets = prompt[past + start + 1 : past + end + 1]
            scored += self.sampler.score(self.logits(hidden[start:end]), targets, top_n)
        return scored

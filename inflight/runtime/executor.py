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
from inflight.model.hybrid import HybridForCausalLM
from inflight.model.layers.lora import LoRAMapping
from inflight.model.llama import LlamaForCausalLM, MediaEmbeds
from inflight.model.mamba import MambaRows, MambaStates
from inflight.model.transfer import to_device
from inflight.model.vision import prune_image_tokens
from inflight.runtime.batch_builder import RaggedBatch, build_ragged_batch
from inflight.runtime.cuda_graphs import DecodeGraphs, DecodeInputs, graph_buckets, replayable
from inflight.runtime.encoder_cache import EncoderCache
from inflight.runtime.media import mrope_positions, mrope_shift
from inflight.runtime.outputs import SampledRow
from inflight.runtime.request import MediaItem
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
    """One (key, value) pair per attention layer (a hybrid's Mamba layers keep no KV)."""
    shape = backend.kv_cache_shape(num_blocks, block_size, config.num_kv_heads, config.head_dim)
    layers = config.num_layers if config.mamba is None else config.mamba.num_attention_layers
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(layers)
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
        model: LlamaForCausalLM | HybridForCausalLM,
        kv_caches: list[KVCache],
        backend: AttentionBackend,
        sampler: Sampler,
        grammars: GrammarCompiler,
        *,
        block_size: int,
        max_batch_size: int,
        device: torch.device,
        pick_width: int = 1,
        graph_inputs: DecodeInputs | None = None,
        encoder_cache: EncoderCache | None = None,
        mamba_states: MambaStates | None = None,
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
        # Each slot's latest picks, where the next step reads its input token without a host
        # trip: the picks of its latest row (1 + drafts), then those of fallback rows.
        self.picks = torch.zeros((max_batch_size, pick_width), dtype=torch.int64, device=device)
        self.encoder_cache = encoder_cache
        self.encoders = model.media_encoders()
        # A hybrid model's recurrent states: a resident's slot is its state slot.
        self.mamba_states = mamba_states
        # M-RoPE models shift the rotary positions of the tokens after an image.
        self.mrope = model.config.rope.mrope_section is not None
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
        media: MediaEmbeds | None = None,
        mamba: MambaRows | None = None,
    ) -> torch.Tensor:
        if mamba is None:
            return self.model(input_ids, positions, self.kv_caches, meta, self.backend, lora, media)
        return self.model(
            input_ids,
            positions,
            self.kv_caches,
            meta,
            self.backend,
            lora,
            media,
            mamba=mamba,
            states=self.mamba_states,
        )

    @torch.inference_mode()
    def execute(
        self,
        batch: RaggedBatch,
        lora_slots: list[int] | None = None,
        media: MediaEmbeds | None = None,
        mamba: MambaRows | None = None,
    ) -> torch.Tensor:
        """Final hidden states of the tokens in `batch.logits_indices`, in that order;
        `lora_slots`: each batch row's LoRA slot (-1: the base model), None where no row has
        one; `media`: packed tokens whose input is an encoder's output (such a step runs
        eagerly); `mamba`: each row's state slot (hybrid models)."""
        if self.graphs is not None and media is None:
            hidden = self.graphs.run(batch, lora_slots, mamba)
            if hidden is not None:
                return hidden
        self.backend.plan(batch.meta)
        lora = None
        if lora_slots is not None:
            rows = zip(lora_slots, batch.meta.query_lens_host, strict=True)
            lora = self.model.lora_mapping(list(rows))
        hidden = self._forward(batch.input_ids, batch.positions, batch.meta, lora, media, mamba)
        return hidden[batch.logits_indices]

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

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    # -- steps ----------------------------------------------------------------------------------

    def launch(self, step: ScheduledStep) -> LaunchedStep:
        """Queue the step's forward pass, its prompt scoring and its logits on the device;
        `sample` then queues its sampling."""
        rows, device = step.rows, self.device
        # Only a model with media input looks for media in its steps.
        media = self._media_embeds(rows) if self.encoder_cache is not None else None
        # A hybrid's tokens of one sequence never run as separate decode rows: each would read
        # the same recurrent state.
        unfold = (
            self.graphs is not None
            and media is None
            and self.mamba_states is None
            and replayable(rows, self.graphs.buckets[-1])
        )
        shift = None
        if self.mrope and any(row.resident.request.media for row in rows):
            shift = np.concatenate(
                [
                    mrope_shift(row.resident.request.media, row.past_len, len(row.token_ids))
                    for row in rows
                ]
            )
        batch = build_ragged_batch(rows, self.block_size, device, unfold, shift)
        # Decode rows whose last token is still on the device read it from there (the first
        # of a row's tokens; rows come packed in order).
        pending, offset, width = [], 0, self.picks.shape[1]
        for row in rows:
            if row.device_token:
                pending.append((offset, row.resident.ref.slot * width + row.pick_index))
            offset += len(row.token_ids)
        if pending:
            positions, picks = to_device(pending, torch.int64, device).unbind(1)
            batch.input_ids[positions] = self.picks.view(-1)[picks]
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
        mamba = None
        if self.mamba_states is not None:
            # A row's first chunk starts its sequence's state from zero.
            slots = [row.resident.ref.slot for row in rows]
            mamba = MambaRows.build(slots, [row.past_len == 0 for row in rows], device)
        hidden = self.execute(batch, lora_slots, media, mamba)
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


def _kept(
    output: torch.Tensor | None, length: int
) -> tuple[torch.Tensor, np.ndarray | None] | None:
    """An item's encoder output as its prompt takes it: the tokens the visual-token pruner
    keeps (with their indices; None: all are kept)."""
    if output is None:
        return None
    kept = prune_image_tokens(output, length)
    return (output, None) if kept is None else (output[kept], kept.cpu().numpy())

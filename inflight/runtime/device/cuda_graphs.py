"""CUDA graphs for decode steps: one captured forward per bucketed batch size.

A decode-only step of B rows replays the graph of the smallest bucket >= B. A step with short
prefill chunks does too, packed as one decode row per token (`replayable` says when: the decode
kernel reads a row's keys once per token, so an unfolded chunk costs the device quadratically in
its length, where an eager step costs some 15-20 ms of host work whatever its length).

The inputs of the graphs live in static buffers: the step's rows are copied in, and the
bucket's spare rows are pointed at a scratch KV block that no resident owns (they decode a
dummy token there, and their output is dropped), so a replay never touches a resident's KV
beyond its own rows.

A model with LoRA slots is captured with its indexed side path reading each row's slot from a
static buffer (see `model/layers/lora.py`): one graph per bucket serves any mix of adapters and
the base. A hybrid Mamba model's rows read their state slots from a static buffer likewise, the
spare rows a scratch slot no resident owns. A model whose every position reads an embedding
(a speech talker) is captured reading them from a static buffer too.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from functools import partial

import torch

from inflight.model.contract import ForwardBatch, MediaEmbeds
from inflight.model.layers.lora import LoRAMapping
from inflight.model.layers.mamba import MambaRows
from inflight.model.metadata import AttentionMetadata
from inflight.model.transfer import to_device
from inflight.runtime.device.batch_builder import BatchRow, RaggedBatch

# The keys a step's unfolded prefill rows may read in all (a chunk of n tokens after p in KV
# reads n * p + n * (n + 1) / 2); larger prefills run eagerly. On an H200 (bench/RESULTS.md,
# bench/prefill_graphs.py) a step unfolding 133K keys replayed in 3.7 ms against 13.4 eagerly
# on SmolLM2-135M, 9.5 against 14.2 on the Llama-3.1-8B shape; at 557K the 8B one lost.
UNFOLD_KEYS = 128 * 1024


def graph_rows(max_batch_size: int, max_num_tokens: int) -> int:
    """The rows of the largest graph: every resident's decode row, and beyond that steps of up
    to 512 tokens (drafts or short prefills, one row per token); larger steps run eagerly."""
    return max(max_batch_size, min(max_num_tokens, 512))


def graph_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, every multiple of 16 up to 256, then of 64, up to (and including) max_batch."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += list(range(16, min(max_batch, 257), 16)) + list(range(320, max_batch, 64))
    return sorted({*sizes, max_batch})


def pick_bucket(buckets: list[int], rows: int) -> int | None:
    """The smallest bucket holding `rows` rows, or None when none does."""
    i = bisect_left(buckets, rows)
    return buckets[i] if i < len(buckets) else None


def replayable(rows: Sequence[BatchRow], max_rows: int) -> bool:
    """Whether the step, its rows unfolded to one decode row per token, fits a graph of
    `max_rows` rows with its prefill reading at most UNFOLD_KEYS keys."""
    tokens = keys = 0
    for row in rows:
        n = len(row.token_ids)
        tokens += n
        if n > 1 and not row.drafts:
            keys += n * row.past_len + n * (n + 1) // 2
    return tokens <= max_rows and keys <= UNFOLD_KEYS


def is_decode_only(meta: AttentionMetadata) -> bool:
    return meta.num_decodes == len(meta.query_lens_host)


class DecodeInputs:
    """The static input buffers of the captured graphs (any device; filled before each replay)."""

    def __init__(
        self,
        max_batch: int,
        max_blocks: int,
        block_size: int,
        scratch_block: int,
        device,
        lora: bool = False,
        scratch_state: int | None = None,
        window_scratch_block: int | None = None,
        embeds: tuple[int, torch.dtype] | None = None,
    ) -> None:
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.scratch_state = scratch_state
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        # The sliding layers' slots and tables, where the window group keeps their KV apart
        # (`window_scratch_block`: its pool's block for the spare rows).
        self.window_scratch_block = window_scratch_block
        self.window_slot_mapping = self.window_block_tables = None
        if window_scratch_block is not None:
            self.window_slot_mapping = torch.zeros_like(self.slot_mapping)
            self.window_block_tables = torch.zeros_like(self.block_tables)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        # Each row's LoRA slot (-1: the base model), where the model has LoRA slots.
        self.lora_slots = (
            torch.full((max_batch,), -1, dtype=torch.int32, device=device) if lora else None
        )
        # Each row's Mamba state slot, where the model is a hybrid (`scratch_state`: the slot
        # of spare rows).
        self.state_slots = (
            None
            if scratch_state is None
            else torch.full((max_batch,), scratch_state, dtype=torch.int64, device=device)
        )
        # Each row's input embedding, where the model reads embeddings (`embeds`: their width
        # and dtype), in place of its token's.
        self.embeds = self.embed_rows = None
        if embeds is not None:
            width, dtype = embeds
            self.embeds = torch.zeros(max_batch, width, dtype=dtype, device=device)
            self.embed_rows = torch.arange(max_batch, device=device)

    def fill(self, batch: ForwardBatch, bucket: int) -> None:
        """Copy a decode step's rows in (with each row's LoRA slot, -1 for the base model, and
        its state slot); park the bucket's spare rows on the scratch block (and the scratch
        state slot)."""
        rows = len(batch.input_ids)
        meta = batch.attention
        width = meta.block_tables.shape[1]
        self.input_ids[:rows].copy_(batch.input_ids)
        self.positions[:rows].copy_(batch.positions)
        self.slot_mapping[:rows].copy_(meta.slot_mapping)
        self.block_tables[:rows, :width].copy_(meta.block_tables)
        self.seq_lens[:rows].copy_(meta.seq_lens)
        if bucket > rows:
            self.input_ids[rows:bucket] = 0
            self.positions[rows:bucket] = 0
            self.slot_mapping[rows:bucket] = self.scratch_block * self.block_size
            self.block_tables[rows:bucket, 0] = self.scratch_block
            self.seq_lens[rows:bucket] = 1
        if self.window_slot_mapping is not None and self.window_block_tables is not None:
            window = meta.window
            assert window is not None and self.window_scratch_block is not None
            self.window_slot_mapping[:rows].copy_(window.slot_mapping)
            self.window_block_tables[:rows, :width].copy_(window.block_tables)
            if bucket > rows:
                scratch = self.window_scratch_block
                self.window_slot_mapping[rows:bucket] = scratch * self.block_size
                self.window_block_tables[rows:bucket, 0] = scratch
        if self.lora_slots is not None:
            self.lora_slots[:bucket] = -1
            lora = batch.lora
            if lora is not None:
                # The indexed form's slots are on the device already.
                slots = lora.token_slots
                if slots is None or lora.runs or slots.device != self.lora_slots.device:
                    slots = to_device(lora.row_slots(), torch.int32, self.lora_slots.device)
                self.lora_slots[:rows].copy_(slots)
        elif batch.lora is not None:
            raise ValueError("LoRA slots for graphs captured without LoRA")
        if self.state_slots is not None:
            mamba = batch.recurrent
            assert mamba is not None and not any(mamba.fresh_host)
            self.state_slots[:rows].copy_(mamba.slots)
            self.state_slots[rows:bucket] = self.scratch_state
        if self.embeds is not None:
            media = batch.media
            assert media is not None and len(media.indices) == rows
            self.embeds[:rows].copy_(media.embeds)
            self.embeds[rows:bucket] = 0

    def media(self, bucket: int) -> MediaEmbeds | None:
        """The embeddings the graph of `bucket` is captured with: its static rows'."""
        if self.embeds is None or self.embed_rows is None:
            return None
        return MediaEmbeds(self.embed_rows[:bucket], self.embeds[:bucket])

    def mamba(self, bucket: int) -> MambaRows | None:
        """The state slots the graph of `bucket` is captured with: its static rows'."""
        if self.state_slots is None:
            return None
        assert self.scratch_state is not None
        return MambaRows(self.state_slots[:bucket], [self.scratch_state] * bucket, [False] * bucket)

    def lora(self, bucket: int) -> LoRAMapping | None:
        """The mapping the graph of `bucket` is captured with: its static rows' slots."""
        if self.lora_slots is None:
            return None
        return LoRAMapping(bucket, token_slots=self.lora_slots[:bucket])

    def metadata(self, bucket: int) -> AttentionMetadata:
        """Attention metadata over the first `bucket` rows of the buffers (decode rows only)."""
        meta = self._metadata(bucket, self.block_tables, self.slot_mapping)
        if self.window_slot_mapping is not None and self.window_block_tables is not None:
            meta.window = self._metadata(bucket, self.window_block_tables, self.window_slot_mapping)
        return meta

    def _metadata(
        self, bucket: int, block_tables: torch.Tensor, slot_mapping: torch.Tensor
    ) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=block_tables[:bucket],
            slot_mapping=slot_mapping[:bucket],
            num_decodes=bucket,
            block_size=self.block_size,
            max_query_len=1,
            max_seq_len=0,  # unknown at capture; the decode kernel reads seq_lens instead
            query_lens_host=[1] * bucket,
            seq_lens_host=[],
            contiguous_kv_host=[],
        )


class DecodeGraphs:
    """Captured decode forwards, one per bucket; `run` replays the right one."""

    def __init__(
        self,
        forward: Callable[[ForwardBatch], torch.Tensor],
        inputs: DecodeInputs,
        buckets: list[int],
    ) -> None:
        self.inputs = inputs
        self.buckets = buckets
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None  # made by the first capture: every graph shares its memory
        for bucket in reversed(buckets):  # the largest first, so the rest reuse its memory
            captured = ForwardBatch(
                inputs.input_ids[:bucket],
                inputs.positions[:bucket],
                inputs.metadata(bucket),
                lora=inputs.lora(bucket),
                media=inputs.media(bucket),
                recurrent=inputs.mamba(bucket),
            )
            self._graphs[bucket] = self._capture(partial(forward, captured))

    def _capture(
        self, forward: Callable[[], torch.Tensor]
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The graph of one bucket's forward, and the output tensor its replays write."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        forward()  # warm-up (and Triton compilation) outside the graph
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden = forward()
        torch.cuda.synchronize()
        return graph, hidden

    def run(self, batch: RaggedBatch) -> torch.Tensor | None:
        """Final hidden states of the tokens in `batch.logits_indices`, or None when no graph
        fits the step (for a hybrid, one that starts a sequence's state too; one with media
        embeddings, but where every row reads an embedding from the graphs' buffer)."""
        forward = batch.forward
        mamba = forward.recurrent
        if not is_decode_only(forward.attention) or (mamba is not None and any(mamba.fresh_host)):
            return None
        media = forward.media
        if (media is None) != (self.inputs.embeds is None):
            return None
        if media is not None and (
            len(media.indices) != len(forward.input_ids) or media.mrope_positions is not None
        ):
            return None
        rows = len(forward.input_ids)
        bucket = pick_bucket(self.buckets, rows)
        if bucket is None:
            return None
        self.inputs.fill(forward, bucket)
        graph, hidden = self._graphs[bucket]
        graph.replay()
        if len(batch.logits_indices) == rows:
            return hidden[:rows]
        return hidden[batch.logits_indices]

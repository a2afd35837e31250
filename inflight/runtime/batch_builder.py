"""Packs one step's rows into the flat tensors and attention metadata of a ragged forward pass."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from inflight.model.attention import AttentionMetadata


@dataclass(frozen=True)
class RowInput:
    """One resident's work in a step: `token_ids` computed after `past_len` tokens already in KV."""

    token_ids: Sequence[int]
    past_len: int
    block_table: Sequence[int]
    samples: bool  # select this row's last token's hidden state
    scores: bool = False  # select every token's hidden state (scoring a prompt)


@dataclass
class RaggedBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    # Packed indices of the tokens whose hidden states the step keeps: every token of a scoring
    # row, else the last token of a sampling row; in row order.
    logits_indices: torch.Tensor


def build_ragged_batch(
    rows: Sequence[RowInput], block_size: int, device: torch.device
) -> RaggedBatch:
    """Rows must come decode-first: the leading rows of one query token form the decode group."""
    if not rows:
        raise ValueError("a step needs at least one row")
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    query_lens: list[int] = []
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    for row in rows:
        n = len(row.token_ids)
        if n < 1:
            raise ValueError("a row must compute at least one token")
        seq_len = row.past_len + n
        if -(-seq_len // block_size) > len(row.block_table):
            raise ValueError(
                f"a row of {seq_len} tokens overflows its {len(row.block_table)} blocks"
            )
        input_ids.extend(row.token_ids)
        for pos in range(row.past_len, seq_len):
            positions.append(pos)
            slots.append(row.block_table[pos // block_size] * block_size + pos % block_size)
        starts.append(starts[-1] + n)
        query_lens.append(n)
        seq_lens.append(seq_len)
        if row.scores:
            logits_indices.extend(range(starts[-2], starts[-1]))
        elif row.samples:
            logits_indices.append(starts[-1] - 1)
    contiguous = []
    for row, seq_len in zip(rows, seq_lens, strict=True):
        used = row.block_table[: -(-seq_len // block_size)]
        first = used[0]
        runs = all(b == first + i for i, b in enumerate(used))
        contiguous.append(first * block_size if runs else None)
    num_decodes = 0
    while num_decodes < len(rows) and query_lens[num_decodes] == 1:
        num_decodes += 1
    width = -(-max(seq_lens) // block_size)
    tables = [
        list(r.block_table[:width]) + [0] * (width - min(width, len(r.block_table))) for r in rows
    ]

    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    meta = AttentionMetadata(
        query_start_loc=tensor(starts, torch.int32),
        seq_lens=tensor(seq_lens, torch.int32),
        block_tables=tensor(tables, torch.int32),
        slot_mapping=tensor(slots, torch.int64),
        num_decodes=num_decodes,
        block_size=block_size,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_host=query_lens,
        seq_lens_host=seq_lens,
        contiguous_kv_host=contiguous,
    )
    return RaggedBatch(
        input_ids=tensor(input_ids, torch.int64),
        positions=tensor(positions, torch.int64),
        meta=meta,
        logits_indices=tensor(logits_indices, torch.int64),
    )

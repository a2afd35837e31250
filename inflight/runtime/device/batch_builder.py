"""Packs one step's rows into the flat tensors and attention metadata of a ragged forward pass.

A row verifying speculative drafts (its last token and the drafts after it) is packed as one
decode row per token, token i seeing the keys before the row and its own first i + 1: exactly
the causal attention of the row, computed as plain decode rows are (the same kernels and bits,
and a step of decode and verifying rows alone replays the captured decode graphs). Asked to
`unfold`, every row is packed so, prefill chunks too: a step with a short prefill then replays
a decode graph instead of running eagerly."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import chain
from typing import Protocol

import numpy as np
import torch

from inflight.model.contract import ForwardBatch
from inflight.model.metadata import AttentionMetadata
from inflight.model.transfer import to_device_packed


class BatchRow(Protocol):
    """One sequence's work in a step: `token_ids` computed after `past_len` tokens already in KV
    (the scheduler's `ScheduledRow`, or a `RowInput` for a forward pass run by hand)."""

    token_ids: Sequence[int]
    past_len: int
    samples: bool  # select this row's last token's hidden state
    scores: bool  # select every token's hidden state (scoring a prompt)
    drafts: Sequence[int]  # speculative drafts ending `token_ids` (a sampling decode row)

    @property
    def block_table(self) -> Sequence[int]: ...

    @property
    def window_table(self) -> Sequence[int] | None:
        """The sliding layers' blocks, where they are in a pool of their own (else None)."""
        ...


@dataclass(slots=True)
class RowInput:
    """A `BatchRow` for a forward pass run outside a session (tests, benchmarks)."""

    token_ids: Sequence[int]
    past_len: int
    block_table: Sequence[int]
    samples: bool
    scores: bool = False
    drafts: Sequence[int] = ()
    window_table: Sequence[int] | None = None


@dataclass
class RaggedBatch:
    """The forward pass's batch (rotary positions: each token's index in its sequence, but for
    M-RoPE), the packed indices of the tokens whose hidden states the step keeps (every token
    of a scoring row, else the last token of a sampling row; in row order), and for each packed
    row the index of the step's row it comes from (an unfolded row packs as several)."""

    forward: ForwardBatch
    logits_indices: torch.Tensor
    row_index: list[int]


def build_ragged_batch(
    rows: Sequence[BatchRow],
    block_size: int,
    device: torch.device,
    unfold: bool = False,
) -> RaggedBatch:
    """Rows must come decode-first: the leading rows of one query token form the decode group,
    rows verifying drafts right after them. `unfold`: pack every token as a decode row.

    Host work is a few operations per row; everything per token or per block is vectorized."""
    if not rows:
        raise ValueError("a step needs at least one row")
    row_index = list(range(len(rows)))
    if any(len(r.token_ids) > 1 and (unfold or r.drafts) for r in rows):
        row_index, rows = map(list, zip(*_unfold(rows, unfold), strict=True))
    query_lens = np.fromiter((len(r.token_ids) for r in rows), np.int64, len(rows))
    past = np.fromiter((r.past_len for r in rows), np.int64, len(rows))
    if query_lens.min() < 1:
        raise ValueError("a row must compute at least one token")
    seq_lens = past + query_lens
    needed = -(-seq_lens // block_size)
    have = np.fromiter((len(r.block_table) for r in rows), np.int64, len(rows))
    if (needed > have).any():
        i = int(np.argmax(needed > have))
        raise ValueError(f"a row of {seq_lens[i]} tokens overflows its {have[i]} blocks")
    starts = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(query_lens, out=starts[1:])
    total = int(starts[-1])
    row_of = np.repeat(np.arange(len(rows)), query_lens)
    positions = np.arange(total) - np.repeat(starts[:-1] - past, query_lens)
    layout = (needed, row_of, positions, block_size)
    tables, slots, contiguous = _tables([r.block_table for r in rows], *layout)
    # The sliding layers' own tables, where the window group keeps their KV apart.
    window = None
    if rows[0].window_table is not None:
        window_tables = [r.window_table for r in rows]
        assert all(table is not None for table in window_tables)
        window = _tables(window_tables, *layout)
    input_ids = np.fromiter(chain.from_iterable(r.token_ids for r in rows), np.int64, total)
    if any(r.scores for r in rows):
        logits_indices = []
        for i, row in enumerate(rows):
            if row.scores:
                logits_indices.extend(range(starts[i], starts[i + 1]))
            elif row.samples:
                logits_indices.append(starts[i + 1] - 1)
    else:
        samples = np.fromiter((r.samples for r in rows), bool, len(rows))
        logits_indices = starts[1:][samples] - 1
    num_decodes = int(np.argmin(query_lens == 1)) if (query_lens != 1).any() else len(rows)

    # Two copies to the device, one per dtype (the window group's tables and slots in them).
    extra = () if window is None else (window[0],)
    query_start_loc, seq_lens_t, tables_t, *window_tables_t = to_device_packed(
        [starts, seq_lens, tables, *extra], torch.int32, device
    )
    extra = () if window is None else (window[1],)
    input_ids_t, positions_t, slots_t, logits_t, *window_slots_t = to_device_packed(
        [input_ids, positions, slots, np.asarray(logits_indices, np.int64), *extra],
        torch.int64,
        device,
    )
    meta = AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens_t,
        block_tables=tables_t,
        slot_mapping=slots_t,
        num_decodes=num_decodes,
        block_size=block_size,
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_lens_host=query_lens.tolist(),
        seq_lens_host=seq_lens.tolist(),
        contiguous_kv_host=contiguous,
    )
    if window is not None:
        meta.window = replace(
            meta,
            block_tables=window_tables_t[0],
            slot_mapping=window_slots_t[0],
            contiguous_kv_host=window[2],
        )
    return RaggedBatch(ForwardBatch(input_ids_t, positions_t, meta), logits_t, row_index)


def _tables(
    row_tables: Sequence[Sequence[int]],
    needed: np.ndarray,
    row_of: np.ndarray,
    positions: np.ndarray,
    block_size: int,
) -> tuple[np.ndarray, np.ndarray, list[int | None]]:
    """The rows' block tables [rows, the most blocks a row needs], the KV slot of each packed
    token, and each row's first slot where its blocks in use are consecutive (it then reads its
    KV in place), else None."""
    width = int(needed.max())
    tables = np.zeros((len(row_tables), width), np.int64)
    for i, table in enumerate(row_tables):
        tables[i, : needed[i]] = table[: needed[i]]
    slots = tables[row_of, positions // block_size] * block_size + positions % block_size
    columns = np.arange(width)
    consecutive = (tables == tables[:, :1] + columns) | (columns >= needed[:, None])
    contiguous = [
        int(tables[i, 0]) * block_size if ok else None
        for i, ok in enumerate(consecutive.all(axis=1).tolist())
    ]
    return tables, slots, contiguous


def _unfold(rows: Sequence[BatchRow], every_row: bool) -> Iterator[tuple[int, BatchRow]]:
    """Each row verifying drafts (with `every_row`, each row) as one decode row per token, with
    the index of the row it comes from; the rows' hidden states kept as packing them whole
    keeps them: every token of a scoring or verifying row, the last of a sampling one."""
    for index, row in enumerate(rows):
        if len(row.token_ids) == 1 or not (every_row or row.drafts):
            yield index, row
            continue
        table, last = row.block_table, len(row.token_ids) - 1
        keep_all = row.scores or bool(row.drafts)
        for i, token in enumerate(row.token_ids):
            keep = keep_all or (row.samples and i == last)
            yield (
                index,
                RowInput((token,), row.past_len + i, table, keep, window_table=row.window_table),
            )

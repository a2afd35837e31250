"""What the CUDA backend plans once per step for every layer's attention (CPU-testable): the
prefill programs (on the host) and the order the decode programs take their rows in."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from inflight.model.transfer import to_device

PREFILL_BLOCK_M = 64  # queries per prefill program
# Decode programs to aim for per multiprocessor: below this a step's decode rows split their keys.
DECODE_PROGRAMS_PER_SM = 8
MAX_DECODE_SPLITS = 16


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The device's multiprocessors, which split work aims to fill (a driver query, once a
    device). Triton's interpreter on the CPU (the tests) has none to fill: 1."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_splits(rows: int, kv_heads: int, multiprocessors: int) -> int:
    """How many parts each decode row's keys are split into (a power of two): one program per
    (row, KV head) walks its keys alone, so a step of few rows over long contexts would leave
    most of the GPU idle; split, the parts run side by side and a second kernel merges them."""
    programs = rows * kv_heads
    splits = 1
    while splits < MAX_DECODE_SPLITS and programs * splits * 2 <= (
        multiprocessors * DECODE_PROGRAMS_PER_SM
    ):
        splits *= 2
    return splits


@dataclass(frozen=True)
class PrefillPlan:
    """Program p attends queries [starts[p], starts[p] + block_m) of chunk rows[p]."""

    programs: int
    block_m: int
    rows: torch.Tensor  # [programs] int32: the ragged batch row of each program
    starts: torch.Tensor  # [programs] int32: its first query, counted within the row's chunk
    query_lens: torch.Tensor  # [rows] int32: every row's query length


def plan_prefill(
    query_lens: list[int], num_decodes: int, device: torch.device, block_m: int = PREFILL_BLOCK_M
) -> PrefillPlan:
    """Cover every query of the rows after the decode rows with BLOCK_M-sized programs."""
    rows: list[int] = []
    starts: list[int] = []
    for row in range(num_decodes, len(query_lens)):
        for start in range(0, query_lens[row], block_m):
            rows.append(row)
            starts.append(start)

    def tensor(values: list[int]) -> torch.Tensor:
        return to_device(values, torch.int32, device)

    return PrefillPlan(len(rows), block_m, tensor(rows), tensor(starts), tensor(query_lens))


@dataclass(frozen=True)
class StepPlan:
    """`prefill`: None in a step of decode rows only. `decode_order` [num_decodes] int64: the
    decode rows longest first, so that a step's last wave of programs is of short rows (a
    device op, sorting the rows' lengths where they are: a captured graph replays it)."""

    prefill: PrefillPlan | None
    decode_order: torch.Tensor | None


def plan_step(
    query_lens: list[int], num_decodes: int, seq_lens: torch.Tensor, device: torch.device
) -> StepPlan:
    """The step's plan: `query_lens` and `seq_lens` of every row, the first `num_decodes` of
    them decode rows."""
    prefill = None
    if len(query_lens) > num_decodes:
        prefill = plan_prefill(query_lens, num_decodes, device)
    order = None
    if num_decodes:
        order = torch.argsort(seq_lens[:num_decodes], descending=True)
    return StepPlan(prefill, order)

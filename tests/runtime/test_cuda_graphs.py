"""The CUDA-graph bookkeeping of decode steps, checked on the CPU (no capture happens here)."""

import pytest
import torch

from inflight.runtime.batch_builder import RowInput, build_ragged_batch
from inflight.runtime.cuda_graphs import DecodeInputs, graph_buckets, is_decode_only, pick_bucket

CPU = torch.device("cpu")


def test_buckets_and_their_choice():
    assert graph_buckets(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert graph_buckets(1) == [1]
    buckets = graph_buckets(64)
    assert [pick_bucket(buckets, n) for n in (1, 3, 8, 9, 17, 64)] == [1, 4, 8, 16, 32, 64]
    assert pick_bucket(buckets, 65) is None


def test_only_decode_steps_replay():
    decode = build_ragged_batch([RowInput([5], 9, [0], True), RowInput([6], 3, [1], True)], 16, CPU)
    mixed = build_ragged_batch(
        [RowInput([5], 9, [0], True), RowInput([1, 2], 0, [1], True)], 16, CPU
    )
    not_sampling = build_ragged_batch([RowInput([5], 9, [0], False)], 16, CPU)
    assert is_decode_only(decode)
    assert not is_decode_only(mixed) and not is_decode_only(not_sampling)


def test_fill_copies_rows_and_parks_spare_rows_on_the_scratch_block():
    inputs = DecodeInputs(max_batch=8, max_blocks=4, block_size=16, scratch_block=99, device=CPU)
    # A previous, larger step left its rows behind.
    big = build_ragged_batch([RowInput([7], 40, [3, 4, 5], True)] * 6, 16, CPU)
    inputs.fill(big, 8)
    batch = build_ragged_batch(
        [RowInput([11], 20, [5, 6], True), RowInput([12], 2, [9], True)], 16, CPU
    )
    inputs.fill(batch, 4)
    assert inputs.input_ids[:4].tolist() == [11, 12, 0, 0]
    assert inputs.positions[:4].tolist() == [20, 2, 0, 0]
    assert inputs.slot_mapping[:4].tolist() == [6 * 16 + 4, 9 * 16 + 2, 99 * 16, 99 * 16]
    assert inputs.seq_lens[:4].tolist() == [21, 3, 1, 1]
    assert inputs.block_tables[:2, :2].tolist() == [[5, 6], [9, 0]]
    assert inputs.block_tables[2:4, 0].tolist() == [99, 99]
    meta = inputs.metadata(4)
    assert meta.num_decodes == 4 and meta.slot_mapping.shape == (4,)


def test_fill_writes_each_rows_lora_slot_and_parks_spare_rows_on_the_base():
    inputs = DecodeInputs(
        max_batch=8, max_blocks=4, block_size=16, scratch_block=99, device=CPU, lora=True
    )
    rows = [RowInput([11], 20, [5, 6], True)] * 3
    inputs.fill(build_ragged_batch(rows * 2, 16, CPU), 8, [2, 2, 2, 2, 2, 2])
    inputs.fill(build_ragged_batch(rows, 16, CPU), 4, [1, -1, 0])
    assert inputs.lora_slots[:4].tolist() == [1, -1, 0, -1]
    mapping = inputs.lora(4)
    assert mapping.num_tokens == 4
    assert mapping.token_slots.data_ptr() == inputs.lora_slots.data_ptr()
    inputs.fill(build_ragged_batch(rows, 16, CPU), 4)  # no row on an adapter
    assert inputs.lora_slots[:4].tolist() == [-1] * 4  # the rows the graph of bucket 4 reads
    plain = DecodeInputs(max_batch=8, max_blocks=4, block_size=16, scratch_block=99, device=CPU)
    assert plain.lora(4) is None
    with pytest.raises(ValueError, match="LoRA slots for graphs captured without LoRA"):
        plain.fill(build_ragged_batch(rows, 16, CPU), 4, [0, -1, -1])

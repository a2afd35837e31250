"""The CUDA backend's planning of a step (runs on the CPU): prefill programs, decode order."""

import pytest
import torch

from inflight.model.kernels.triton.plan import decode_splits, plan_prefill, plan_step
from inflight.runtime.runtime import DeploymentOptions, Runtime


def test_programs_cover_every_prefill_query_once():
    query_lens = [1, 1, 1, 130, 64, 1, 65]  # three decode rows, then prefill chunks
    plan = plan_prefill(query_lens, num_decodes=3, device=torch.device("cpu"), block_m=64)
    covered = []
    for row, start in zip(plan.rows.tolist(), plan.starts.tolist(), strict=True):
        assert row >= 3  # decode rows have their own kernel
        covered += [(row, q) for q in range(start, min(start + 64, query_lens[row]))]
    expected = [(row, q) for row in range(3, 7) for q in range(query_lens[row])]
    assert sorted(covered) == expected and len(covered) == len(set(covered))
    assert plan.programs == 3 + 1 + 1 + 2
    assert plan.query_lens.tolist() == query_lens


def test_a_decode_only_step_has_no_prefill_programs():
    plan = plan_prefill([1, 1, 1], num_decodes=3, device=torch.device("cpu"))
    assert plan.programs == 0
    step = plan_step([1, 1, 1], 3, torch.tensor([5, 9, 2]), torch.device("cpu"))
    assert step.prefill is None


def test_decode_rows_are_ordered_longest_first_and_prefill_rows_are_left_out():
    seq_lens = torch.tensor([40, 900, 41, 7, 300, 12])  # 4 decode rows, then 2 prefill chunks
    step = plan_step([1, 1, 1, 1, 60, 12], 4, seq_lens, torch.device("cpu"))
    assert step.decode_order.tolist() == [1, 2, 0, 3]
    assert step.prefill.programs == 2
    assert plan_step([30], 0, torch.tensor([30]), torch.device("cpu")).decode_order is None


def test_triton_backend_needs_cuda(tiny_dirs):
    with pytest.raises(ValueError, match="CUDA"):
        Runtime(tiny_dirs["llama"], DeploymentOptions(device="cpu", attention_backend="triton"))
    with pytest.raises(ValueError, match="attention_backend"):
        DeploymentOptions(attention_backend="flash")


def test_decode_rows_split_their_keys_only_when_few():
    # 132 multiprocessors (an H200), 8 KV heads: 1,056 programs is the aim.
    assert decode_splits(256, 8, 132) == 1
    assert decode_splits(132, 8, 132) == 1
    assert decode_splits(66, 8, 132) == 2
    assert decode_splits(8, 8, 132) == 16  # capped
    assert decode_splits(1, 1, 132) == 16
    assert decode_splits(33, 8, 132) == 4


def test_fp8_kv_cache_is_refused_where_no_triton_backend_runs_it(tiny_dirs):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8"):
        DeploymentOptions(kv_cache_dtype="float16")
    # The deployment plan names the device and backend it found, whichever the user left open.
    for options in (
        DeploymentOptions(device="cpu", kv_cache_dtype="fp8"),
        DeploymentOptions(attention_backend="torch", kv_cache_dtype="fp8"),
        DeploymentOptions(kv_cache_dtype="fp8"),
    ):
        with pytest.raises(ValueError, match="kv_cache_dtype='fp8' needs a CUDA device"):
            Runtime(tiny_dirs["llama"], options)

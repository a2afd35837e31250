"""The model runner on its own (no scheduler, executor or session): built as the runtime builds
it, its forward pass over a ragged batch of two rows (both prefilling, then both decoding over
the KV the prefill wrote) gives the last positions' logits of transformers' forward of the same
checkpoint (CPU, float32)."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from inflight.model.checkpoints.loader import open_checkpoint
from inflight.protocol.deployment import DeploymentOptions
from inflight.runtime.deployment import MachineFacts, model_facts, resolve
from inflight.runtime.device.batch_builder import RowInput, build_ragged_batch
from inflight.runtime.device.model_runner import build_model_runner

TOL = 1e-4  # float32 against transformers in float64 (as tests/model/test_hf_parity.py)
CPU = torch.device("cpu")
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France",
]


def _runner(path, **options):
    """The runner of a CPU float32 deployment of the checkpoint at `path`, and its checkpoint."""
    checkpoint = open_checkpoint(path)
    facts = model_facts(checkpoint.config)
    deployment = DeploymentOptions(
        max_batch_size=2, max_model_len=64, quantization="none", **options
    )
    plan = resolve(deployment, facts, MachineFacts())
    return build_model_runner(checkpoint, plan, torch.float32, CPU), checkpoint, plan


@pytest.fixture(scope="module")
def llama(tiny_dirs):
    hf = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], dtype=torch.float32)
    return tiny_dirs["llama"], copy.deepcopy(hf).double().eval()


def _hf_last_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids]), logits_to_keep=1).logits[0, -1]


def _step(runner, rows):
    """The logits of the rows' kept positions (each sampling row's last token)."""
    batch = build_ragged_batch(rows, runner.block_size, runner.device)
    return runner.logits(runner.execute(batch))


def test_prefill_then_decode_of_two_rows_matches_transformers(llama):
    path, hf = llama
    runner, checkpoint, plan = _runner(path)
    assert runner.device == CPU and runner.block_size == plan.block_size == 16
    assert runner.graphs is None and not runner.recurrent  # CPU: eager forward, no Mamba state
    prompts = [checkpoint.tokenizer.encode(p) for p in PROMPTS]
    assert len(prompts[0]) != len(prompts[1])  # a ragged batch
    # Each row's blocks, apart and not from block 0: the block tables are what address the KV.
    tables = [[3, 1, 4], [0, 5, 2]]
    rows = [RowInput(ids, 0, table, True) for ids, table in zip(prompts, tables, strict=True)]
    logits = _step(runner, rows)
    assert logits.shape == (2, checkpoint.config.vocab_size) and logits.dtype == torch.float32
    sequences = [list(ids) for ids in prompts]
    for row, seq in zip(logits, sequences, strict=True):
        assert (row.double() - _hf_last_logits(hf, seq)).abs().max().item() < TOL
    # Decode: one token per row after the KV the prefill wrote (the greedy picks of the
    # reference), six steps: the shorter row crosses into its second block.
    assert len(prompts[1]) <= 16 < len(prompts[1]) + 6
    for _ in range(6):
        for seq, row in zip(sequences, logits, strict=True):
            seq.append(int(row.argmax()))
        rows = [
            RowInput([seq[-1]], len(seq) - 1, table, True)
            for seq, table in zip(sequences, tables, strict=True)
        ]
        logits = _step(runner, rows)
        for row, seq in zip(logits, sequences, strict=True):
            assert (row.double() - _hf_last_logits(hf, seq)).abs().max().item() < TOL


def test_a_chunked_prefill_beside_another_row_matches_transformers(llama):
    """A prompt's first chunk alone, then its rest beside another row's whole prompt: each
    row reads its own KV only, and the logits are transformers' of its whole sequence."""
    path, hf = llama
    runner, checkpoint, _ = _runner(path)
    ids = checkpoint.tokenizer.encode(PROMPTS[0])
    other = checkpoint.tokenizer.encode(PROMPTS[1])
    # The first chunk alone, then its rest beside another row's whole prompt.
    cut = len(ids) // 2
    first = _step(runner, [RowInput(ids[:cut], 0, [5, 6, 7], True)])
    assert (first[0].double() - _hf_last_logits(hf, ids[:cut])).abs().max().item() < TOL
    rest = _step(
        runner, [RowInput(ids[cut:], cut, [5, 6, 7], True), RowInput(other, 0, [0, 1], True)]
    )
    assert (rest[0].double() - _hf_last_logits(hf, ids)).abs().max().item() < TOL
    assert (rest[1].double() - _hf_last_logits(hf, other)).abs().max().item() < TOL


def test_scoring_rows_keep_every_position(llama):
    """A scoring row (prompt logprobs) keeps every token's hidden state: the logits at every
    prompt position match transformers'."""
    path, hf = llama
    runner, checkpoint, _ = _runner(path)
    ids = checkpoint.tokenizer.encode(PROMPTS[1])
    rows = [RowInput([7], 0, [0], True), RowInput(ids, 0, [1, 2], True, scores=True)]
    logits = _step(runner, rows)
    assert logits.shape[0] == 1 + len(ids)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    assert (logits[1:].double() - want).abs().max().item() < TOL
    assert (logits[0].double() - _hf_last_logits(hf, [7])).abs().max().item() < TOL


def test_a_cpu_runner_keeps_freed_memory_from_before_its_weights_load(tiny_dirs, monkeypatch):
    """glibc's thresholds (host_allocator.py) are set before the load, whose freed memory then
    serves the steps."""
    from inflight.runtime.device import model_runner

    calls = []
    build_model = model_runner.build_model

    def recording_build(*args, **kwargs):
        calls.append("load")
        return build_model(*args, **kwargs)

    monkeypatch.setattr(model_runner, "keep_freed_memory", lambda: calls.append("keep"))
    monkeypatch.setattr(model_runner, "build_model", recording_build)
    _runner(tiny_dirs["llama"])
    assert calls == ["keep", "load"]

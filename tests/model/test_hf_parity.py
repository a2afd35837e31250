"""Logits and greedy continuations match HF transformers on the same weights (CPU, float32)."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from inflight.runtime.batch_builder import RowInput, build_ragged_batch
from inflight.runtime.request import GenerationRequest, SamplingParams
from inflight.runtime.runtime import Runtime, RuntimeConfig

from tiny_models import FAMILIES

PROMPT = "The quick brown fox jumps over the lazy dog. In-flight batching"
TOL = 1e-4


def _hf_last_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids]), logits_to_keep=1).logits[0, -1]


def _last_logits(runtime, row):
    runner = runtime.runner
    batch = build_ragged_batch([row], runtime.blocks.block_size, runtime.device)
    return runner.logits(runner.execute(batch))[0]


def _check_logits(runtime, hf, ids, decode_steps=16):
    """Prefill, then decode `decode_steps` tokens (the reference's greedy picks) through the paged
    KV cache; the last-position logits match the reference at every step.

    The reference is HF's model on the same weights computed in float64, so that the check
    measures our float32 error alone: HF's own float32 run is itself up to ~4e-5 off the float64
    logits of SmolLM2, and the two float32 errors add up."""
    hf = copy.deepcopy(hf).double()
    blocks = runtime.blocks.allocate(runtime.blocks.blocks_for(len(ids) + decode_steps))
    try:
        ours = _last_logits(runtime, RowInput(ids, 0, blocks, True))
        ref = _hf_last_logits(hf, ids)
        assert (ours.double() - ref).abs().max().item() < TOL
        seq = list(ids)
        for _ in range(decode_steps):
            seq.append(int(ref.argmax()))
            ours = _last_logits(runtime, RowInput(seq[-1:], len(seq) - 1, blocks, True))
            ref = _hf_last_logits(hf, seq)
            assert (ours.double() - ref).abs().max().item() < TOL
    finally:
        runtime.blocks.release(blocks)


def _hf_greedy(hf, ids, n):
    seq = list(ids)
    for _ in range(n):
        seq.append(int(_hf_last_logits(hf, seq).argmax()))
    return seq[len(ids) :]


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_family_matches_transformers(family, tiny_dirs):
    hf = AutoModelForCausalLM.from_pretrained(tiny_dirs[family], dtype=torch.float32).eval()
    runtime = Runtime(tiny_dirs[family], RuntimeConfig(max_batch_size=2, max_model_len=256))
    ids = runtime.tokenizer.encode(PROMPT)
    _check_logits(runtime, hf, ids)
    out = runtime.handle_request(
        GenerationRequest(ids, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
    ).result()
    assert list(out.token_ids) == _hf_greedy(hf, ids, 48)
    assert runtime.blocks.num_free == runtime.blocks.num_blocks


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers(smollm, hf_smollm):
    ids = smollm.tokenizer.encode("The history of the Roman Empire begins")
    _check_logits(smollm, hf_smollm, ids)
    out = smollm.handle_request(
        GenerationRequest(ids, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
    ).result()
    assert list(out.token_ids) == _hf_greedy(hf_smollm, ids, 48)


@pytest.mark.slow
def test_logprobs_match_reference_log_softmax(smollm, hf_smollm):
    ids = smollm.tokenizer.encode("Water boils at a temperature of")
    out = smollm.handle_request(
        GenerationRequest(ids, SamplingParams(max_tokens=8, temperature=0, logprobs=5))
    ).result()
    seq = list(ids)
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        ref = torch.log_softmax(_hf_last_logits(hf_smollm, seq), dim=-1)
        assert entry.token_id == token
        assert entry.logprob <= 0
        assert abs(entry.logprob - ref[token].item()) < TOL
        top = [t.logprob for t in entry.top]
        assert len(top) == 5 and top == sorted(top, reverse=True)
        assert all(lp <= 0 for lp in top)
        assert [t.token_id for t in entry.top] == ref.topk(5).indices.tolist()
        seq.append(token)

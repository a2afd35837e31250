"""Logits and greedy continuations match HF transformers on the same weights (CPU, float32,
quantization "none")."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from inflight.model.attention import select_backend
from inflight.model.checkpoints.loader import build_model, open_checkpoint

from helpers import PagedSequence
from tiny_models import FAMILIES

PROMPT = "The quick brown fox jumps over the lazy dog. In-flight batching"
TOL = 1e-4


def _float32_model(path):
    """The float32 model and the attention backend the runtime picks for it on the CPU."""
    checkpoint = open_checkpoint(path)
    cpu = torch.device("cpu")
    model = build_model(checkpoint, torch.float32, cpu, 256, quantization="none")
    return checkpoint, model, select_backend(None, cpu, torch.float32, checkpoint.config.head_dim)


def _hf_last_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids]), logits_to_keep=1).logits[0, -1]


def _check_logits(model, backend, hf, ids, decode_steps=16):
    """Prefill, then decode `decode_steps` tokens (the reference's greedy picks) through the paged
    KV cache; the last-position logits match the reference at every step.

    The reference is HF's model on the same weights computed in float64, so that the check
    measures our float32 error alone: HF's own float32 run is itself up to ~4e-5 off the float64
    logits of SmolLM2, and the two float32 errors add up."""
    hf = copy.deepcopy(hf).double()
    sequence = PagedSequence(model, backend, len(ids) + decode_steps)
    ours = sequence.extend(ids)[-1]
    ref = _hf_last_logits(hf, ids)
    assert (ours.double() - ref).abs().max().item() < TOL
    seq = list(ids)
    for _ in range(decode_steps):
        seq.append(int(ref.argmax()))
        ours = sequence.extend(seq[-1:])[-1]
        ref = _hf_last_logits(hf, seq)
        assert (ours.double() - ref).abs().max().item() < TOL


def _hf_greedy(hf, ids, n):
    seq = list(ids)
    for _ in range(n):
        seq.append(int(_hf_last_logits(hf, seq).argmax()))
    return seq[len(ids) :]


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_family_matches_transformers(family, tiny_dirs):
    hf = AutoModelForCausalLM.from_pretrained(tiny_dirs[family], dtype=torch.float32).eval()
    checkpoint, model, backend = _float32_model(tiny_dirs[family])
    ids = checkpoint.tokenizer.encode(PROMPT)
    _check_logits(model, backend, hf, ids)
    greedy = PagedSequence(model, backend, len(ids) + 48).greedy(ids, 48)
    assert greedy == _hf_greedy(hf, ids, 48)


@pytest.fixture(scope="module")
def smollm_float32():
    return _float32_model(None)


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers(smollm_float32, hf_smollm):
    checkpoint, model, backend = smollm_float32
    ids = checkpoint.tokenizer.encode("The history of the Roman Empire begins")
    _check_logits(model, backend, hf_smollm, ids)
    greedy = PagedSequence(model, backend, len(ids) + 48).greedy(ids, 48)
    assert greedy == _hf_greedy(hf_smollm, ids, 48)


@pytest.mark.slow
def test_log_softmax_matches_the_reference(smollm_float32, hf_smollm):
    """What the sampler's logprobs are computed from: the log-softmax of our logits, within TOL
    of the reference's at every greedy step, with the same top 5."""
    checkpoint, model, backend = smollm_float32
    ids = checkpoint.tokenizer.encode("Water boils at a temperature of")
    sequence = PagedSequence(model, backend, len(ids) + 8)
    logits, seq = sequence.extend(ids)[-1], list(ids)
    for _ in range(8):
        ours = torch.log_softmax(logits.double(), dim=-1)
        ref = torch.log_softmax(_hf_last_logits(hf_smollm, seq), dim=-1)
        token = int(ours.argmax())
        assert token == int(ref.argmax())
        assert abs(ours[token].item() - ref[token].item()) < TOL
        assert ours.topk(5).indices.tolist() == ref.topk(5).indices.tolist()
        seq.append(token)
        logits = sequence.extend([token])[-1]

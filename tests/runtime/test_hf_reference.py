"""The runtime end to end against HF transformers (float32, quantization "none"): greedy
continuations and the logprobs it reports. (tests/model checks the model's logits alone.)"""

import pytest
import torch
from transformers import AutoModelForCausalLM, RepetitionPenaltyLogitsProcessor

from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.request import GenerationRequest, SamplingParams
from inflight.runtime.runtime import Runtime

from helpers import assert_no_leaks
from tiny_models import FAMILIES

PROMPT = "The quick brown fox jumps over the lazy dog. In-flight batching"
TOL = 1e-4


def _hf_greedy(hf, ids, n):
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq]), logits_to_keep=1).logits[0, -1].argmax()))
    return seq[len(ids) :]


def _greedy(runtime, ids, n, **params):
    request = GenerationRequest(
        ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **params)
    )
    return runtime.handle_request(request).result()


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_family_greedy_equals_transformers(family, tiny_dirs):
    hf = AutoModelForCausalLM.from_pretrained(tiny_dirs[family], dtype=torch.float32).eval()
    config = DeploymentOptions(max_batch_size=2, max_model_len=256, quantization="none")
    runtime = Runtime(tiny_dirs[family], config)
    ids = runtime.tokenizer.encode(PROMPT)
    assert list(_greedy(runtime, ids, 48).token_ids) == _hf_greedy(hf, ids, 48)
    assert_no_leaks(runtime)


@pytest.mark.slow
def test_smollm2_greedy_equals_transformers(smollm, hf_smollm):
    ids = smollm.tokenizer.encode("The history of the Roman Empire begins")
    assert list(_greedy(smollm, ids, 48).token_ids) == _hf_greedy(hf_smollm, ids, 48)


@pytest.mark.slow
def test_reported_logprobs_are_the_references(smollm, hf_smollm):
    ids = smollm.tokenizer.encode("Water boils at a temperature of")
    out = _greedy(smollm, ids, 8, logprobs=5)
    seq = list(ids)
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        with torch.no_grad():
            logits = hf_smollm(torch.tensor([seq]), logits_to_keep=1).logits[0, -1]
        ref = torch.log_softmax(logits.double(), dim=-1)
        assert entry.token_id == token == int(ref.argmax())
        assert entry.logprob <= 0 and abs(entry.logprob - ref[token].item()) < TOL
        top = [t.logprob for t in entry.top]
        assert len(top) == 5 and top == sorted(top, reverse=True)
        assert [t.token_id for t in entry.top] == ref.topk(5).indices.tolist()
        seq.append(token)


def _hf_penalized_greedy(hf, ids, n, repetition, frequency, presence):
    """Greedy with transformers' repetition penalty processor over the whole sequence, then
    the OpenAI API's frequency and presence penalties over the output."""
    processor = RepetitionPenaltyLogitsProcessor(repetition)
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([seq]), logits_to_keep=1).logits[:, -1]
            logits = processor(torch.tensor([seq]), logits)[0]
            counts = torch.zeros_like(logits)
            for token in seq[len(ids) :]:
                counts[token] += 1
            logits = logits - frequency * counts - presence * (counts > 0).float()
            seq.append(int(logits.argmax()))
    return seq[len(ids) :]


@pytest.mark.slow
def test_smollm2_penalized_greedy_equals_transformers(smollm, hf_smollm):
    ids = smollm.tokenizer.encode("List the days of the week: Monday, Tuesday,")
    penalties = dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)
    got = list(_greedy(smollm, ids, 24, **penalties).token_ids)
    assert got == _hf_penalized_greedy(hf_smollm, ids, 24, 1.3, 0.4, 0.2)
    # The penalties changed the continuation (the prompt invites repeats).
    assert got != list(_greedy(smollm, ids, 24).token_ids)

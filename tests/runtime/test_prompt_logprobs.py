"""Prompt log-probabilities (scoring), across chunked prefill, against HF transformers."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.request import GenerationRequest, SamplingParams
from inflight.runtime.runtime import Runtime

from helpers import assert_no_leaks


@pytest.fixture(scope="module")
def pair(tiny_dirs):
    hf = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], dtype=torch.float32).eval()
    # A small token budget splits the prompt's prefill (and its scoring) over several steps.
    runtime = Runtime(tiny_dirs["llama"], DeploymentOptions(max_batch_size=2, max_num_tokens=16))
    return hf, runtime


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_prompt_logprobs_match_reference(pair, max_tokens):
    hf, runtime = pair
    prompt = list(range(5, 45))
    params = SamplingParams(max_tokens=max_tokens, prompt_logprobs=3, temperature=0)
    out = runtime.handle_request(GenerationRequest(prompt, params)).result()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], dim=-1)
    entries = out.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    for position, entry in enumerate(entries[1:], start=1):
        assert entry.token_id == prompt[position]
        assert abs(entry.logprob - ref[position - 1, prompt[position]].item()) < 1e-4
        assert [t.token_id for t in entry.top] == ref[position - 1].topk(3).indices.tolist()
    assert len(out.token_ids) == max_tokens
    if max_tokens == 0:
        assert out.finish_reason == "length" and out.text == ""
    assert_no_leaks(runtime)


def test_max_tokens_zero_needs_prompt_logprobs():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)

"""Mixture-of-experts decoders (Qwen3-MoE, Qwen2-MoE, Mixtral) against transformers on tiny
random checkpoints (CPU, float32, quantization "none"): logits within 1e-4 of transformers'
(float64) over a prefill and decode steps, its greedy tokens; through the runtime, each row's
tokens and logprobs bit-identical alone and in a batch rows join mid-flight; what a
mixture-of-experts deployment refuses."""

import pytest
import torch

from inflight.model.checkpoints.loader import open_checkpoint
from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.request import GenerationRequest, SamplingParams
from inflight.runtime.deployment import MachineFacts, ModelFacts, resolve
from inflight.runtime.runtime import Runtime

from helpers import (
    assert_greedy_as,
    assert_no_leaks,
    assert_same_outputs,
    assert_tracks,
    float32_model,
    float64_reference,
    run_staggered,
)
from tiny_models import MOE_FAMILIES, make_tiny_moe


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    """Each tiny mixture-of-experts checkpoint's directory and transformers model."""
    root = tmp_path_factory.mktemp("moe")
    return {name: (root / name, make_tiny_moe(name, root / name)) for name in MOE_FAMILIES}


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_logits_and_greedy_match_transformers(moe_dirs, name):
    path, hf = moe_dirs[name]
    hf = float64_reference(hf)
    checkpoint, model, backend = float32_model(path)
    assert checkpoint.config.moe is not None

    def theirs(seq):
        with torch.no_grad():
            return hf(torch.tensor([seq])).logits[0]

    ids = [1] + [(29 * i + 7) % 300 + 3 for i in range(40)]
    assert_tracks(model, backend, ids, theirs)
    assert_greedy_as(model, backend, ids, theirs)


def test_the_configs_say_which_layers_are_sparse(moe_dirs):
    """Qwen3-MoE's `mlp_only_layers` keep a dense MLP; Qwen2-MoE has a gated shared expert;
    Mixtral routes every layer with renormalized weights."""
    configs = {name: open_checkpoint(moe_dirs[name][0]).config for name in MOE_FAMILIES}
    assert configs["qwen3_moe"].moe.sparse_layers == (0, 1)
    assert configs["qwen3_moe_dense_first"].moe.sparse_layers == (1,)
    assert not configs["qwen3_moe_dense_first"].moe.renormalize
    shared = configs["qwen2_moe"].moe
    assert (shared.shared_intermediate_size, shared.shared_gate) == (48, True)
    assert configs["mixtral"].family == "mixtral" and configs["mixtral"].moe.renormalize


CONFIG = dict(max_batch_size=4, max_model_len=256, block_size=8, quantization="none")


def _request(n: int, seed: int, max_tokens: int) -> GenerationRequest:
    ids = [1] + [(37 * i + 11 * seed) % 300 + 3 for i in range(n - 1)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=2)
    return GenerationRequest(ids, params)


@pytest.mark.parametrize("max_num_tokens", [2048, 12])
def test_rows_are_bit_identical_alone_and_in_a_changing_batch(moe_dirs, max_num_tokens):
    """Requests join a running batch every other step and leave as they finish, prefilled
    whole or in chunks: each row's tokens and logprobs equal its run alone, bit for bit (a
    token's experts run beside whichever other tokens chose them)."""
    options = DeploymentOptions(**CONFIG, max_num_tokens=max_num_tokens)
    runtime = Runtime(moe_dirs["qwen2_moe"][0], options)
    requests = [
        _request(n, seed, m)
        for seed, (n, m) in enumerate(((9, 20), (30, 6), (17, 12), (5, 16), (23, 9), (12, 14)))
    ]
    alone = [runtime.handle_request(r).result() for r in requests]
    assert_same_outputs(run_staggered(runtime, requests), alone)
    assert_no_leaks(runtime)


@pytest.mark.parametrize(
    ("options", "refusal"),
    [
        (dict(tensor_parallel_size=2), "tensor parallelism does not split mixture-of-experts"),
        (dict(enable_lora=True), "LoRA is not served for mixture-of-experts models"),
    ],
)
def test_a_deployment_refuses_what_experts_do_not_serve(moe_dirs, options, refusal):
    with pytest.raises(ValueError, match=refusal):
        Runtime(moe_dirs["mixtral"][0], DeploymentOptions(**options))


@pytest.mark.parametrize(("quantization", "graphs"), [("auto", True), ("fp8", False)])
def test_cuda_graphs_replay_float_experts_not_fp8_ones(quantization, graphs):
    """Float experts run the grouped kernel, which a CUDA graph replays whatever the routing;
    FP8 experts run one matmul per expert chosen, sized by the routing: steps run eagerly."""
    facts = ModelFacts("qwen3_moe", 512, 4, 2, 16, 128, 4096, experts=True)
    cuda = MachineFacts(cuda_devices=1, cuda_capability=(9, 0))
    options = DeploymentOptions(device="cuda", quantization=quantization)
    assert resolve(options, facts, cuda).cuda_graphs is graphs

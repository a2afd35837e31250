"""NemotronH with mixture-of-experts layers against transformers on tiny random checkpoints
(CPU, float32, quantization "none"; one with grouped routing, one with latent experts and
biases): the configs, Nemotron 3 Nano's too; a checkpoint lacking a mixture's tensor refused;
logits within 1e-4 of transformers' (float64, its experts in their per-expert loop) over a
prefill and decode steps, and its greedy tokens; through the runtime, transformers' greedy
tokens with the prompt prefilled in chunks, and each row's tokens and logprobs bit-identical
alone and in a batch rows join mid-flight."""

import pytest
import torch

from inflight.model.checkpoints.loader import build_model, open_checkpoint
from inflight.model.contract import ModelCaches
from inflight.model.families.hybrid import hybrid_from_hf
from inflight.model.layers.mamba import MambaRows, MambaStates
from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.request import GenerationRequest, SamplingParams
from inflight.runtime.device.batch_builder import RowInput, build_ragged_batch
from inflight.runtime.runtime import Runtime

from helpers import (
    assert_no_leaks,
    assert_same_outputs,
    float32_model,
    float64_reference,
    run_staggered,
)
from tiny_models import NEMOTRON_H_MOE_VARIANTS, VOCAB, make_tiny_nemotron_h_moe

CPU = torch.device("cpu")
TOL = 1e-4
# 21 tokens: with chunk_size 8 the scan runs two whole blocks and a partial one.
PROMPT = [(37 * i + 11) % (VOCAB - 3) + 3 for i in range(21)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """variant -> (checkpoint directory, transformers model)."""
    root = tmp_path_factory.mktemp("nemotron_h_moe")
    return {v: (root / v, make_tiny_nemotron_h_moe(v, root / v)) for v in NEMOTRON_H_MOE_VARIANTS}


class _Sequence:
    """One sequence run through a hybrid model a chunk a forward pass, over a paged KV cache
    and state slot 0 of its own."""

    def __init__(self, model, backend, capacity: int, block_size: int = 16) -> None:
        cfg = model.config
        self.model, self.backend, self.block_size = model, backend, block_size
        self.table = list(range(-(-capacity // block_size)))
        shape = backend.kv_cache_shape(len(self.table), block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv = [
            (torch.zeros(shape), torch.zeros(shape)) for _ in range(model.num_attention_layers)
        ]
        self.states = MambaStates.allocate(cfg, 1, torch.float32, CPU)
        self.length = 0

    def extend(self, ids: list[int]) -> torch.Tensor:
        """The logits at every position of `ids`, appended to the sequence."""
        row = RowInput(ids, self.length, self.table, True, True)
        batch = build_ragged_batch([row], self.block_size, CPU)
        batch.forward.recurrent = MambaRows.build([0], [self.length == 0], CPU)
        self.backend.plan(batch.forward.attention)
        with torch.no_grad():
            hidden = self.model(batch.forward, ModelCaches(self.kv, self.backend, self.states))
            logits = self.model.compute_logits(hidden)
        self.length += len(ids)
        return logits


@pytest.mark.parametrize("variant", NEMOTRON_H_MOE_VARIANTS)
def test_logits_and_greedy_match_transformers(checkpoints, variant):
    """A prefill of 21 tokens, then 32 greedy decode steps: the logits of every position are
    within 1e-4 of transformers' forward over the whole sequence in float64, and every greedy
    pick is the reference's."""
    path, hf = checkpoints[variant]
    _, model, backend = float32_model(path)
    sequence = _Sequence(model, backend, len(PROMPT) + 32)
    logits = sequence.extend(PROMPT)
    ours, picks = [logits], []
    for _ in range(32):
        picks.append(int(logits[-1].argmax()))
        logits = sequence.extend(picks[-1:])
        ours.append(logits)
    with torch.no_grad():
        want = float64_reference(hf)(torch.tensor([PROMPT + picks])).logits[0]
    error = (torch.cat(ours).double() - want).abs().max().item()
    assert error < TOL, f"max |ours - transformers| {error:.2e}"
    assert picks == want[len(PROMPT) - 1 : -1].argmax(-1).tolist()


def test_the_configs_describe_the_mixtures(checkpoints):
    """A "moe" layer is a sparse layer of a sigmoid router with its selection bias, its groups
    and scale, relu² experts and a shared expert; the latent variant's experts run in 24
    channels, between projections with biases."""
    grouped = open_checkpoint(checkpoints["grouped"][0]).config
    assert grouped.mamba.layer_types == ("mamba", "moe", "attention", "moe")
    moe = grouped.moe
    assert moe.sparse_layers == (1, 3)
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (8, 2, 32)
    assert (moe.scoring, moe.selection_bias, moe.renormalize) == ("sigmoid", True, True)
    assert (moe.num_groups, moe.topk_groups, moe.scaling_factor) == (4, 2, 2.5)
    assert (moe.activation, moe.shared_intermediate_size) == ("relu2", 48)
    assert moe.latent_size == 0
    latent = open_checkpoint(checkpoints["latent"][0]).config.moe
    assert (latent.latent_size, latent.latent_bias, latent.num_groups) == (24, True, 1)


def test_nemotron_3_nano_config():
    """Nemotron 3 Nano's config.json (NVIDIA-Nemotron-3-Nano-30B-A3B) gives its layers as a
    pattern string, E for a mixture of experts."""
    pattern = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
    cfg = {
        "architectures": ["NemotronHForCausalLM"],
        "hybrid_override_pattern": pattern,
        "hidden_size": 2688,
        "n_routed_experts": 128,
        "num_experts_per_tok": 6,
        "moe_intermediate_size": 1856,
        "moe_shared_expert_intermediate_size": 3712,
        "routed_scaling_factor": 2.5,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "mlp_hidden_act": "relu2",
    }
    config = hybrid_from_hf(cfg)
    kinds = config.mamba.layer_types
    assert len(kinds) == 52
    assert (kinds.count("mamba"), kinds.count("moe"), kinds.count("attention")) == (23, 23, 6)
    moe = config.moe
    assert moe.sparse_layers == tuple(i for i, c in enumerate(pattern) if c == "E")
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (128, 6, 1856)
    assert (moe.shared_intermediate_size, moe.scaling_factor) == (3712, 2.5)
    assert (moe.scoring, moe.selection_bias, moe.num_groups, moe.latent_size) == (
        "sigmoid",
        True,
        1,
        0,
    )


@pytest.mark.parametrize(
    ("dropped", "refusal"),
    [
        (
            "layers.3.mixer.experts.5.up_proj.weight",
            "checkpoint lacks layers.3.mixer.experts tensors: expert 5: up",
        ),
        (
            "layers.1.mixer.gate.e_score_correction_bias",
            r"checkpoint lacks 1 tensors, e.g. \['layers.1.mixer.gate.e_score_correction_bias'",
        ),
        (
            "layers.1.mixer.shared_experts.down_proj.weight",
            r"lacks 1 tensors, e.g. \['layers.1.mixer.shared_expert.down_proj.weight'",
        ),
    ],
)
def test_a_checkpoint_without_a_mixtures_tensor_is_refused(checkpoints, dropped, refusal):
    path = checkpoints["grouped"][0]
    weights = [(n, t) for n, t in open_checkpoint(path).weights() if not n.endswith(dropped)]
    checkpoint = open_checkpoint(path)
    checkpoint.source = type("Source", (), {"weights": lambda self: iter(weights)})()
    with pytest.raises(ValueError, match=refusal):
        build_model(checkpoint, torch.float32, CPU, 64, quantization="none")


CONFIG = dict(max_batch_size=4, max_model_len=256, block_size=8, quantization="none")


def _prompt(n: int, seed: int) -> list[int]:
    return [1] + [(37 * i + 11 * seed) % 300 + 3 for i in range(n - 1)]


def _request(ids: list[int], max_tokens: int, **params) -> GenerationRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **params)
    return GenerationRequest(ids, params)


@pytest.mark.parametrize("variant", NEMOTRON_H_MOE_VARIANTS)
def test_greedy_with_chunked_prefill_is_transformers_greedy(checkpoints, variant):
    """Prompts of 21 and 45 tokens prefilled 16 tokens a step, then 24 decode steps:
    transformers' greedy tokens, each from its full forward over the sequence so far."""
    path, hf = checkpoints[variant]
    hf = float64_reference(hf)
    runtime = Runtime(path, DeploymentOptions(**CONFIG, max_num_tokens=16))
    for ids in (_prompt(21, 1), _prompt(45, 2)):
        got = runtime.handle_request(_request(ids, 24)).result().token_ids
        seq = list(ids)
        with torch.no_grad():
            for _ in range(24):
                seq.append(int(hf(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
        assert got == tuple(seq[len(ids) :])
    assert_no_leaks(runtime)


@pytest.mark.parametrize("max_num_tokens", [2048, 12])
def test_rows_are_bit_identical_alone_and_in_a_changing_batch(checkpoints, max_num_tokens):
    """Requests join a running batch every other step and leave as they finish, prefilled
    whole or (12 tokens a step) in chunks: each row's tokens and logprobs equal its run
    alone, bit for bit."""
    options = DeploymentOptions(**CONFIG, max_num_tokens=max_num_tokens)
    runtime = Runtime(checkpoints["grouped"][0], options)
    requests = [
        _request(_prompt(n, seed), m, logprobs=2)
        for seed, (n, m) in enumerate(((9, 20), (30, 6), (17, 12), (5, 16), (23, 9), (12, 14)))
    ]
    alone = [runtime.handle_request(r).result() for r in requests]
    assert_same_outputs(run_staggered(runtime, requests), alone)
    assert_no_leaks(runtime)

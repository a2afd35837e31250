"""The mixture-of-experts layer (`layers/moe.py`) against transformers' own blocks: the router's
variants (softmax over the chosen k, over all experts without renormalizing, with a logit bias;
sigmoid with a selection bias within the best groups, scaled), the experts loaded from each
layout checkpoints hold them in, and a token's output independent of the tokens beside it."""

import pytest
import torch
import transformers as tf
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, Qwen3MoeTopKRouter

from inflight.model.config import MoEConfig
from inflight.model.layers.linear import process_weights_after_loading
from inflight.model.layers.moe import Experts, Router
from inflight.model.layers.platform import Platform
from inflight.model.layers.quantization import LinearMethods, unquantized_method

HIDDEN = 64
PLATFORM = Platform.detect(torch.device("cpu"), torch.float32)
METHODS = LinearMethods(unquantized_method(PLATFORM))


def _theirs_and_ours(name: str):
    """transformers' router `name` with random weights, and our config of it."""
    torch.manual_seed(0)
    common = dict(hidden_size=HIDDEN, num_experts_per_tok=4)
    if name.startswith("qwen3"):
        norm = name == "qwen3 renormalized"
        theirs = Qwen3MoeTopKRouter(
            tf.Qwen3MoeConfig(**common, num_experts=16, norm_topk_prob=norm)
        )
        ours = MoEConfig(16, 4, 32, (0,), renormalize=norm)
    elif name == "gpt-oss":
        theirs = GptOssTopKRouter(tf.GptOssConfig(**common, num_local_experts=16))
        ours = MoEConfig(16, 4, 32, (0,), router_bias=True)
    else:
        config = tf.NemotronHConfig(
            **common,
            n_routed_experts=16,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
        )
        theirs = NemotronHTopkRouter(config)
        ours = MoEConfig(
            16,
            4,
            32,
            (0,),
            scoring="sigmoid",
            selection_bias=True,
            num_groups=4,
            topk_groups=2,
            scaling_factor=2.5,
        )
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.3)
        if name == "nemotron":
            theirs.e_score_correction_bias.normal_(0, 0.3)
    return theirs, ours


@pytest.mark.parametrize("name", ["qwen3 renormalized", "qwen3", "gpt-oss", "nemotron"])
def test_router_picks_and_weighs_as_transformers(name):
    theirs, config = _theirs_and_ours(name)
    router = Router(HIDDEN, config, METHODS, "gate")
    with torch.no_grad():
        router.weight.copy_(theirs.weight)
        if router.bias is not None:
            router.bias.copy_(theirs.bias)
        if router.e_score_correction_bias is not None:
            router.e_score_correction_bias.copy_(theirs.e_score_correction_bias)
    process_weights_after_loading(router)
    x = torch.randn(50, HIDDEN)
    with torch.no_grad():
        _, want_weights, want_ids = theirs(x)
        weights, ids = router.route(x)
    # Their order of the k is their topk's; compare each token's experts as a set.
    ids, order = ids.sort(dim=-1)
    want_ids, want_order = want_ids.sort(dim=-1)
    assert torch.equal(ids, want_ids)
    want = want_weights.float().gather(1, want_order)
    assert (weights.gather(1, order) - want).abs().max().item() < 1e-6


def _experts(config: MoEConfig) -> Experts:
    return Experts(HIDDEN, config, PLATFORM, METHODS, "layers.0.mlp.experts")


CONFIG = MoEConfig(8, 2, 32, (0,))


@pytest.fixture(scope="module")
def theirs():
    """transformers' Qwen3-MoE experts (its fused layout: gate_up_proj [E, 2I, H]), random."""
    config = tf.Qwen3MoeConfig(
        hidden_size=HIDDEN, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32
    )
    experts = Qwen3MoeExperts(config)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.2)
    return experts


def _route(n: int, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, HIDDEN, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(n)])
    weights = torch.rand(n, 2, generator=g)
    return x, weights, ids


@pytest.mark.parametrize("layout", ["fused", "stacked", "per expert"])
def test_experts_load_every_layout_and_compute_as_transformers(theirs, layout):
    """transformers 5's fused [E, 2I, H], llama.cpp's stacked gate and up [E, I, H], and one
    tensor per expert and part (Hugging Face checkpoints): the same experts."""
    ours = _experts(CONFIG)
    gate_up, down = theirs.gate_up_proj.detach(), theirs.down_proj.detach()
    if layout == "fused":
        ours.load("gate_up_proj", gate_up)
        ours.load("down_proj", down)
    elif layout == "stacked":
        ours.load("gate_proj", gate_up[:, :32])
        ours.load("up_proj", gate_up[:, 32:])
        ours.load("down_proj", down)
    else:
        for e in range(8):
            ours.load(f"{e}.w1.weight", gate_up[e, :32])
            ours.load(f"{e}.up_proj.weight", gate_up[e, 32:])
            ours.load(f"{e}.down_proj.weight", down[e])
    assert ours.missing() == []
    process_weights_after_loading(ours)
    x, weights, ids = _route(20)
    with torch.no_grad():
        want = theirs(x, ids, weights)
        got = ours(x, weights, ids)
    assert (got - want).abs().max().item() < 1e-5


def test_missing_and_misplaced_expert_tensors_are_named(theirs):
    ours = _experts(CONFIG)
    ours.load("gate_proj", theirs.gate_up_proj.detach()[:, :32])
    assert ours.missing()[:2] == ["expert 0: up", "expert 0: down"]
    with pytest.raises(ValueError, match=r"'8.w1.weight': the layer has 8 experts"):
        ours.load("8.w1.weight", torch.zeros(32, HIDDEN))
    with pytest.raises(ValueError, match=r"'down_proj' holds 4 experts, the layer 8"):
        ours.load("down_proj", torch.zeros(4, HIDDEN, 32))
    with pytest.raises(ValueError, match=r"'0.gate_proj.bias' has no place"):
        ours.load("0.gate_proj.bias", torch.zeros(32))


def test_a_tokens_output_does_not_depend_on_the_tokens_beside_it(theirs):
    """Each token alone, and in batches of 2 to 40 (so its experts run over 1 to 40 rows): the
    same bits."""
    ours = _experts(CONFIG)
    ours.load("gate_up_proj", theirs.gate_up_proj.detach())
    ours.load("down_proj", theirs.down_proj.detach())
    process_weights_after_loading(ours)
    x, weights, ids = _route(40)
    with torch.no_grad():
        alone = torch.cat(
            [ours(x[i : i + 1], weights[i : i + 1], ids[i : i + 1]) for i in range(40)]
        )
        for n in (2, 3, 7, 16, 40):
            assert torch.equal(ours(x[:n], weights[:n], ids[:n]), alone[:n])

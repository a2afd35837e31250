"""gpt-oss against transformers on tiny random checkpoints (CPU, float32, quantization "none"):
attention sinks, layers alternating a window of 6 tokens and full attention, YaRN rope, a
biased router and clamped-SwiGLU experts with biases; from transformers' float layout and from
OpenAI's MXFP4 experts. Logits within 1e-4 of transformers' (float64) past the window, its
greedy tokens; the sinks change the output; rows bit-identical alone and in a batch they join
mid-flight."""

import copy
import math

import pytest
import torch
import transformers

from inflight.model.attention import TorchAttentionBackend
from inflight.model.checkpoints.loader import open_checkpoint
from inflight.model.config import ModelConfig, RopeConfig
from inflight.model.families.gpt_oss import dequantize_mxfp4, model_layout
from inflight.model.layers.rotary import RotaryEmbedding
from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.request import GenerationRequest, SamplingParams
from inflight.runtime.runtime import Runtime

from helpers import (
    PagedSequence,
    assert_greedy_as,
    assert_no_leaks,
    assert_same_outputs,
    assert_tracks,
    float32_model,
    float64_reference,
    run_staggered,
)
from tiny_models import GPT_OSS_WINDOW, make_tiny_gpt_oss, quantize_mxfp4

LAYOUTS = ("float", "mxfp4")


@pytest.fixture(scope="module")
def gpt_oss_dirs(tmp_path_factory):
    """Each layout's checkpoint directory and transformers' model of it."""
    root = tmp_path_factory.mktemp("gpt_oss")
    return {
        layout: (root / layout, make_tiny_gpt_oss(root / layout, mxfp4=layout == "mxfp4"))
        for layout in LAYOUTS
    }


def _theirs(hf):
    reference = float64_reference(hf)

    def theirs(seq):
        with torch.no_grad():
            return reference(torch.tensor([seq])).logits[0]

    return theirs


PROMPT = [1] + [(29 * i + 7) % 300 + 3 for i in range(40)]


def test_the_config_says_sinks_alternating_windows_yarn_and_biased_experts(gpt_oss_dirs):
    config = open_checkpoint(gpt_oss_dirs["float"][0]).config
    assert config.family == "gpt_oss" and config.attention_sinks
    w = GPT_OSS_WINDOW
    assert config.layer_windows == (w, None, w, None)
    assert (config.qkv_bias, config.o_bias) == (True, True)
    assert config.rope.type == "yarn" and not config.rope.truncate
    moe = config.moe
    assert moe.sparse_layers == (0, 1, 2, 3) and moe.renormalize
    assert (moe.router_bias, moe.expert_bias, moe.activation) == (True, True, "swiglu_clamped")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_and_greedy_match_transformers(gpt_oss_dirs, layout):
    """A 41-token prompt (the window is 6) and 8 decode steps in the CPU kernel and the torch
    reference backend, then 24 greedy tokens."""
    path, hf = gpt_oss_dirs[layout]
    theirs = _theirs(hf)
    _, model, backend = float32_model(path)
    for attention in (backend, TorchAttentionBackend()):
        assert_tracks(model, attention, PROMPT, theirs)
    assert_greedy_as(model, backend, PROMPT, theirs)


def test_mxfp4_experts_load_as_the_float_values_they_store(gpt_oss_dirs):
    """The MXFP4 checkpoint's experts reach the model's loader as exactly what transformers
    dequantizes them to (its float32 load of the same file), split into gate and up rows."""
    path, hf = gpt_oss_dirs["mxfp4"]
    loaded = dict(model_layout(open_checkpoint(path).weights()))
    theirs = hf.model.layers[1].mlp.experts  # [E, H, 2I] gate/up interleaved, [E, I, H]
    ours = {k.rpartition(".experts.")[2]: v for k, v in loaded.items() if ".1.mlp.experts." in k}
    assert set(ours) == {"gate_proj", "up_proj", "gate_proj.bias", "up_proj.bias", "down_proj",
                         "down_proj_bias"}  # fmt: skip
    assert torch.equal(ours["gate_proj"], theirs.gate_up_proj.transpose(1, 2)[:, ::2])
    assert torch.equal(ours["up_proj"], theirs.gate_up_proj.transpose(1, 2)[:, 1::2])
    assert torch.equal(ours["up_proj.bias"], theirs.gate_up_proj_bias[:, 1::2])
    assert torch.equal(ours["down_proj"], theirs.down_proj.transpose(1, 2))
    assert "model.layers.1.mlp.gate.bias" in loaded  # the router, under the block's name


def test_sinks_change_the_output_and_match_transformers_without_them(gpt_oss_dirs):
    """Sinks of -inf weigh nothing: with them, ours still matches transformers', and differs
    from the output with the checkpoint's sinks."""
    path, hf = gpt_oss_dirs["float"]
    _, model, backend = float32_model(path)
    with_sinks = PagedSequence(model, backend, len(PROMPT)).extend(PROMPT)
    hf = copy.deepcopy(hf)
    with torch.no_grad():
        for layers in (model.layers, hf.model.layers):
            for layer in layers:
                layer.self_attn.sinks.fill_(float("-inf"))
    without = PagedSequence(model, backend, len(PROMPT)).extend(PROMPT)
    assert (with_sinks - without).abs().max() > 0.1
    want = _theirs(hf)(PROMPT)
    assert (without.double() - want).abs().max() < 1e-4


def test_dequantization_matches_transformers_and_refuses_mismatched_parts():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(0)
    rows = torch.randn(3, 10, 64) * torch.logspace(-3, 3, 10)[:, None]
    blocks, scales = quantize_mxfp4(rows)
    ours = dequantize_mxfp4(blocks, scales)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(ours, theirs.transpose(1, 2))
    # Each group's largest value is a representable multiple of its scale: kept within 1/4.
    assert ((ours - rows).abs() / rows.abs().amax(-1, keepdim=True)).max() < 0.25
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales[..., :1])


@pytest.mark.parametrize(
    "rope",
    [
        dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
             original_max_position_embeddings=4096),
        dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024),
        dict(rope_type="yarn", factor=40.0, mscale=1.0, mscale_all_dim=0.707,
             original_max_position_embeddings=4096),
    ],
    ids=["gpt-oss", "truncated", "mscale"],
)  # fmt: skip
def test_yarn_tables_match_transformers(rope):
    """cos and sin (YaRN's blended frequencies, scaled by its attention factor) at positions up
    to 3,000 as transformers computes them."""
    config = transformers.GptOssConfig(
        head_dim=64, rope_parameters={**rope, "rope_theta": 150000.0}
    )
    theirs = transformers.models.gpt_oss.modeling_gpt_oss.GptOssRotaryEmbedding(config)
    positions = torch.arange(3000)[None]
    cos, sin = theirs(torch.zeros(1, dtype=torch.float32), positions)
    ours = RotaryEmbedding(_shape(rope), 3000)
    assert torch.equal(ours.cos[:, :32], cos[0]) and torch.equal(ours.sin[:, :32], sin[0])
    factor = theirs.attention_scaling
    assert factor != 1.0 and math.isclose(ours.cos[0, 0].item(), factor, rel_tol=1e-7)


def _shape(rope: dict) -> ModelConfig:
    from inflight.model.config import rope_from_hf

    parsed: RopeConfig = rope_from_hf({"rope_parameters": {**rope, "rope_theta": 150000.0}})
    return ModelConfig("gpt_oss", 10, 64, 64, 1, 1, 1, 64, 1e-5, 4096, rope=parsed)


def test_rows_are_bit_identical_alone_and_in_a_changing_batch(gpt_oss_dirs):
    """Requests longer than the window join a running batch every other step, prefilled in
    chunks of 12: each row's tokens and logprobs equal its run alone, bit for bit."""
    options = DeploymentOptions(
        max_batch_size=4, max_model_len=256, block_size=4, quantization="none", max_num_tokens=12
    )
    runtime = Runtime(gpt_oss_dirs["mxfp4"][0], options)

    def request(n: int, seed: int, max_tokens: int) -> GenerationRequest:
        ids = [1] + [(37 * i + 11 * seed) % 300 + 3 for i in range(n - 1)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=2)
        return GenerationRequest(ids, params)

    shapes = ((9, 20), (30, 6), (17, 12), (5, 16), (23, 9))
    requests = [request(n, seed, m) for seed, (n, m) in enumerate(shapes)]
    alone = [runtime.handle_request(r).result() for r in requests]
    assert_same_outputs(run_staggered(runtime, requests), alone)
    assert_no_leaks(runtime)

"""The int8 CPU matmul: exact to its own quantization math, close to float32, lossless on Q8_0
weights, and a model built with it close to float32 (what it shares with the 4-bit kernel:
test_quantized_linear.py)."""

import gguf
import numpy as np
import pytest
import torch

from inflight.model.checkpoints.loader import build_model, open_checkpoint
from inflight.model.kernels.cpu.int8 import (
    BLOCK,
    QuantizedWeight,
    int8_linear,
    quantize_blocks,
    quantize_weight,
)
from inflight.model.layers.linear import Linear
from inflight.model.layers.quantization import Int8LinearMethod, PackedLinearMethod

from helpers import prefill_logits
from tiny_models import FAMILIES

pytestmark = pytest.mark.usefixtures("two_threads")  # their work split, as on two cores

# K = 576: groups of 8, 8, 2 blocks; 1536: six 8s; 96: 2 + 1; 224: 4 + 2 + 1; 32: a single block.
SHAPES = [(1, 576, 960), (16, 576, 3), (37, 1536, 577), (5, 96, 64), (2, 224, 7), (3, 32, 49152)]


def _dequantize(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (values.double().unflatten(-1, (-1, BLOCK)) * scales.double()[..., None]).flatten(-2)


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's math in float64: dequantized activations times dequantized weights."""
    out = _dequantize(*quantize_blocks(x)) @ _dequantize(*quantize_blocks(weight)).T
    return out if bias is None else out + bias.double()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_matches_its_quantization_math(m, k, n):
    torch.manual_seed(m * k + n)
    x, weight, bias = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
    out = int8_linear(x, quantize_weight(weight), bias)
    ref = _reference(x, weight, bias)
    # Only float32 rounding separates them: the block dot products are exact integers.
    assert (out.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_close_to_float32(m, k, n):
    torch.manual_seed(m + k * n)
    x, weight = torch.randn(m, k), torch.randn(n, k)
    # Each operand is rounded to 1/127 of its block's maximum: about 0.6% RMS for Gaussian
    # blocks of 32 (max about 2.1 sigma, uniform rounding error of step / sqrt(12)), so about
    # 0.8% RMS relative for the product of two; 1.5% leaves room for small samples.
    assert _rel(int8_linear(x, quantize_weight(weight)), x @ weight.T) < 0.015


def test_q8_0_weights_come_back_as_stored():
    """GGUF's Q8_0 is this kernel's block format with float16 scales: a Q8_0 weight, dequantized
    as the loader does, quantizes back to the values and scales it was stored as (quantization
    "auto" runs Q8_0 tensors in this kernel)."""
    weight = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    raw = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0)
    blocks = raw.reshape(-1, 2 + BLOCK)  # float16 scale, then 32 int8 values
    scales = torch.from_numpy(blocks[:, :2].copy().view(np.float16).astype(np.float32)[:, 0])
    values = torch.from_numpy(blocks[:, 2:].copy().view(np.int8))
    loaded = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0))
    got_values, got_scales = quantize_blocks(loaded)
    assert torch.equal(got_values.reshape(-1, BLOCK), values)
    assert torch.equal(got_scales.flatten(), scales)


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_model_close_to_float32(family, tiny_dirs):
    checkpoint = open_checkpoint(tiny_dirs[family])
    cpu = torch.device("cpu")
    fp32 = build_model(checkpoint, torch.float32, cpu, 256, quantization="none")
    int8 = build_model(checkpoint, torch.float32, cpu, 256, quantization="int8")
    linears = [m for m in int8.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * checkpoint.config.num_layers + 1  # the head, tied or not
    assert all(isinstance(m.method, Int8LinearMethod) for m in linears)
    assert all(isinstance(m.prepared, QuantizedWeight) and m.weight is None for m in linears)
    assert all(
        isinstance(m.method, PackedLinearMethod) for m in fp32.modules() if isinstance(m, Linear)
    )
    # A tied head quantizes a copy: the embedding looks up the float weights as loaded.
    assert torch.equal(int8.embed_tokens.weight, fp32.embed_tokens.weight)

    ids = torch.randint(
        0, checkpoint.config.vocab_size, (96,), generator=torch.Generator().manual_seed(0)
    )
    ours, ref = prefill_logits(int8, ids.tolist()), prefill_logits(fp32, ids.tolist())
    cosine = torch.nn.functional.cosine_similarity(ours, ref, dim=-1)
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    # Measured over 3 prompts x 4 families: mean cosine 0.9988-0.9995, worst row 0.987, argmax
    # agreement 0.885-0.97. These random models compound the ~0.8% error of each matmul through
    # nine of them per token (about 4% relative on the logits), and their top logits are close.
    assert cosine.mean().item() > 0.998
    assert cosine.min().item() > 0.98
    assert agree > 0.85

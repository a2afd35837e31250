"""The int8 CPU matmul: exact to its own quantization math, close to float32, the same bits for a
row whatever batch or thread count computes it, and a model built with it close to float32."""

import pytest
import torch

from inflight.model.int8_linear import BLOCK, int8_linear, quantize_blocks, quantize_weight
from inflight.model.llama import Linear
from inflight.model.loader import build_model, open_checkpoint

from helpers import prefill_logits
from tiny_models import FAMILIES

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


def test_rows_identical_alone_or_batched_and_across_threads():
    torch.manual_seed(0)
    x, weight, bias = torch.randn(37, 576), torch.randn(577, 576), torch.randn(577)
    q = quantize_weight(weight)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        batched = int8_linear(x, q, bias)
        alone = torch.cat([int8_linear(row[None], q, bias) for row in x])
        torch.set_num_threads(2)
        assert torch.equal(int8_linear(x, q, bias), batched)
        for m in (2, 5, 16, 37):
            for start in range(0, 37 - m + 1, m):
                assert torch.equal(
                    int8_linear(x[start : start + m], q, bias), alone[start : start + m]
                )
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batched, alone)


def test_long_prompts_split_by_tokens_give_the_same_rows():
    """Enough tokens (203: four blocks of 64, the last partial) that the threads split them
    instead of the weight rows; each row as the few-token split computes it."""
    torch.manual_seed(3)
    x, weight, bias = torch.randn(203, 224), torch.randn(33, 224), torch.randn(33)
    q = quantize_weight(weight)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        out = int8_linear(x, q, bias)
        assert torch.equal(out[150:], int8_linear(x[150:], q, bias))
    finally:
        torch.set_num_threads(threads)
    assert (
        out.double() - _reference(x, weight, bias)
    ).abs().max().item() <= 1e-5 * out.abs().max().item()


def test_bias_is_added_last_and_leading_dims_kept():
    torch.manual_seed(1)
    x, weight, bias = torch.randn(2, 3, 64), torch.randn(10, 64), torch.randn(10)
    q = quantize_weight(weight)
    out = int8_linear(x, q, bias)
    assert out.shape == (2, 3, 10)
    assert torch.equal(out, int8_linear(x, q) + bias)


def test_rejects_what_it_cannot_run():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_weight(torch.randn(4, 48))
    q = quantize_weight(torch.randn(4, 64))
    with pytest.raises(ValueError, match=r"float32 CPU input \[\.\.\., 64\]"):
        int8_linear(torch.randn(2, 32), q)
    with pytest.raises(ValueError, match="float32"):
        int8_linear(torch.randn(2, 64, dtype=torch.float64), q)


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_model_close_to_float32(family, tiny_dirs):
    checkpoint = open_checkpoint(tiny_dirs[family])
    cpu = torch.device("cpu")
    fp32 = build_model(checkpoint, torch.float32, cpu, 256)
    int8 = build_model(checkpoint, torch.float32, cpu, 256, quantization="int8")
    linears = [m for m in int8.modules() if isinstance(m, Linear)]
    assert linears and all(m.quantized is not None for m in linears)
    assert all(m.quantized is None for m in fp32.modules() if isinstance(m, Linear))
    assert (int8.quantized_head is not None) == (int8.lm_head is None)

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

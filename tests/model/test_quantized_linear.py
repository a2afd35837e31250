"""What the int8 and the 4-bit CPU matmuls share: a row's result is the same bits whatever batch
or thread count computes it, whichever way the threads split the work, and bad input is refused
by name."""

import pytest
import torch

from inflight.model.kernels.cpu.int8 import int8_linear, quantize_weight
from inflight.model.kernels.cpu.q4 import q4_linear, quantize_q4

from helpers import torch_threads

KERNELS = {"int8": (quantize_weight, int8_linear), "q4": (quantize_q4, q4_linear)}


# K: a unit of rows runs over 16 or 37 tokens of 576 with its rows outer where their activations
# fit L1 and its token tiles outer where they do not (work_split.h's token_block, by the
# variant's bytes a value); over 37 of 2,048 token tiles outer in every variant.
@pytest.mark.parametrize("k", [576, 2048])
@pytest.mark.parametrize("kind", KERNELS)
def test_rows_identical_alone_or_batched_and_across_threads(kind, k):
    quantize, linear = KERNELS[kind]
    torch.manual_seed(0)
    x, weight, bias = torch.randn(37, k), torch.randn(577, k), torch.randn(577)
    q = quantize(weight)
    with torch_threads(1):
        batched = linear(x, q, bias)
        alone = torch.cat([linear(row[None], q, bias) for row in x])
    assert torch.equal(batched, alone)
    with torch_threads(2):
        assert torch.equal(linear(x, q, bias), batched)
        for m in (2, 5, 16, 37):
            for start in range(0, 37 - m + 1, m):
                assert torch.equal(linear(x[start : start + m], q, bias), alone[start : start + m])


@pytest.mark.parametrize("kind", KERNELS)
def test_long_prompts_split_by_tokens_give_the_same_rows(kind):
    """203 tokens (four blocks of 64, the last partial): the threads split the tokens instead of
    the weight rows; every row equals what the weight-row split gives it in calls of 37."""
    quantize, linear = KERNELS[kind]
    torch.manual_seed(3)
    x, weight, bias = torch.randn(203, 224), torch.randn(33, 224), torch.randn(33)
    q = quantize(weight)
    with torch_threads(2):
        whole = linear(x, q, bias)
        pieces = torch.cat([linear(x[i : i + 37], q, bias) for i in range(0, 203, 37)])
    assert torch.equal(whole, pieces)


@pytest.mark.parametrize("kind", KERNELS)
def test_bias_is_added_last_and_leading_dims_kept(kind):
    quantize, linear = KERNELS[kind]
    torch.manual_seed(1)
    x, weight, bias = torch.randn(2, 3, 64), torch.randn(10, 64), torch.randn(10)
    q = quantize(weight)
    out = linear(x, q, bias)
    assert out.shape == (2, 3, 10)
    assert torch.equal(out, linear(x, q) + bias)


@pytest.mark.parametrize("kind", KERNELS)
def test_rejects_what_it_cannot_run(kind):
    quantize, linear = KERNELS[kind]
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(4, 48))
    q = quantize(torch.randn(4, 64))
    with pytest.raises(ValueError, match=rf"{kind}_linear needs float32 CPU input \[\.\.\., 64\]"):
        linear(torch.randn(2, 32), q)
    with pytest.raises(ValueError, match="float32"):
        linear(torch.randn(2, 64, dtype=torch.float64), q)
    with pytest.raises(ValueError, match=rf"{kind}_linear bias must be float32 \[4\]"):
        linear(torch.randn(2, 64), q, torch.randn(5))

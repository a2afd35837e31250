"""The fused CPU ops against the torch formulas they replace."""

import pytest
import torch
import torch.nn.functional as F

from inflight.model.kernels.cpu import ops as cpu_ops
from inflight.model.layers.rotary import rotate

pytestmark = pytest.mark.usefixtures("two_threads")  # their work split, as on two cores


def _lib():
    lib = cpu_ops.library()
    assert lib is not None, "the fused CPU ops did not build"
    return lib


def _norm(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_rms_norm_with_and_without_residual():
    torch.manual_seed(0)
    x, residual = torch.randn(37, 576), torch.randn(37, 576)
    weight = 1 + 0.1 * torch.randn(576)
    plain, none = cpu_ops.rms_norm(_lib(), x, weight, 1e-5)
    torch.testing.assert_close(plain, _norm(x, weight, 1e-5), rtol=1e-6, atol=1e-6)
    assert none is None
    normed, summed = cpu_ops.rms_norm(_lib(), x, weight, 1e-5, residual)
    assert torch.equal(summed, x + residual)
    torch.testing.assert_close(normed, _norm(x + residual, weight, 1e-5), rtol=1e-6, atol=1e-6)
    # Big enough for the parallel path; rows are independent of each other.
    big = torch.randn(300, 576)
    assert torch.equal(
        cpu_ops.rms_norm(_lib(), big, weight, 1e-5)[0][7],
        cpu_ops.rms_norm(_lib(), big[7:8], weight, 1e-5)[0][0],
    )


def test_silu_mul_reads_gate_then_up_from_a_strided_view():
    torch.manual_seed(1)
    wide = 4 * torch.randn(21, 2 * 1536 + 8)
    gate_up = wide[:, : 2 * 1536]
    gate, up = gate_up.split(1536, dim=-1)
    torch.testing.assert_close(
        cpu_ops.silu_mul(_lib(), gate_up), F.silu(gate) * up, rtol=1e-6, atol=1e-6
    )


def test_rope_is_bit_identical_to_the_torch_rotation():
    torch.manual_seed(2)
    tokens, heads, kv_heads, dim = 13, 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    angles = (torch.randn(tokens, 1, dim), torch.randn(tokens, 1, dim))
    assert torch.equal(cpu_ops.rope(_lib(), q, *angles), rotate(q, angles))
    assert torch.equal(cpu_ops.rope(_lib(), k, *angles), rotate(k, angles))


@pytest.mark.parametrize("size", [1, 7, 8, 9, 17, 49_152, 49_155])
def test_argmax_is_torch_argmax_ties_nans_and_infinities_included(size):
    """The first largest value's index, as torch.argmax: ties (a few distinct values), -0.0
    beside 0.0, rows all -inf, +inf and NaN (the first NaN wins), rows read through a stride."""
    torch.manual_seed(size)
    cases = {
        "random": torch.randn(16, size),
        "ties": torch.randint(0, 3, (16, size)).float(),
        "signed zeros": torch.zeros(16, size).index_fill_(1, torch.arange(0, size, 2), -0.0),
        "all -inf": torch.full((16, size), float("-inf")),
        "inf": torch.randn(16, size).masked_fill(torch.rand(16, size) < 0.01, float("inf")),
        "nan": torch.randn(16, size).masked_fill(torch.rand(16, size) < 0.01, float("nan")),
    }
    cases["nan"][0, size // 2] = float("nan")
    for name, x in cases.items():
        assert torch.equal(cpu_ops.argmax(_lib(), x), torch.argmax(x, dim=-1)), name
        wide = torch.randn(16, size + 5)
        wide[:, :size] = x
        assert torch.equal(cpu_ops.argmax(_lib(), wide[:, :size]), torch.argmax(x, dim=-1)), name
        assert torch.equal(
            cpu_ops.argmax(_lib(), x[:, :, None].expand(16, size, 2)[..., 0]),
            torch.argmax(x, dim=-1),
        ), name

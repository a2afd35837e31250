"""RMSNorm: its kernel is chosen once, at construction, by the platform; the native CPU kernel
computes what torch's formula does."""

import functools

import pytest
import torch

from inflight.model.layers import norm
from inflight.model.layers.linear import Fp8Rows
from inflight.model.layers.norm import RMSNorm, torch_rms_norm
from inflight.model.layers.platform import Platform
from inflight.model.layers.quantization import fp8_rows

CPU = torch.device("cpu")


def test_kernel_is_chosen_at_construction(monkeypatch):
    layer = RMSNorm(576, 1e-5, Platform.detect(CPU, torch.float32))
    x, residual = torch.randn(7, 576), torch.randn(7, 576)
    plain, (normed, summed) = layer(x), layer.add_forward(x, residual)

    def no_choice(platform):
        raise AssertionError("a kernel chosen after construction")

    monkeypatch.setattr(norm, "select_rms_norm", no_choice)
    assert torch.equal(layer(x), plain)
    again = layer.add_forward(x, residual)
    assert torch.equal(again[0], normed) and torch.equal(again[1], summed)
    with pytest.raises(AssertionError, match="after construction"):
        RMSNorm(576, 1e-5, Platform.detect(CPU, torch.float32))


def test_choice_by_platform():
    native = RMSNorm(8, 1e-5, Platform.detect(CPU, torch.float32)).kernel
    assert isinstance(native, functools.partial) and native.args[0] is not None
    assert RMSNorm(8, 1e-5, Platform(CPU, torch.float32)).kernel is torch_rms_norm
    assert RMSNorm(8, 1e-5, Platform.detect(CPU, torch.bfloat16)).kernel is torch_rms_norm


def test_native_kernel_matches_torch():
    torch.manual_seed(0)
    native = RMSNorm(64, 1e-6, Platform.detect(CPU, torch.float32))
    reference = RMSNorm(64, 1e-6, Platform(CPU, torch.float32))
    weight = 1 + 0.1 * torch.randn(64)
    with torch.no_grad():
        for layer in (native, reference):
            layer.weight.copy_(weight)
    x, residual = torch.randn(13, 64), torch.randn(13, 64)
    torch.testing.assert_close(native(x), reference(x), rtol=1e-6, atol=1e-6)
    normed, summed = native.add_forward(x, residual)
    want_normed, want_summed = reference.add_forward(x, residual)
    assert torch.equal(summed, want_summed)
    torch.testing.assert_close(normed, want_normed, rtol=1e-6, atol=1e-6)
    # What the kernel cannot take goes through torch: per-head [T, H, D] views (the q/k norms),
    # a residual with a non-unit inner stride.
    heads = torch.randn(13, 3 * 64)[:, :128].view(13, 2, 64)
    assert torch.equal(native(heads), reference(heads))
    strided = torch.randn(64, 13).T
    normed, summed = native.add_forward(x, strided)
    assert torch.equal(summed, x + strided)
    torch.testing.assert_close(normed, reference(x + strided), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "platform", [Platform.detect(CPU, torch.float32), Platform(CPU, torch.float32)]
)
def test_rows_for_an_fp8_layer_are_the_norms_rows_quantized(platform):
    torch.manual_seed(2)
    layer = RMSNorm(64, 1e-6, platform)
    x, residual = torch.randn(13, 64), torch.randn(13, 64)
    rows, summed = layer.add_forward(x, residual, fp8=True)
    normed, want_summed = layer.add_forward(x, residual)
    assert isinstance(rows, Fp8Rows) and rows.dtype == torch.float32
    assert torch.equal(summed, want_summed)
    for got, want in ((rows, normed), (layer(x, fp8=True), layer(x))):
        values, scales = fp8_rows(want)
        assert torch.equal(got.values.view(torch.uint8), values.view(torch.uint8))
        assert torch.equal(got.scales, scales)

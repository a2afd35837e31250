"""SiLU-and-mul: its kernel is chosen once, at construction, by the platform; the native CPU
kernel computes what torch's ops do."""

import functools

import pytest
import torch
import torch.nn.functional as F

from inflight.model.layers import activation
from inflight.model.layers.activation import SiluAndMul, torch_silu_mul
from inflight.model.layers.linear import Fp8Rows
from inflight.model.layers.platform import Platform
from inflight.model.layers.quantization import fp8_rows

CPU = torch.device("cpu")


def test_kernel_is_chosen_at_construction(monkeypatch):
    layer = SiluAndMul(Platform.detect(CPU, torch.float32))
    gate_up = torch.randn(5, 2 * 96)
    before = layer(gate_up)

    def no_choice(platform):
        raise AssertionError("a kernel chosen after construction")

    monkeypatch.setattr(activation, "select_silu_mul", no_choice)
    assert torch.equal(layer(gate_up), before)
    with pytest.raises(AssertionError, match="after construction"):
        SiluAndMul(Platform.detect(CPU, torch.float32))


def test_choice_by_platform():
    native = SiluAndMul(Platform.detect(CPU, torch.float32)).kernel
    assert isinstance(native, functools.partial) and native.args[0] is not None
    assert SiluAndMul(Platform(CPU, torch.float32)).kernel is torch_silu_mul
    assert SiluAndMul(Platform.detect(CPU, torch.bfloat16)).kernel is torch_silu_mul


def test_native_kernel_matches_torch():
    torch.manual_seed(1)
    layer = SiluAndMul(Platform.detect(CPU, torch.float32))
    gate_up = 4 * torch.randn(21, 2 * 128 + 8)[:, : 2 * 128]  # a strided view of wider rows
    gate, up = gate_up.split(128, dim=-1)
    torch.testing.assert_close(layer(gate_up), F.silu(gate) * up, rtol=1e-6, atol=1e-6)
    # A non-unit inner stride goes through torch.
    transposed = gate_up.T.contiguous().T
    assert torch.equal(layer(transposed), torch_silu_mul(transposed))


@pytest.mark.parametrize(
    "platform", [Platform.detect(CPU, torch.float32), Platform(CPU, torch.float32)]
)
def test_rows_for_an_fp8_layer_are_its_rows_quantized(platform):
    torch.manual_seed(2)
    layer = SiluAndMul(platform)
    gate_up = 4 * torch.randn(9, 2 * 96)
    rows = layer(gate_up, fp8=True)
    values, scales = fp8_rows(layer(gate_up))
    assert isinstance(rows, Fp8Rows) and rows.dtype == torch.float32
    assert torch.equal(rows.values.view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(rows.scales, scales)

"""The rotation of q/k heads: its kernel is chosen once, at construction, by the platform; the
native CPU kernel gives torch's bits."""

import functools

import pytest
import torch

from inflight.model.layers import rotary
from inflight.model.layers.platform import Platform
from inflight.model.layers.rotary import Rope, rotate

CPU = torch.device("cpu")


def _angles(tokens: int, dim: int) -> rotary.Angles:
    return torch.randn(tokens, 1, dim), torch.randn(tokens, 1, dim)


def test_kernel_is_chosen_at_construction(monkeypatch):
    rope = Rope(Platform.detect(CPU, torch.float32))
    x, angles = torch.randn(5, 3, 64), _angles(5, 64)
    before = rope(x, angles)

    def no_choice(platform):
        raise AssertionError("a kernel chosen after construction")

    monkeypatch.setattr(rotary, "select_rope", no_choice)
    assert torch.equal(rope(x, angles), before)
    with pytest.raises(AssertionError, match="after construction"):
        Rope(Platform.detect(CPU, torch.float32))


def test_choice_by_platform():
    native = Rope(Platform.detect(CPU, torch.float32)).kernel
    assert isinstance(native, functools.partial) and native.args[0] is not None
    assert Rope(Platform(CPU, torch.float32)).kernel is rotate
    assert Rope(Platform.detect(CPU, torch.bfloat16)).kernel is rotate


def test_native_kernel_is_bit_identical_to_torch():
    torch.manual_seed(2)
    rope = Rope(Platform.detect(CPU, torch.float32))
    tokens, heads, kv_heads, dim = 13, 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    # q's and k's heads side by side in the fused projection, as the attention layer rotates them.
    qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
    angles = _angles(tokens, dim)
    assert torch.equal(rope(qk, angles), rotate(qk, angles))
    # A non-unit inner stride goes through torch.
    odd = qk.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(rope(odd, angles), rotate(odd, angles))

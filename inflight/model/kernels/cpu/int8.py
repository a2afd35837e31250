"""Int8-weight matmul for the CPU: the kernel in int8_matmul.c (AVX2, or VNNI dot products where
the CPU has them: `native.Variant`), built by `native` on first use.

Weights are quantized once, symmetrically, in blocks of 32 along K with one float32 scale per
block; activations are quantized the same way inside every call, per token. See int8_matmul.c for
the grouped layout that `quantize_weight` writes.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from inflight.model.kernels.cpu import native

BLOCK = 32
_SOURCE = Path(__file__).with_name("int8_matmul.c")


@dataclass(frozen=True)
class QuantizedWeight:
    """A [N, K] weight in the kernel's layout: int8 values [N, K] and float32 scales
    [N, 8 * groups], both permuted within groups of blocks (see int8_matmul.c)."""

    values: torch.Tensor
    scales: torch.Tensor
    # Values within -16..15 (GGUF's Q5_0): run by the kernel's build for small weights (the same
    # bits, half the multiplies on AVX2).
    small: bool = False

    @property
    def out_features(self) -> int:
        return self.values.shape[0]

    @property
    def in_features(self) -> int:
        return self.values.shape[1]


def block_groups(k: int) -> list[int]:
    """Blocks per group along K: as many 8s as fit, then 4, 2, 1 for the rest."""
    groups, blocks = [], k // BLOCK
    for size in (8, 4, 2, 1):
        groups += [size] * (blocks // size)
        blocks %= size
    return groups


def group_registers(group: torch.Tensor, g: int) -> torch.Tensor:
    """The g 32-byte registers [N, g, 32] of a group of g blocks [N, g * 32], laid out as
    block_groups.h describes: int32 lane l of each register holds chunks of block l // (8 / g)."""
    lanes = 8 // g
    # [N, block i, register r, chunk in lane c, byte j] -> [N, r, i, c, j]
    blocks = group.reshape(group.shape[0], g, g, lanes, 4)
    return blocks.permute(0, 2, 1, 3, 4).reshape(group.shape[0], g, BLOCK)


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per block of 32 along the last dim, the kernel's arithmetic exactly
    (q = round-half-even(x * (127 / amax)), scale = amax / 127): values [..., K] int8 and
    scales [..., K / 32] float32, in plain (unpermuted) order."""
    blocks = x.float().unflatten(-1, (-1, BLOCK))
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    values = torch.round(blocks * inverse).clamp_(-127, 127).to(torch.int8)
    return values.flatten(-2), (amax / 127.0).squeeze(-1)


def check_weight(weight: torch.Tensor, what: str) -> tuple[int, int]:
    """N and K of a weight the quantized kernels can take: 2-D, K a multiple of 32."""
    if weight.dim() != 2:
        raise ValueError(f"{what} weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if k == 0 or k % BLOCK:
        raise ValueError(f"{what} weight needs K (in_features) a multiple of {BLOCK}, got {k}")
    return n, k


def quantize_weight(weight: torch.Tensor) -> QuantizedWeight:
    """Quantize a float [N, K] weight (K a multiple of 32) into the kernel's layout."""
    check_weight(weight, "int8")
    return pack_int8(*quantize_blocks(weight.detach()))


def pack_int8(values: torch.Tensor, scales: torch.Tensor, small: bool = False) -> QuantizedWeight:
    """The kernel's layout of w = scale * value per block of 32: values [N, K] int8 in
    -127..127 (`small`: in -16..15), scales [N, K / 32] float32 (as `quantize_blocks` returns
    them, or a checkpoint stores them)."""
    n, k = check_weight(values, "int8")
    packed_values, packed_scales = [], []
    start = 0
    for g in block_groups(k):
        group = values[:, start * BLOCK : (start + g) * BLOCK]
        packed_values.append(group_registers(group, g).reshape(n, g * BLOCK))
        packed_scales.append(scales[:, start : start + g].repeat_interleave(8 // g, dim=1))
        start += g
    return QuantizedWeight(
        torch.cat(packed_values, dim=1).contiguous(),
        torch.cat(packed_scales, dim=1).contiguous(),
        small,
    )


@functools.cache
def load_kernel(small: bool = False) -> ctypes.CDLL:
    """The compiled kernel of the variant `native.chosen_variant` picks at first use (`small`:
    its build for weights within -16..15), built and cached across processes; raises
    native.NativeBuildError when this CPU lacks AVX2 or FMA, or when gcc is missing or fails
    (a ValueError where $INFLIGHT_CPU_ISA names no variant this CPU runs)."""
    return load_variant(native.chosen_variant(), small)


@functools.cache
def load_variant(variant: native.Variant, small: bool = False) -> ctypes.CDLL:
    """The kernel built for `variant` (`small`: for weights within -16..15)."""
    if small:
        flags = (*variant.flags, "-DINFLIGHT_SMALL_WEIGHTS")
        variant = native.Variant(f"{variant.name}, small weights", flags, variant.needs)
    lib = native.build(_SOURCE, f"the int8 CPU matmul ({variant.name})", variant)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.int8_linear.argtypes = [p, i64, i64, p, p, i64, p, p, ctypes.c_int]
    lib.int8_linear.restype = ctypes.c_int
    return lib


def int8_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] float32 (CPU) @ weight^T (+ bias) -> [..., N] float32."""
    return run_kernel(
        load_kernel(weight.small).int8_linear, "int8_linear", x, weight.in_features,
        weight.out_features, (weight.values, weight.scales), bias,
    )  # fmt: skip


def run_kernel(
    kernel: Callable[..., int],
    name: str,
    x: torch.Tensor,
    k: int,
    n: int,
    weight: tuple[torch.Tensor, ...],
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x [..., K] float32 (CPU) @ a quantized [N, K] weight^T (+ bias) through a native kernel
    taking x, M, K, the weight's tensors, N, bias, out and the thread count."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != k:
        raise ValueError(
            f"{name} needs float32 CPU input [..., {k}], got {x.dtype} "
            f"{tuple(x.shape)} on {x.device}"
        )
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,)):
        raise ValueError(f"{name} bias must be float32 [{n}], got {bias.dtype} {bias.shape}")
    if bias is not None:
        bias = bias.contiguous()  # held here: the kernel reads it through a raw pointer
    x2 = x.reshape(-1, k).contiguous()
    out = torch.empty(x2.shape[0], n, dtype=torch.float32)
    if x2.shape[0]:
        status = kernel(
            x2.data_ptr(),
            x2.shape[0],
            k,
            *(t.data_ptr() for t in weight),
            n,
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"{name} kernel failed with status {status} (K={k}, N={n})")
    return out.reshape(*x.shape[:-1], n)

"""4-bit-weight matmul for the CPU: the kernel in q4_matmul.c (AVX2, or VNNI dot products where
the CPU has them: `native.Variant`), built by `native` on first use.

Weights are quantized once in blocks of 32 along K as w = d * q + m, q in 0..15, with float32 d
and m per block: GGUF's Q4_1, so a Q4_1 checkpoint's weights come back as they were stored (up to
float rounding of d). Activations are quantized to int8 inside every call, per token. See
q4_matmul.c for the packed layout that `quantize_q4` writes.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from inflight.model.kernels.cpu import native
from inflight.model.kernels.cpu.int8 import (
    BLOCK,
    block_groups,
    check_weight,
    group_registers,
    run_kernel,
)

_SOURCE = Path(__file__).with_name("q4_matmul.c")


@dataclass(frozen=True)
class Q4Weight:
    """A [N, K] weight in the kernel's layout: packed nibbles [N, bytes per row] and float32
    scales and minimums [N, 8 * groups], permuted within groups of blocks (see q4_matmul.c)."""

    values: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    in_features: int

    @property
    def out_features(self) -> int:
        return self.values.shape[0]


def quantize_q4_blocks(
    weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per block of 32 along the last dim: q [..., K] uint8 in 0..15, d and m [..., K / 32]
    float32, with d = (max - min) / 15, m = min, q = round((w - m) / d) (0 where d is 0)."""
    blocks = weight.float().unflatten(-1, (-1, BLOCK))
    low = blocks.amin(-1, keepdim=True)
    d = (blocks.amax(-1, keepdim=True) - low) / 15.0
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round((blocks - low) * inverse).clamp_(0, 15).to(torch.uint8)
    return q.flatten(-2), d.squeeze(-1), low.squeeze(-1)


def quantize_q4(weight: torch.Tensor) -> Q4Weight:
    """Quantize a float [N, K] weight (K a multiple of 32) into the kernel's layout."""
    check_weight(weight, "4-bit")
    return pack_q4(*quantize_q4_blocks(weight.detach()))


def pack_q4(q: torch.Tensor, d: torch.Tensor, low: torch.Tensor) -> Q4Weight:
    """The kernel's layout of w = d * q + low per block of 32: q [N, K] uint8 in 0..15, d and
    low [N, K / 32] float32 (as `quantize_q4_blocks` returns them, or a checkpoint stores them)."""
    n, k = check_weight(q, "4-bit")
    words, scales, mins = [], [], []
    start = 0
    for g in block_groups(k):
        lanes = 8 // g
        registers = group_registers(q[:, start * BLOCK : (start + g) * BLOCK], g)
        if g == 1:
            words.append(registers[:, 0])
        else:  # register 2i in the low nibbles, 2i + 1 in the high ones
            words.append((registers[:, 0::2] | (registers[:, 1::2] << 4)).reshape(n, -1))
        scales.append(d[:, start : start + g].repeat_interleave(lanes, dim=1))
        mins.append(low[:, start : start + g].repeat_interleave(lanes, dim=1))
        start += g
    return Q4Weight(
        torch.cat(words, dim=1).contiguous(),
        torch.cat(scales, dim=1).contiguous(),
        torch.cat(mins, dim=1).contiguous(),
        k,
    )


@functools.cache
def load_kernel() -> ctypes.CDLL:
    """The compiled kernel of the variant `native.chosen_variant` picks at first use, built and
    cached across processes; raises native.NativeBuildError when this CPU lacks AVX2 or FMA, or
    when gcc is missing or fails (a ValueError where $INFLIGHT_CPU_ISA names no variant this
    CPU runs)."""
    return load_variant(native.chosen_variant())


@functools.cache
def load_variant(variant: native.Variant) -> ctypes.CDLL:
    """The kernel built for `variant`."""
    lib = native.build(_SOURCE, f"the 4-bit CPU matmul ({variant.name})", variant)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.q4_linear.argtypes = [p, i64, i64, p, p, p, i64, p, p, ctypes.c_int]
    lib.q4_linear.restype = ctypes.c_int
    return lib


def q4_linear(x: torch.Tensor, weight: Q4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float32 (CPU) @ weight^T (+ bias) -> [..., N] float32."""
    return run_kernel(
        load_kernel().q4_linear, "q4_linear", x, weight.in_features, weight.out_features,
        (weight.values, weight.scales, weight.mins), bias,
    )  # fmt: skip

"""GGUF weights on the CPU in their stored form: the integers and scales of the file's blocks,
re-laid for a native kernel, never dequantized to float.

Q8_0 and Q5_0 are blocks of 32 with a float16 scale d: w = d * q, q int8 (Q8_0), or
w = d * (q - 16), q 5-bit (Q5_0, which llama.cpp writes for Q4_K's tensors whose rows are not
a multiple of 256 long): both are the int8 kernel's own form (int8_matmul.c), exactly; Q5_0's
small values run in its build for small weights.

A K-quant row is cut into superblocks of 256 values (so K is a multiple of 256):
- Q4_K: 8 blocks of 32, w = d * sc_j * q - dmin * m_j, q in 0..15, sc_j and m_j 6-bit, d and
  dmin float16. That is the 4-bit kernel's own form per block of 32 (scale d * sc_j, minimum
  -dmin * m_j, both exact in float32), so Q4_K runs in q4_matmul.c unchanged.
- Q5_K: the same with q in 0..31 (a fifth bit per value).
- Q6_K: 16 blocks of 16, w = d * sc_j * (q - 32), q in 0..63, sc_j int8, d float16.
Q5_K and Q6_K run in k8_matmul.c: one byte per value, an int8 scale and minimum per 16 and two
float32 multipliers per superblock (see there); Q6_K in its centered build, which sums (q - 32)
in integers. Activations are quantized to int8 per block of 32 inside every call, per token, as
the other kernels do.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from inflight.model.kernels.cpu import int8, native, q4
from inflight.model.kernels.cpu.decoder import KernelCall
from inflight.model.kernels.cpu.int8 import run_kernel

SUPER = 256
# Values and bytes per block of each type (GGML's layout; a K-quant's block is its superblock).
BLOCK_SHAPES = {
    "Q8_0": (32, 34),
    "Q5_0": (32, 22),
    "Q4_K": (SUPER, 144),
    "Q5_K": (SUPER, 176),
    "Q6_K": (SUPER, 210),
}
BLOCK_TYPES = tuple(BLOCK_SHAPES)
_SOURCE = Path(__file__).with_name("k8_matmul.c")


@dataclass(frozen=True)
class K8Weight:
    """A Q5_K or Q6_K [N, K] weight in k8_matmul.c's layout: values [N, K] uint8 (register-
    permuted within superblocks), integer scales and minimums [N, 32 * K / 256] int8, float32
    multipliers [N, 2 * K / 256]. `centered`: w = d * c * (q - 32) (Q6_K), run by the kernel's
    centered build; the minimums still say so (n = c, f = -32 d), for the general build."""

    values: torch.Tensor
    scales: torch.Tensor
    multipliers: torch.Tensor
    centered: bool = False

    @property
    def out_features(self) -> int:
        return self.values.shape[0]

    @property
    def in_features(self) -> int:
        return self.values.shape[1]


def _blocks(type_name: str, raw_rows: np.ndarray | torch.Tensor, in_features: int):
    """The raw rows [N, bytes] of a `type_name` tensor as uint8 [N, K / values, block bytes]."""
    if type_name not in BLOCK_SHAPES:
        raise ValueError(
            f"no native kernel runs {type_name!r} blocks (known: {', '.join(BLOCK_TYPES)})"
        )
    values, nbytes = BLOCK_SHAPES[type_name]
    if in_features <= 0 or in_features % values:
        raise ValueError(
            f"{type_name} weights need K (in_features) a multiple of {values}, got {in_features}"
        )
    raw = (
        torch.as_tensor(np.ascontiguousarray(raw_rows))
        if isinstance(raw_rows, np.ndarray)
        else raw_rows
    )
    size = in_features // values * nbytes
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != size:
        raise ValueError(
            f"{type_name} blocks for K={in_features} must be uint8 [N, {size}], got "
            f"{raw.dtype} {tuple(raw.shape)}"
        )
    return raw.reshape(raw.shape[0], in_features // values, nbytes)


def _half(raw: torch.Tensor) -> torch.Tensor:
    """float16 bytes [..., 2] as float32 [...]."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def _scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 6-bit scales and 8 6-bit minimums [..., 8] of 12 packed bytes [..., 12]: bytes
    0-3 and 4-7 hold blocks 0-3's scale and minimum in their low 6 bits, and in their top 2
    bits the high bits of blocks 4-7's, whose low 4 bits are the nibbles of bytes 8-11."""
    s = packed.to(torch.int32)
    first, second, low = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    scales = torch.cat([first & 63, (low & 15) | ((first >> 6) << 4)], dim=-1)
    mins = torch.cat([second & 63, (low >> 4) | ((second >> 6) << 4)], dim=-1)
    return scales, mins


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., c, 32] bytes -> [..., 2c, 32]: block 2i the low nibbles of row i, 2i + 1 the high."""
    both = torch.stack([packed & 15, packed >> 4], dim=-2)
    return both.flatten(-3, -2)


def unpack_q8_0(raw_rows, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 rows as w = d * q per block of 32: q [N, K] int8, d [N, K / 32] float32."""
    b = _blocks("Q8_0", raw_rows, in_features)
    q = b[..., 2:].contiguous().view(torch.int8)
    return q.reshape(b.shape[0], in_features), _half(b[..., 0:2])


def unpack_q5_0(raw_rows, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q5_0 rows as w = d * q per block of 32: q [N, K] int8 in -16..15, d [N, K / 32] float32.
    A block keeps the fifth bits in a little-endian uint32 (bit j: value j), then value j's
    low nibble in the low nibble of byte j and value 16 + j's in its high nibble."""
    b = _blocks("Q5_0", raw_rows, in_features)
    high = b[..., 2:6].contiguous().view(torch.int32)
    bits = (high >> torch.arange(32, dtype=torch.int32)) & 1
    low = b[..., 6:22].to(torch.int32)
    q = (torch.cat([low & 15, low >> 4], dim=-1) | (bits << 4)) - 16
    return q.to(torch.int8).reshape(b.shape[0], in_features), _half(b[..., 0:2])


def unpack_q4_k(raw_rows, in_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K rows as w = d * q + low per block of 32: q [N, K] uint8, d and low [N, K / 32]
    float32, exact (d * sc and dmin * m are products of at most 17 bits)."""
    sb = _blocks("Q4_K", raw_rows, in_features)
    n = sb.shape[0]
    sc, m = _scales_and_mins(sb[..., 4:16])
    d = _half(sb[..., 0:2])[..., None] * sc.float()
    low = -(_half(sb[..., 2:4])[..., None] * m.float())
    q = _nibbles(sb[..., 16:].reshape(n, -1, 4, 32))
    return q.reshape(n, in_features), d.reshape(n, -1), low.reshape(n, -1)


def unpack_q5_k(raw_rows, in_features: int) -> tuple[torch.Tensor, ...]:
    """Q5_K rows: q [N, K] uint8 in 0..31, 6-bit scales and minimums [N, K / 32] (int32), d
    and dmin [N, K / 256] float32; w = d * sc * q - dmin * m."""
    sb = _blocks("Q5_K", raw_rows, in_features)
    n = sb.shape[0]
    sc, m = _scales_and_mins(sb[..., 4:16])
    high = sb[..., 16:48]  # bit j of byte i: the fifth bit of value i of block j
    bits = (high[..., None, :] >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1
    q = _nibbles(sb[..., 48:].reshape(n, -1, 4, 32)) | (bits << 4)
    return (
        q.reshape(n, in_features),
        sc.reshape(n, -1),
        m.reshape(n, -1),
        _half(sb[..., 0:2]),
        _half(sb[..., 2:4]),
    )


def unpack_q6_k(raw_rows, in_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q6_K rows: q [N, K] uint8 in 0..63, scales [N, K / 16] int8, d [N, K / 256] float32;
    w = d * sc * (q - 32). Each half superblock (128 values) keeps the low nibbles of its
    values in 64 bytes (value i in the low nibble of byte i, 64 + i in the high) and the two
    high bits in 32 (value 32t + i in bits 2t, 2t + 1 of byte i)."""
    sb = _blocks("Q6_K", raw_rows, in_features)
    n = sb.shape[0]
    low = sb[..., 0:128].reshape(n, -1, 2, 1, 64)
    low = torch.cat([low & 15, low >> 4], dim=-2).reshape(n, -1, 2, 4, 32)
    high = sb[..., 128:192].reshape(n, -1, 2, 1, 32)
    high = (high >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]) & 3
    q = low | (high << 4)
    scales = sb[..., 192:208].contiguous().view(torch.int8)
    return q.reshape(n, in_features), scales.reshape(n, -1), _half(sb[..., 208:210])


def _pack_k8(
    q: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    d: torch.Tensor,
    f: torch.Tensor,
    centered: bool = False,
) -> K8Weight:
    """k8_matmul.c's layout of w = d * c * q + f * n: q [N, K] uint8, c and n [N, K / 16]
    integers in int8's range (per half block, in K order), d and f [N, K / 256] float32;
    `centered` as K8Weight's."""
    n, k = q.shape
    supers = k // SUPER
    # [N, superblock, block i, chunk c, 4 bytes] -> register c, lane i
    values = q.reshape(n, supers, 8, 8, 4).transpose(2, 3).reshape(n, k)

    def by_half(v: torch.Tensor) -> torch.Tensor:  # [N, K / 16] -> [N, sb, half, block]
        return v.reshape(n, supers, 8, 2).transpose(2, 3).reshape(n, supers, 16)

    packed = torch.cat([by_half(scales), by_half(mins)], dim=-1).to(torch.int8)
    multipliers = torch.stack([d, f], dim=-1).float()
    return K8Weight(
        values.contiguous(),
        packed.reshape(n, -1).contiguous(),
        multipliers.reshape(n, -1),
        centered,
    )


BlockWeight = int8.QuantizedWeight | q4.Q4Weight | K8Weight


def block_weight(type_name: str, raw_rows, in_features: int) -> BlockWeight:
    """The run form of a tensor's raw rows [N, bytes] (uint8; K = in_features) stored as
    `type_name`: Q8_0 and Q5_0 in the int8 kernel's layout, Q4_K in the 4-bit kernel's, Q5_K
    and Q6_K in k8_matmul.c's."""
    if type_name == "Q8_0":
        return int8.pack_int8(*unpack_q8_0(raw_rows, in_features))
    if type_name == "Q5_0":
        return int8.pack_int8(*unpack_q5_0(raw_rows, in_features), small=True)
    if type_name == "Q4_K":
        return q4.pack_q4(*unpack_q4_k(raw_rows, in_features))
    if type_name == "Q5_K":
        q, sc, m, d, dmin = unpack_q5_k(raw_rows, in_features)
        # per 32 -> per 16: both halves of a block share its scale and minimum
        return _pack_k8(q, sc.repeat_interleave(2, -1), m.repeat_interleave(2, -1), d, -dmin)
    if type_name == "Q6_K":
        q, sc, d = unpack_q6_k(raw_rows, in_features)
        return _pack_k8(q, sc, sc, d, -32.0 * d, centered=True)
    raise ValueError(
        f"no native kernel runs {type_name!r} blocks (known: {', '.join(BLOCK_TYPES)})"
    )


def concat_rows(weights: list[BlockWeight]) -> BlockWeight:
    """Weights of one form stacked along N (the parts of a fused layer): every layout is per row."""
    first = weights[0]
    if len(weights) == 1:
        return first
    parts = {}
    for f in dataclasses.fields(first):
        value = getattr(first, f.name)
        if isinstance(value, torch.Tensor):
            value = torch.cat([getattr(w, f.name) for w in weights])
        elif isinstance(value, bool):  # `small`, `centered`: the stack's where every part's
            value = all(getattr(w, f.name) for w in weights)
        parts[f.name] = value
    return type(first)(**parts)


def load_kernels(types: Iterable[str]) -> None:
    """Build (or find cached) the kernels that run `types`, and only those: a failure shows
    here, as native.NativeBuildError, not mid-generation."""
    small_int8 = functools.partial(int8.load_kernel, True)
    centered_k8 = functools.partial(load_kernel, True)
    loaders = {
        "Q8_0": int8.load_kernel,
        "Q5_0": small_int8,
        "Q4_K": q4.load_kernel,
        "Q6_K": centered_k8,
    }
    for loader in {loaders.get(t, load_kernel) for t in types if t in BLOCK_SHAPES}:
        loader()


@functools.cache
def load_kernel(centered: bool = False) -> ctypes.CDLL:
    """The compiled Q5_K/Q6_K kernel of the variant `native.chosen_variant` picks at first use
    (`centered`: its build for Q6_K's w = d * c * (q - 32)), built and cached across processes;
    raises native.NativeBuildError when this CPU lacks AVX2 or FMA, or when gcc is missing or
    fails (a ValueError where $INFLIGHT_CPU_ISA names no variant this CPU runs)."""
    return load_variant(native.chosen_variant(), centered)


@functools.cache
def load_variant(variant: native.Variant, centered: bool = False) -> ctypes.CDLL:
    """The Q5_K/Q6_K kernel built for `variant` (`centered`: for Q6_K's form)."""
    if centered:
        flags = (*variant.flags, "-DINFLIGHT_CENTERED")
        variant = native.Variant(f"{variant.name}, centered", flags, variant.needs)
    lib = native.build(_SOURCE, f"the K-quant CPU matmul ({variant.name})", variant)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.k8_linear.argtypes = [p, i64, i64, p, p, p, i64, p, p, ctypes.c_int]
    lib.k8_linear.restype = ctypes.c_int
    return lib


def kernel_call(weight: BlockWeight, bias: torch.Tensor | None) -> KernelCall:
    """The native matmul that computes x @ weight^T (+ bias), in the kernel of the weight's
    form."""
    if isinstance(weight, K8Weight):
        tensors = (weight.values, weight.scales, weight.multipliers)
        kernel = load_kernel(weight.centered).k8_linear
    elif isinstance(weight, int8.QuantizedWeight):
        kernel, tensors = int8.load_kernel(weight.small).int8_linear, (weight.values, weight.scales)
    else:
        kernel, tensors = q4.load_kernel().q4_linear, (weight.values, weight.scales, weight.mins)
    return KernelCall(kernel, tensors, bias, weight.out_features)


def block_linear(
    x: torch.Tensor, weight: BlockWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] float32 (CPU) @ weight^T (+ bias) -> [..., N] float32, in the kernel of the
    weight's form."""
    call = kernel_call(weight, bias)
    return run_kernel(
        call.kernel, call.kernel.__name__, x, weight.in_features, weight.out_features,
        call.tensors, bias,
    )  # fmt: skip

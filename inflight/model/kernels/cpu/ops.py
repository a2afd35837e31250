"""Fused elementwise ops for the CPU float32 path (cpu_ops.c): RMSNorm with the residual add
folded in, SiLU(gate) * up, the rotary embedding, the token bitmask of structured outputs, the
multi-LoRA side path, and the rows' argmax.
At decode batch sizes each replaces a chain of torch ops whose dispatch costs more than their
arithmetic."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np
import torch

from inflight.model.kernels.cpu import native

_SOURCE = Path(__file__).with_name("cpu_ops.c")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built ops, or None where they cannot be built (`native` warns): torch's ops serve."""
    try:
        lib = native.build(_SOURCE, "the fused CPU ops")
    except native.NativeBuildError:
        return None
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    lib.rms_norm.argtypes = [p, i64, p, i64, p, p, p, i64, i64, f32, i32]
    lib.silu_mul.argtypes = [p, i64, p, i64, i64, i32]
    lib.rope.argtypes = [p, i64, i64, p, p, p, i64, i64, i64, i32]
    lib.apply_token_bitmask.argtypes = [p, i64, p, i64, p, i64, i64, i32]
    lib.lora_add.argtypes = [p, i64, p, i64, p, i64, p, p, p, i64, i64, p, i64, i64, i64, i32]
    lib.argmax_rows.argtypes = [p, i64, i64, i64, p, i32]
    for name in ("rms_norm", "silu_mul", "rope", "apply_token_bitmask", "lora_add", "argmax_rows"):
        getattr(lib, name).restype = None
    return lib


def rms_norm(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm of 2-D x [rows, size] (of x + residual when given); the normalized rows and the
    sum (None without a residual)."""
    rows, size = x.shape
    out = torch.empty(rows, size)
    summed = torch.empty(rows, size) if residual is not None else None
    lib.rms_norm(
        x.data_ptr(), x.stride(0),
        None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        out.data_ptr(), None if summed is None else summed.data_ptr(),
        weight.data_ptr(), rows, size, eps, torch.get_num_threads(),
    )  # fmt: skip
    return out, summed


def silu_mul(lib: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [rows, 2 * size] holding gate then up."""
    rows, size = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, size)
    lib.silu_mul(
        gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, size, torch.get_num_threads()
    )
    return out


def rope(lib: ctypes.CDLL, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, dim] (unit stride in dim) rotated by cos, sin [tokens, (1,) dim]."""
    tokens, heads, dim = x.shape
    cos, sin = cos.reshape(tokens, dim).contiguous(), sin.reshape(tokens, dim).contiguous()
    out = torch.empty(tokens, heads, dim)
    lib.rope(
        x.data_ptr(), x.stride(0), x.stride(1), out.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        tokens, heads, dim, torch.get_num_threads(),
    )  # fmt: skip
    return out


def apply_token_bitmask(
    lib: ctypes.CDLL, logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
) -> None:
    """In place: logits [B, V] (float32, unit inner stride) of row rows[i] (int64) are -inf where
    int32 bitmask [len(rows), ceil(V / 32)] row i has a clear bit (bit b of word w: token
    32 w + b)."""
    rows, bitmask = rows.contiguous(), bitmask.contiguous()
    lib.apply_token_bitmask(
        logits.data_ptr(), logits.stride(0), rows.data_ptr(), rows.shape[0],
        bitmask.data_ptr(), bitmask.shape[1], logits.shape[1], torch.get_num_threads(),
    )  # fmt: skip


def lora_add(
    lib: ctypes.CDLL,
    y: torch.Tensor,
    x: torch.Tensor,
    token_slots: torch.Tensor,
    a: torch.Tensor,
    bt: torch.Tensor,
    ranks: np.ndarray,
    starts: np.ndarray,
) -> None:
    """In place: y [T, out] += (x[t] A^T) B^T with token t's slot's factors, for each token of
    int32 token_slots [T] >= 0 (see `layers/lora.py` for the layouts of a, bt; int32 ranks per
    slot; int64 starts: part p's columns are starts[p] .. starts[p + 1])."""
    parts, slots, max_rank, in_features = a.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    assert y.stride(1) == 1 and a.is_contiguous() and bt.is_contiguous()
    lib.lora_add(
        x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0),
        token_slots.data_ptr(), token_slots.shape[0], a.data_ptr(), bt.data_ptr(),
        ranks.ctypes.data, slots, max_rank, starts.ctypes.data, parts, in_features, bt.shape[2],
        torch.get_num_threads(),
    )  # fmt: skip


def argmax(lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of float32 x [rows, size > 0]: each row's first largest value's
    index (int64), a NaN counting as the largest."""
    rows, size = x.shape
    assert x.dtype == torch.float32 and size > 0
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        lib.argmax_rows(
            x.data_ptr(), x.stride(0), rows, size, out.data_ptr(), torch.get_num_threads()
        )
    return out

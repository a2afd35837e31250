"""Rotary position embeddings, computed the way Hugging Face transformers computes them: the
cos/sin table, and the rotation of query and key heads by it (one kernel on the CPU float32 path,
kernels/cpu/ops.py; torch's ops elsewhere)."""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable

import torch

from inflight.model.config import ModelConfig, RopeConfig
from inflight.model.kernels.cpu import ops as cpu_ops
from inflight.model.layers.platform import Platform


def inverse_frequencies(config: ModelConfig, dim: int | None = None) -> torch.Tensor:
    """Per-pair inverse frequencies (float32) of heads rotated over their leading `dim` values
    (all of them by default), with linear, Llama-3 or YaRN scaling applied."""
    dim = config.head_dim if dim is None else dim
    rope = config.rope
    if rope.type == "yarn":
        return _yarn_frequencies(rope, dim)
    freqs = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.freq_factors is not None:
        freqs = freqs / torch.tensor(rope.freq_factors, dtype=torch.float32)
    if rope.type == "linear":
        return freqs / rope.factor
    if rope.type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / freqs
        scaled = torch.where(wavelen > low_wavelen, freqs / rope.factor, freqs)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return freqs


def _yarn_frequencies(rope: RopeConfig, dim: int) -> torch.Tensor:
    """YaRN's blend of each pair's frequency (extrapolated) and that divided by the factor
    (interpolated), by where the pair's rotations over the original context fall between
    beta_slow and beta_fast, in the float32 operations transformers uses."""
    powers = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated, interpolated = 1.0 / powers, 1.0 / (rope.factor * powers)
    original = rope.original_max_position_embeddings

    def pair_of(rotations: float) -> float:  # the (fractional) pair that turns so many times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = pair_of(rope.beta_fast), pair_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    return interpolated * (1 - kept) + extrapolated * kept


def attention_factor(rope: RopeConfig) -> float:
    """What cos and sin are scaled by: YaRN's attention factor (1 for the other types)."""
    if rope.type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return float(rope.attention_factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim)
    return mscale(rope.factor)


class RotaryEmbedding(torch.nn.Module):
    """A cos/sin table over every position the model can see, gathered per packed token;
    `rotary_dim`: of heads rotated over their leading rotary_dim values only (partial rotary,
    as Bamba's; default: the whole head)."""

    def __init__(
        self, config: ModelConfig, max_positions: int, rotary_dim: int | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.max_positions = max_positions
        self.rotary_dim = rotary_dim
        self.compute()

    def compute(self, device: torch.device | None = None) -> None:
        """(Re)build the float32 table, e.g. after the module was created on the meta device."""
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        inverse = inverse_frequencies(self.config, self.rotary_dim)
        freqs = torch.outer(positions, inverse.to(positions.device))
        emb = torch.cat((freqs, freqs), dim=-1)
        factor = attention_factor(self.config.rope)
        cos, sin = emb.cos(), emb.sin()
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def angles(self, positions: torch.Tensor, dtype: torch.dtype) -> Angles:
        """cos and sin [T, 1, D] of the packed tokens' positions, computed once per forward."""
        return (
            self.cos[positions].unsqueeze(1).to(dtype),
            self.sin[positions].unsqueeze(1).to(dtype),
        )

    def mrope_angles(self, positions: torch.Tensor, dtype: torch.dtype) -> Angles:
        """M-RoPE's cos and sin [M, 1, D] of tokens at 3-D positions [3, M]: each section of
        rotary pairs at its own coordinate (a token whose three are equal gets `angles`')."""
        section = self.config.rope.mrope_section
        assert section is not None
        # Which coordinate each of the D dims reads (the pairs' halves alike).
        if self.config.rope.mrope_interleaved:
            axis = torch.zeros(sum(section), dtype=torch.int64)
            for coordinate in (1, 2):
                axis[coordinate : 3 * section[coordinate] : 3] = coordinate
        else:
            axis = torch.repeat_interleave(torch.arange(len(section)), torch.tensor(section))
        axis = torch.cat((axis, axis)).to(positions.device)
        columns = torch.arange(axis.shape[0], device=positions.device)
        rows = positions[axis]  # [D, M]: the coordinate each dim of each token reads
        cos = self.cos[rows, columns[:, None]].T.unsqueeze(1).to(dtype)
        sin = self.sin[rows, columns[:, None]].T.unsqueeze(1).to(dtype)
        return cos, sin


Angles = tuple[torch.Tensor, torch.Tensor]


def rotate(x: torch.Tensor, angles: Angles) -> torch.Tensor:
    """Rotate heads x [T, H, D] by their tokens' angles."""
    cos, sin = angles
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _native_rotate(lib: ctypes.CDLL, x: torch.Tensor, angles: Angles) -> torch.Tensor:
    # The kernel reads each head's D values with unit stride.
    if x.stride(-1) == 1:
        return cpu_ops.rope(lib, x, *angles)
    return rotate(x, angles)


def select_rope(platform: Platform) -> Callable[[torch.Tensor, Angles], torch.Tensor]:
    if platform.cpu_ops is not None:
        return functools.partial(_native_rotate, platform.cpu_ops)
    return rotate


class Rope(torch.nn.Module):
    """Rotates query or key heads [T, H, D] by the angles of their tokens' positions (from
    `RotaryEmbedding.angles`)."""

    def __init__(self, platform: Platform) -> None:
        super().__init__()
        self.kernel = select_rope(platform)

    def forward(self, x: torch.Tensor, angles: Angles) -> torch.Tensor:
        return self.kernel(x, angles)

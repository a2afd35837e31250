"""Rotary position embeddings, computed the way Hugging Face transformers computes them."""

from __future__ import annotations

import math

import torch

from inflight.model.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """Per-pair inverse frequencies (float32), with linear or Llama-3 scaling applied."""
    dim = config.head_dim
    rope = config.rope
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


class RotaryEmbedding(torch.nn.Module):
    """A cos/sin table over every position the model can see, gathered per packed token."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.max_positions = max_positions
        self.compute()

    def compute(self, device: torch.device | None = None) -> None:
        """(Re)build the float32 table, e.g. after the module was created on the meta device."""
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, inverse_frequencies(self.config).to(positions.device))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def angles(self, positions: torch.Tensor, dtype: torch.dtype) -> Angles:
        """cos and sin [T, 1, D] of the packed tokens' positions, computed once per forward."""
        return (
            self.cos[positions].unsqueeze(1).to(dtype),
            self.sin[positions].unsqueeze(1).to(dtype),
        )


Angles = tuple[torch.Tensor, torch.Tensor]


def rotate(q: torch.Tensor, k: torch.Tensor, angles: Angles) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] by their tokens' angles."""
    cos, sin = angles
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

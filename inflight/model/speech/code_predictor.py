"""The code predictor of a text-to-speech talker (Qwen3-TTS, Qwen3-Omni): a small Qwen3-style
decoder that, given the talker's last hidden state and a frame's first code, predicts the
frame's other codebooks one after another.

Every row of a step runs the same number of micro-steps (one per codebook), so the rows advance
in lock step: their keys and values sit in one dense cache [rows, heads, positions, dim] that
lives for one frame, and no paging is needed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from inflight.model.config import ModelConfig
from inflight.model.layers.norm import TorchRMSNorm
from inflight.model.layers.rotary import rotate

# Picks a code per row from a codebook's logits [rows, vocab]: (codebook index, logits) -> ids.
CodePicker = Callable[[int, torch.Tensor], torch.Tensor]


class _Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, heads, kv_heads, dim = (
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        self.q_proj = nn.Linear(hidden, heads * dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_heads * dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_heads * dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(heads * dim, hidden, bias=False)
        self.q_norm = TorchRMSNorm(dim, config.rms_norm_eps)
        self.k_norm = TorchRMSNorm(dim, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        angles: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        cache: list[torch.Tensor],
    ) -> torch.Tensor:
        rows, length, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(rows, length, self.heads, self.dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(rows, length, self.kv_heads, self.dim)).transpose(1, 2)
        v = self.v_proj(x).view(rows, length, self.kv_heads, self.dim).transpose(1, 2)
        q, k = rotate(q, angles), rotate(k, angles)
        if cache:
            k, v = torch.cat((cache[0], k), dim=2), torch.cat((cache[1], v), dim=2)
        cache[:] = [k, v]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(rows, length, -1))


class _MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = _Attention(config)
        self.mlp = _MLP(config)
        self.input_layernorm = TorchRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = TorchRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        angles: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        cache: list[torch.Tensor],
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), angles, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, config: ModelConfig, groups: int, embedding_dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(config) for _ in range(config.num_layers))
        self.norm = TorchRMSNorm(config.hidden_size, config.rms_norm_eps)
        # One table per predicted codebook, in the talker's width (the talker sums them).
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(config.vocab_size, embedding_dim) for _ in range(groups - 1)
        )


class CodePredictor(nn.Module):
    """`config`: the predictor's decoder shape; `groups`: codebooks per frame (it predicts all
    but the first); `talker_hidden`: the talker's width, which its input embeddings have (and a
    projection maps to its own where the two differ). Parameter names are the checkpoint's
    after `talker.code_predictor.`."""

    def __init__(self, config: ModelConfig, groups: int, talker_hidden: int) -> None:
        super().__init__()
        self.config = config
        self.groups = groups
        self.model = _Body(config, groups, talker_hidden)
        self.lm_head = nn.ModuleList(
            nn.Linear(config.hidden_size, config.vocab_size, bias=False) for _ in range(groups - 1)
        )
        self.small_to_mtp_projection: nn.Module = (
            nn.Linear(talker_hidden, config.hidden_size, bias=True)
            if talker_hidden != config.hidden_size
            else nn.Identity()
        )

    def _angles(
        self, positions: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of positions 0 .. positions-1 [positions, head_dim]. Computed per frame,
        not kept: the model is built on the meta device."""
        dim = self.config.head_dim
        inv = 1.0 / (
            self.config.rope.theta
            ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim)
        )
        freqs = torch.outer(torch.arange(positions, device=device).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _run(
        self,
        x: torch.Tensor,
        start: int,
        angles: tuple[torch.Tensor, torch.Tensor],
        caches: list[list[torch.Tensor]],
    ) -> torch.Tensor:
        """Positions start .. start + len(x) after the cached ones: their queries see the keys
        before them and, among themselves, causally."""
        x = self.small_to_mtp_projection(x)
        length = x.shape[1]
        cos, sin = (a[start : start + length] for a in angles)
        mask = torch.ones(length, start + length, dtype=torch.bool, device=x.device).tril(start)
        for layer, cache in zip(self.model.layers, caches, strict=True):
            x = layer(x, (cos, sin), mask, cache)
        return self.model.norm(x[:, -1])

    @torch.inference_mode()
    def predict(
        self, talker_hidden: torch.Tensor, first_embeds: torch.Tensor, pick: CodePicker
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's codes of codebooks 1 .. groups-1 [rows, groups-1] and the frame's
        embedding: the sum of all its codes' [rows, talker_hidden], from the talker's last
        hidden state and the embedding of the frame's first code (both [rows, talker_hidden])."""
        caches: list[list[torch.Tensor]] = [[] for _ in self.model.layers]
        x = torch.stack((talker_hidden, first_embeds), dim=1)
        # Positions 0 .. groups: the talker's hidden state, then one a code.
        angles = self._angles(self.groups + 1, x.device, x.dtype)
        codes, embeds, start = [], [first_embeds], 0
        for group in range(self.groups - 1):
            hidden = self._run(x, start, angles, caches)
            start += x.shape[1]
            ids = pick(group, self.lm_head[group](hidden))
            codes.append(ids)
            embeds.append(self.model.codec_embedding[group](ids))
            x = embeds[-1][:, None]
        return torch.stack(codes, dim=1), torch.stack(embeds, dim=1).sum(1)

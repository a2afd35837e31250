"""The image side of DiffusionGemma: Gemma-4's vision tower and the multimodal embedder that
maps its soft tokens into the decoder's width.

The tower embeds each 16x16 patch of an image at its own (aspect-preserved) resolution, adds a
learned embedding of its column and one of its row, and runs bidirectional pre- and post-norm
blocks whose attention normalizes queries, keys and values per head (hence no 1/sqrt(d) scale)
and turns them by a 2-D rotary position: the first half of each head by the column, the second
by the row. The output is averaged over pooling_kernel_size^2 blocks of patches, scaled by
sqrt(hidden_size) (optionally standardized), and each pooled block becomes one soft token:
RMS-normalized without a scale and projected to the decoder's width, in place of one
`image_token_id` placeholder, raster order over the pooled grid.

`Gemma4ImageEncoder.encode` takes what `Gemma4ImageProcessor` makes (`gemma4_image_processor`);
all the images of one call share one tower forward, attention staying within an image.
Parameters keep Hugging Face names below `vision_tower` and `embed_vision` (the checkpoint's
`model.encoder.*`, that level stripped on load). Its config (`Gemma4VisionConfig`) is read from
a DiffusionGemma `config.json` by `gemma4_vision_from_hf`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from inflight.model.encoders.base import Bounds, PreparedItem, content_key
from inflight.model.encoders.gemma4_image_processor import Gemma4ImageProcessor, patch_positions
from inflight.model.encoders.qwen2_vl import length_groups
from inflight.model.encoders.vision import activation
from inflight.model.weights import copy_into

# Gemma4VisionConfig's defaults in transformers, for what a vision_config leaves out.
_VISION_DEFAULTS: dict[str, Any] = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=16,
    num_attention_heads=12,
    num_key_value_heads=12,
    head_dim=64,
    hidden_activation="gelu_pytorch_tanh",
    rms_norm_eps=1e-6,
    pooling_kernel_size=3,
    patch_size=16,
    position_embedding_size=10 * 1024,
    use_clipped_linears=False,
    standardize=False,
)
_ROPE_THETA = 100.0
# DiffusionGemmaConfig's token defaults (Gemma-4's tokenizer).
_IMAGE_TOKEN_ID = 258_880
_BOI_TOKEN_ID = 255_999
_EOI_TOKEN_ID = 258_882
# Where the checkpoint keeps the tower and the embedder.
_PREFIX = "model.encoder."


@dataclass(frozen=True)
class Gemma4VisionConfig:
    """Gemma-4's vision tower as DiffusionGemma uses it: `num_layers` blocks over an image's
    patch_size^2 patches, pooled over pooling_kernel_size^2 blocks into soft tokens, each
    standing for one `image_token_id` placeholder; the placeholders of one image sit between
    a `boi_token_id` and an `eoi_token_id`."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_act: str
    rms_norm_eps: float
    patch_size: int
    pooling_kernel_size: int
    position_embedding_size: int
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    rope_theta: float = _ROPE_THETA
    use_clipped_linears: bool = False
    standardize: bool = False

    kind = "image"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"vision num_attention_heads {self.num_heads} must be a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        if self.head_dim % 4:
            raise ValueError(
                f"vision head_dim {self.head_dim} must be divisible by 4 (a rotary pair per "
                "axis in each half)"
            )
        activation(self.hidden_act)  # an unknown one fails here, not at build

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch: patch x patch x 3 channels."""
        return self.patch_size**2 * 3

    @property
    def placeholder(self) -> int:
        return self.image_token_id

    @property
    def bounds(self) -> Bounds:
        return (self.boi_token_id,), (self.eoi_token_id,)

    def build(self, text_hidden: int) -> Gemma4ImageEncoder:
        """The tower and its embedder, which projects to the decoder's `text_hidden`."""
        return Gemma4ImageEncoder(self, text_hidden)

    def preparer(self, processor_config: dict[str, Any]) -> Callable[[Any], PreparedItem]:
        """Transformers' Gemma-4 image processor as `processor_config` (the checkpoint's
        `preprocessor_config.json`) sets it; given none, at its defaults (280 soft tokens)."""
        patches = Gemma4ImageProcessor.from_config(processor_config, self)
        kernel = self.pooling_kernel_size

        def prepare(image: Any) -> PreparedItem:
            data, (rows, cols) = patches(image)
            key = content_key("image", data, f"{rows}x{cols}")
            return PreparedItem((data, (rows, cols)), (rows // kernel) * (cols // kernel), key)

        return prepare


def gemma4_vision_from_hf(config: dict[str, Any]) -> Gemma4VisionConfig | None:
    """The image input of a DiffusionGemma `config.json` dict (its `vision_config` and the
    image, begin- and end-of-image token ids), what it leaves out at transformers' defaults;
    None where it has no vision_config."""
    if not config.get("vision_config"):
        return None
    vision = {**_VISION_DEFAULTS, **config["vision_config"]}
    rope = vision.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"the vision tower's rope_type {rope['rope_type']!r} is not 'axial'")
    return Gemma4VisionConfig(
        num_layers=int(vision["num_hidden_layers"]),
        hidden_size=int(vision["hidden_size"]),
        intermediate_size=int(vision["intermediate_size"]),
        num_heads=int(vision["num_attention_heads"]),
        num_kv_heads=int(vision["num_key_value_heads"]),
        head_dim=int(vision["head_dim"]),
        hidden_act=vision["hidden_activation"],
        rms_norm_eps=float(vision["rms_norm_eps"]),
        patch_size=int(vision["patch_size"]),
        pooling_kernel_size=int(vision["pooling_kernel_size"]),
        position_embedding_size=int(vision["position_embedding_size"]),
        image_token_id=int(config.get("image_token_id", _IMAGE_TOKEN_ID)),
        boi_token_id=int(config.get("boi_token_id", _BOI_TOKEN_ID)),
        eoi_token_id=int(config.get("eoi_token_id", _EOI_TOKEN_ID)),
        rope_theta=float(rope.get("rope_theta", vision.get("rope_theta", _ROPE_THETA))),
        use_clipped_linears=bool(vision["use_clipped_linears"]),
        standardize=bool(vision["standardize"]),
    )


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma-4's RMSNorm: in float32, the weight a plain scale (not 1 + weight)."""
    h = x.float()
    h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        h = h * weight.float()
    return h.to(x.dtype)


class _RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.weight, self.eps)


class _ClippableLinear(nn.Module):
    """A bias-free linear whose input and output are clamped to checkpoint bounds (when the
    tower was trained with them: `use_clipped_linears`)."""

    def __init__(self, in_features: int, out_features: int, clipped: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)
        self.clipped = clipped
        if clipped:
            for bound in ("input_min", "input_max", "output_min", "output_max"):
                self.register_buffer(bound, torch.empty(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return self.linear(x)
        x = torch.clamp(x, self.input_min, self.input_max)
        return torch.clamp(self.linear(x), self.output_min, self.output_max)


def _rotary(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [patches, 1, head_dim] at (x, y) `positions`: a quarter of the frequencies
    per axis, laid out x, x, y, y so that each half of a head turns rotate-half style by one
    axis. Computed in float32 per call (nothing to keep through a meta build), then cast."""
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
    angles = positions[..., None].float() * inv_freq.to(positions.device)
    x, y = angles.unbind(1)
    angles = torch.cat([x, x, y, y], dim=-1)[:, None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim] turned by the 2-D rotary: rotate-half within each half."""
    tokens, heads, head_dim = x.shape
    first, second = x.view(tokens, heads, 2, 2, head_dim // 4).unbind(3)
    turned = torch.stack([-second, first], dim=3).view(tokens, heads, head_dim)
    return x * cos + turned * sin


class _Attention(nn.Module):
    def __init__(self, config: Gemma4VisionConfig) -> None:
        super().__init__()
        hidden, head_dim, clipped = config.hidden_size, config.head_dim, config.use_clipped_linears
        self.config = config
        self.q_proj = _ClippableLinear(hidden, config.num_heads * head_dim, clipped)
        self.k_proj = _ClippableLinear(hidden, config.num_kv_heads * head_dim, clipped)
        self.v_proj = _ClippableLinear(hidden, config.num_kv_heads * head_dim, clipped)
        self.o_proj = _ClippableLinear(config.num_heads * head_dim, hidden, clipped)
        self.q_norm = _RMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = _RMSNorm(head_dim, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: list[torch.Tensor]
    ) -> torch.Tensor:
        tokens, config = x.shape[0], self.config
        q = self.q_proj(x).view(tokens, config.num_heads, config.head_dim)
        k = self.k_proj(x).view(tokens, config.num_kv_heads, config.head_dim)
        v = self.v_proj(x).view(tokens, config.num_kv_heads, config.head_dim)
        q = _rotate(self.q_norm(q), cos, sin)
        k = _rotate(self.k_norm(k), cos, sin)
        v = _rms_norm(v, None, config.rms_norm_eps)
        repeat = config.num_heads // config.num_kv_heads
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = torch.empty_like(q)
        for index in groups:
            qs, ks, vs = (t[index].transpose(1, 2) for t in (q, k, v))
            # The per-head norms of q and k stand in for the usual 1/sqrt(head_dim).
            attended = F.scaled_dot_product_attention(qs, ks, vs, scale=1.0)
            out[index] = attended.transpose(1, 2)
        return self.o_proj(out.view(tokens, -1))


class _MLP(nn.Module):
    def __init__(self, config: Gemma4VisionConfig) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        clipped = config.use_clipped_linears
        self.gate_proj = _ClippableLinear(hidden, inner, clipped)
        self.up_proj = _ClippableLinear(hidden, inner, clipped)
        self.down_proj = _ClippableLinear(inner, hidden, clipped)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, config: Gemma4VisionConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = _Attention(config)
        self.mlp = _MLP(config)
        self.input_layernorm = _RMSNorm(hidden, eps)
        self.post_attention_layernorm = _RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = _RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = _RMSNorm(hidden, eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: list[torch.Tensor]
    ) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x), cos, sin, groups)
        x = x + self.post_attention_layernorm(attended)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class _Encoder(nn.Module):
    def __init__(self, config: Gemma4VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(config) for _ in range(config.num_layers))


class _PatchEmbedder(nn.Module):
    def __init__(self, config: Gemma4VisionConfig) -> None:
        super().__init__()
        self.input_proj = nn.Linear(config.patch_dim, config.hidden_size, bias=False)
        # [axis (x, y), position, hidden]
        self.position_embedding_table = nn.Parameter(
            torch.empty(2, config.position_embedding_size, config.hidden_size)
        )

    def forward(self, pixels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        weight = self.input_proj.weight
        # The processor leaves pixels in [0, 1]; the tower was trained on [-1, 1].
        x = self.input_proj((2 * (pixels - 0.5)).to(weight.dtype))
        table = self.position_embedding_table
        return x + (table[0][positions[:, 0]] + table[1][positions[:, 1]])


class _VisionTower(nn.Module):
    def __init__(self, config: Gemma4VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embedder = _PatchEmbedder(config)
        self.encoder = _Encoder(config)
        if config.standardize:
            self.register_buffer("std_bias", torch.empty(config.hidden_size))
            self.register_buffer("std_scale", torch.empty(config.hidden_size))

    def forward(
        self, pixels: torch.Tensor, positions: torch.Tensor, grids: list[tuple[int, int]]
    ) -> torch.Tensor:
        """The soft tokens [tokens, hidden_size] of the images whose patches `pixels` stacks."""
        config = self.config
        x = self.patch_embedder(pixels, positions)
        cos, sin = _rotary(positions, config.head_dim, config.rope_theta, x.dtype)
        groups = length_groups([rows * cols for rows, cols in grids], x.device)
        for layer in self.encoder.layers:
            x = layer(x, cos, sin, groups)
        k = config.pooling_kernel_size
        pooled = []
        for image, (rows, cols) in zip(x.split([r * c for r, c in grids]), grids, strict=True):
            blocks = image.float().view(rows // k, k, cols // k, k, -1)
            # Averaged in float32 and rounded to the working dtype, as Hugging Face's pooler.
            pooled.append(blocks.mean((1, 3)).flatten(0, 1).to(x.dtype))
        # The sqrt(hidden) scaling can overflow float16, so it and the standardization (whose
        # bias cancels the large values) stay in float32.
        soft = torch.cat(pooled).float() * config.hidden_size**0.5
        if config.standardize:
            soft = (soft - self.std_bias.float()) * self.std_scale.float()
        return soft.to(x.dtype)


class _Embedder(nn.Module):
    def __init__(self, config: Gemma4VisionConfig, text_hidden: int) -> None:
        super().__init__()
        self.eps = config.rms_norm_eps
        self.embedding_projection = nn.Linear(config.hidden_size, text_hidden, bias=False)

    def forward(self, soft: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(_rms_norm(soft, None, self.eps))


class Gemma4ImageEncoder(nn.Module):
    """DiffusionGemma's image tower and embedder as the decoder takes them (see the module's
    docstring)."""

    def __init__(self, config: Gemma4VisionConfig, text_hidden: int) -> None:
        super().__init__()
        self.config = config
        self.vision_tower = _VisionTower(config)
        self.embed_vision = _Embedder(config, text_hidden)

    @torch.inference_mode()
    def encode(self, items: list[tuple[np.ndarray, tuple[int, int]]]) -> list[torch.Tensor]:
        """Prompt embeddings [tokens, text_hidden] of prepared images (`PreparedItem.data`:
        patches [rows * cols, patch_dim] and their grid), in this module's dtype and device."""
        if not items:
            return []
        config, k = self.config, self.config.pooling_kernel_size
        grids = []
        for patches, grid in items:
            rows, cols = (int(n) for n in grid)
            if rows % k or cols % k or rows < 1 or cols < 1:
                raise ValueError(
                    f"an image's patch grid must be whole {k}x{k} pooling blocks, got {rows}x{cols}"
                )
            if tuple(patches.shape) != (rows * cols, config.patch_dim):
                raise ValueError(
                    f"patches of a {rows}x{cols} grid must be {(rows * cols, config.patch_dim)}, "
                    f"got {tuple(patches.shape)}"
                )
            grids.append((rows, cols))
        device = self.embed_vision.embedding_projection.weight.device
        # float32 up to the patch embedder, which casts after mapping to [-1, 1].
        pixels = np.concatenate([np.asarray(patches, np.float32) for patches, _ in items])
        positions = np.concatenate([patch_positions(rows, cols) for rows, cols in grids])
        soft = self.vision_tower(
            torch.from_numpy(pixels).to(device), torch.from_numpy(positions).to(device), grids
        )
        return list(self.embed_vision(soft).split([r * c // k**2 for r, c in grids]))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the checkpoint's tensors (`model.encoder.vision_tower.*`,
        `model.encoder.embed_vision.*`) in: a missing or unknown one, or a shape that differs,
        is a ValueError naming it."""
        # The clip bounds and standardization are buffers, yet checkpoint tensors all the same.
        targets = {**dict(self.named_parameters()), **dict(self.named_buffers())}
        loaded = set()
        for name, tensor in weights:
            local = name[len(_PREFIX) :] if name.startswith(_PREFIX) else None
            if local not in targets:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the image encoder")
            copy_into(targets[local], tensor, name)
            loaded.add(local)
        missing = sorted(set(targets) - loaded)
        if missing:
            raise ValueError(
                f"checkpoint lacks image encoder tensors {[_PREFIX + n for n in missing[:5]]}"
            )

"""The image side of Qwen3-Omni's thinker (a Qwen3-VL-style tower): a ViT over an image's own
patch grid with a learned position table resampled to that grid and a 2-D rotary position per
patch, whose spatial_merge_size^2 neighbouring patches are merged into one prompt embedding of
the decoder's width, plus DeepStack features: the output of each block named in
`deepstack_visual_indexes`, merged by a merger of its own, which the decoder adds to the image
tokens' hidden states after its first layers (feature i after decoder layer i).

`Qwen3OmniImageEncoder.encode` takes what `Qwen2VLImageProcessor` makes (Qwen3-Omni's checkpoints
ship a Qwen2-VL processor config with 16-pixel patches) and returns each image's embeddings in
the order of its placeholder tokens: t-major, then row, then column over the merged grid, the
order `mrope_positions` gives them their (t, h, w) positions in. `encode_deepstack` gives the
DeepStack features as well. All the images of one call share one tower forward; attention stays
within a frame. Parameters keep Hugging Face names below `visual` (the checkpoint's
`thinker.visual.*` with the `thinker.` level stripped). Its config (`Qwen3OmniVisionConfig`) is
read from a Qwen3-Omni `config.json`'s thinker_config by `qwen3_omni_vision_from_hf`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from inflight.model.encoders.base import NO_BOUNDS, Bounds, PreparedItem, content_key
from inflight.model.encoders.qwen2_vl import (
    VisionAttention,
    _positions,
    length_groups,
    merged_grid,
    pack_images,
    vision_rotary,
)
from inflight.model.encoders.qwen2_vl_processor import Qwen2VLImageProcessor
from inflight.model.encoders.vision import activation
from inflight.model.weights import copy_weights

# Qwen3OmniMoeVisionEncoderConfig's defaults in transformers (the 30B-A3B tower), for what a
# vision_config leaves out.
_VISION_DEFAULTS: dict[str, Any] = dict(
    depth=27,
    hidden_size=1152,
    hidden_act="gelu_pytorch_tanh",
    intermediate_size=4304,
    num_heads=16,
    in_channels=3,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=3584,
    num_position_embeddings=2304,
    deepstack_visual_indexes=(8, 16, 24),
)
# Qwen3OmniMoeThinkerConfig's image_token_id default (<|image_pad|>).
_IMAGE_TOKEN_ID = 151655
# What Qwen3-Omni's own preprocessor_config.json sets beyond the patch geometry, for a preparer
# given none: transformers' Qwen2-VL processor defaults would take CLIP's mean and std and a
# smaller pixel budget, which this tower was not trained on.
_PREPROCESSOR_DEFAULTS: dict[str, Any] = dict(
    min_pixels=3136,
    max_pixels=12845056,
    image_mean=(0.5, 0.5, 0.5),
    image_std=(0.5, 0.5, 0.5),
)
# Hugging Face's eps for every norm of the tower.
_EPS = 1e-6


@dataclass(frozen=True)
class Qwen3OmniVisionConfig:
    """The image tower of Qwen3-Omni's thinker: a ViT of `depth` blocks over
    patch_size^2 x temporal_patch_size patches at the image's own resolution, whose
    spatial_merge_size^2 neighbouring patches are merged into one prompt token of
    `out_hidden_size` (the decoder's width) in place of an `image_token_id` placeholder; the
    blocks in `deepstack_visual_indexes` also feed one DeepStack merger each."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    hidden_act: str
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]
    image_token_id: int
    rope_theta: float = 10000.0

    kind = "image"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ValueError(
                f"vision hidden_size {self.hidden_size} must split into {self.num_heads} heads "
                "of a width divisible by 4 (the 2-D rotary halves)"
            )
        indexes = self.deepstack_visual_indexes
        if len(set(indexes)) != len(indexes) or not all(0 <= i < self.depth for i in indexes):
            raise ValueError(
                f"deepstack_visual_indexes {list(indexes)} must be distinct blocks of the "
                f"{self.depth}-block tower"
            )
        if self.num_position_embeddings < 1:
            raise ValueError("num_position_embeddings must be at least 1")
        activation(self.hidden_act)  # an unknown one fails here, not at build

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch: channels x temporal x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def position_side(self) -> int:
        """The side of the square grid the learned position table covers."""
        return math.isqrt(self.num_position_embeddings)

    bounds: ClassVar[Bounds] = NO_BOUNDS

    @property
    def placeholder(self) -> int:
        return self.image_token_id

    def build(self, text_hidden: int) -> Qwen3OmniImageEncoder:
        """The tower; its mergers output `out_hidden_size`, which must be the decoder's width."""
        if text_hidden != self.out_hidden_size:
            raise ValueError(
                f"the vision tower outputs {self.out_hidden_size} wide embeddings for a "
                f"decoder {text_hidden} wide"
            )
        return Qwen3OmniImageEncoder(self)

    def preparer(self, processor_config: dict[str, Any]) -> Callable[[Any], PreparedItem]:
        """Transformers' Qwen2-VL image processor as `processor_config` (the checkpoint's
        `preprocessor_config.json`) sets it; given none, as Qwen3-Omni's own file does."""
        patches = Qwen2VLImageProcessor.from_config(
            processor_config or _PREPROCESSOR_DEFAULTS, self
        )
        merge = self.spatial_merge_size

        def prepare(image: Any) -> PreparedItem:
            data, (t, h, w) = patches(image)
            grid = merged_grid((t, h, w), merge)
            key = content_key("image", data, f"{t}x{h}x{w}")
            return PreparedItem((data, (t, h, w)), math.prod(grid), key, grid)

        return prepare


def qwen3_omni_vision_from_hf(thinker_config: dict[str, Any]) -> Qwen3OmniVisionConfig:
    """The image tower of a Qwen3-Omni `config.json`'s `thinker_config` dict (its
    `vision_config` and `image_token_id`), what it leaves out at transformers' defaults."""
    vision = {**_VISION_DEFAULTS, **(thinker_config.get("vision_config") or {})}
    rope = vision.get("rope_parameters") or {}
    return Qwen3OmniVisionConfig(
        depth=int(vision["depth"]),
        hidden_size=int(vision["hidden_size"]),
        intermediate_size=int(vision["intermediate_size"]),
        num_heads=int(vision["num_heads"]),
        hidden_act=vision["hidden_act"],
        patch_size=int(vision["patch_size"]),
        temporal_patch_size=int(vision["temporal_patch_size"]),
        spatial_merge_size=int(vision["spatial_merge_size"]),
        in_channels=int(vision["in_channels"]),
        out_hidden_size=int(vision["out_hidden_size"]),
        num_position_embeddings=int(vision["num_position_embeddings"]),
        deepstack_visual_indexes=tuple(int(i) for i in vision["deepstack_visual_indexes"]),
        image_token_id=int(thinker_config.get("image_token_id", _IMAGE_TOKEN_ID)),
        rope_theta=float(rope.get("rope_theta", vision.get("rope_theta", 10000.0))),
    )


def _bilinear_taps(size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each of `size` points along an axis samples a `side`-long table, corners aligned
    (the first and last points land on the table's ends): the two neighbouring entries
    [size, 2] and their tent weights [size, 2] (float32). Past the last entry a tap is clamped
    onto it, with weight 0."""
    source = torch.arange(size, dtype=torch.float32) * (side - 1) / max(size - 1, 1)
    taps = source.floor().long()[:, None] + torch.arange(2)
    weights = (1 - (source[:, None] - taps).abs()).clamp(min=0)
    return taps.clamp(max=side - 1), weights


def _position_taps(
    grid: tuple[int, int, int], positions: torch.Tensor, side: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The learned table's rows [patches, 4] each patch of an image mixes, and their weights
    [patches, 4]: the table resampled bilinearly to the image's h x w patch grid, read at the
    patches' (row, column) `positions`."""
    _, h, w = grid
    row_taps, row_weights = _bilinear_taps(h, side)
    col_taps, col_weights = _bilinear_taps(w, side)
    rows, cols = positions[:, 0], positions[:, 1]
    taps = row_taps[rows][:, :, None] * side + col_taps[cols][:, None, :]
    weights = row_weights[rows][:, :, None] * col_weights[cols][:, None, :]
    return taps.flatten(1), weights.flatten(1)


@dataclass(frozen=True)
class _Layout:
    """Where a call's patches go: all follow from the images' grids."""

    positions: torch.Tensor  # [patches, 2] (row, column) of each patch, in the processor's order
    taps: torch.Tensor  # [patches, 4] position table rows each patch mixes
    weights: torch.Tensor  # [patches, 4] float32, their weights
    frames: list[torch.Tensor]  # attention segments of one frame each (see _segment_attention)


def _layout(
    config: Qwen3OmniVisionConfig, grids: list[tuple[int, int, int]], device: torch.device
) -> _Layout:
    positions, taps, weights = [], [], []
    for grid in grids:
        positions.append(_positions(grid, config.spatial_merge_size))
        image_taps, image_weights = _position_taps(grid, positions[-1], config.position_side)
        taps.append(image_taps)
        weights.append(image_weights)
    return _Layout(
        torch.cat(positions).to(device),
        torch.cat(taps).to(device),
        torch.cat(weights).to(device),
        length_groups([h * w for t, h, w in grids for _ in range(t)], device),
    )


class _PatchEmbed(nn.Module):
    def __init__(self, config: Qwen3OmniVisionConfig) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel, stride=kernel)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        # A stride-equals-kernel convolution of one patch each is a matmul (a patch is
        # flattened channel, time, row, column: the kernel's own order), and cheaper on GPUs.
        return F.linear(patches, self.proj.weight.flatten(1), self.proj.bias)


class _MLP(nn.Module):
    def __init__(self, config: Qwen3OmniVisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class _Block(nn.Module):
    def __init__(self, config: Qwen3OmniVisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=_EPS)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=_EPS)
        self.mlp = _MLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: list[torch.Tensor]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, groups)
        return x + self.mlp(self.norm2(x))


class _Merger(nn.Module):
    """A merge block's patches (consecutive in the processor's order) concatenated into one row
    and projected to the decoder's width. The final merger normalizes each patch before the
    concatenation; the DeepStack ones (`norm_merged`) normalize the concatenated row."""

    def __init__(self, config: Qwen3OmniVisionConfig, norm_merged: bool) -> None:
        super().__init__()
        self.width = config.hidden_size * config.spatial_merge_size**2
        self.norm_merged = norm_merged
        self.ln_q = nn.LayerNorm(self.width if norm_merged else config.hidden_size, eps=_EPS)
        self.mlp = nn.Sequential(
            nn.Linear(self.width, self.width),
            nn.GELU(),
            nn.Linear(self.width, config.out_hidden_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm_merged:
            return self.mlp(self.ln_q(x.view(-1, self.width)))
        return self.mlp(self.ln_q(x).view(-1, self.width))


class _VisionTransformer(nn.Module):
    def __init__(self, config: Qwen3OmniVisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = _PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.depth))
        self.merger = _Merger(config, norm_merged=False)
        # Hugging Face's name; merger i serves block deepstack_visual_indexes[i].
        self.merger_list = nn.ModuleList(
            _Merger(config, norm_merged=True) for _ in config.deepstack_visual_indexes
        )

    def forward(
        self, patches: torch.Tensor, layout: _Layout, deepstack: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The merged embeddings [tokens, out_hidden_size] and, when `deepstack`, the DeepStack
        features [num_deepstack, tokens, out_hidden_size] in block order."""
        x = self.patch_embed(patches)
        # The interpolation weights stay float32 (the sum too), as Hugging Face's.
        table = (self.pos_embed(layout.taps) * layout.weights[..., None]).sum(1)
        x = x + table.to(x.dtype)
        cos, sin = vision_rotary(layout.positions, self.config.head_dim, self.config.rope_theta)
        features = []
        mergers = dict(zip(self.config.deepstack_visual_indexes, self.merger_list, strict=True))
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, layout.frames)
            if deepstack and i in mergers:
                features.append(mergers[i](x))
        merged = self.merger(x)
        if not deepstack:
            return merged, None
        if not features:
            return merged, merged.new_empty((0, *merged.shape))
        return merged, torch.stack(features)


class Qwen3OmniImageEncoder(nn.Module):
    """Qwen3-Omni's image tower as the decoder takes it (see the module's docstring)."""

    def __init__(self, config: Qwen3OmniVisionConfig) -> None:
        super().__init__()
        self.config = config
        self.visual = _VisionTransformer(config)

    @torch.inference_mode()
    def encode(self, items: list[tuple[np.ndarray, tuple[int, int, int]]]) -> list[torch.Tensor]:
        """Prompt embeddings of images, as `Qwen2VLImageEncoder.encode` gives them (the same
        items, the same shapes and order)."""
        if not items:
            return []
        merged, _, counts = self._run(items, deepstack=False)
        return list(merged.split(counts))

    @torch.inference_mode()
    def encode_deepstack(
        self, items: list[tuple[np.ndarray, tuple[int, int, int]]]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`encode`'s embeddings [tokens, out_hidden_size] of each image with its DeepStack
        features [num_deepstack, tokens, out_hidden_size] (same dtype, device and token order):
        feature i, from block sorted(deepstack_visual_indexes)[i], is what the decoder adds to
        the image's token rows after its layer i. Views of two tensors."""
        if not items:
            return []
        merged, features, counts = self._run(items, deepstack=True)
        assert features is not None
        return list(zip(merged.split(counts), features.split(counts, dim=1), strict=True))

    def _run(
        self, items: list[tuple[np.ndarray, tuple[int, int, int]]], deepstack: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
        config = self.config
        weight = self.visual.patch_embed.proj.weight
        pixels, grids, counts = pack_images(
            items, config.spatial_merge_size, config.patch_dim, weight
        )
        layout = _layout(config, grids, weight.device)
        merged, features = self.visual(pixels, layout, deepstack)
        return merged, features, counts

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors (`visual.*`: the checkpoint's `thinker.visual.*`,
        the `thinker.` level stripped) in: a missing or unknown one, or a shape that differs,
        is a ValueError naming it."""
        copy_weights(self, weights, "image encoder")

"""The image side of Qwen2-VL and Qwen2.5-VL: a ViT over an image's own patch grid, with a 2-D
rotary position per patch, whose spatial_merge_size^2 neighbouring patches are merged into one
prompt embedding of the decoder's width.

`Qwen2VLImageEncoder.encode` takes the flattened patches `Qwen2VLImageProcessor` makes and
returns, for each image, its embeddings in the order of its placeholder tokens in the prompt:
t-major, then row, then column over the merged grid (`merged_grid`), which is the order
Hugging Face's `get_rope_index` gives those tokens their (t, h, w) positions in. All the images
of one call share one tower forward; attention stays within a frame, and for Qwen2.5-VL within
a window except in its full-attention blocks (the tower then runs on the patches reordered
window by window and restores the order at the end, as Hugging Face does).
Parameters keep Hugging Face names below `visual`. Its config (`Qwen2VLVisionConfig`) is read
from a Qwen2-VL `config.json` by `qwen2_vl_vision_from_hf`.
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
from inflight.model.encoders.qwen2_vl_processor import Qwen2VLImageProcessor
from inflight.model.encoders.vision import activation
from inflight.model.weights import copy_weights

# Qwen2-VL's and Qwen2.5-VL's `architectures` entries, and the family of their image towers.
QWEN2_VL_FAMILIES = {
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
}
# Qwen2VLVisionConfig's and Qwen2_5_VLVisionConfig's defaults in transformers (the 7B towers),
# for what a vision_config leaves out.
_QWEN_VISION_DEFAULTS = {
    "qwen2_vl": dict(depth=32, embed_dim=1280, mlp_ratio=4, num_heads=16, hidden_act="quick_gelu"),
    "qwen2_5_vl": dict(
        depth=32,
        hidden_size=3584,
        intermediate_size=3420,
        num_heads=16,
        hidden_act="silu",
        out_hidden_size=3584,
        window_size=112,
        fullatt_block_indexes=[7, 15, 23, 31],
    ),
}


@dataclass(frozen=True)
class Qwen2VLVisionConfig:
    """The image tower of Qwen2-VL or Qwen2.5-VL: a ViT over patch_size^2 x temporal_patch_size
    patches at the image's own resolution, with a 2-D rotary position per patch, whose
    spatial_merge_size^2 neighbouring patches are merged into one prompt token of
    `out_hidden_size` (the decoder's width) in place of an `image_token_id` placeholder.
    Qwen2.5-VL ("qwen2_5_vl") uses RMSNorm and a SwiGLU MLP, and attends within windows of
    window_size pixels square except in the `fullatt_block_indexes` blocks."""

    family: str  # "qwen2_vl" or "qwen2_5_vl"
    depth: int
    embed_dim: int
    intermediate_size: int
    num_heads: int
    hidden_act: str
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    out_hidden_size: int
    image_token_id: int
    vision_start_token_id: int
    rope_theta: float = 10000.0
    window_size: int | None = None  # pixels; Qwen2.5-VL only
    fullatt_block_indexes: tuple[int, ...] = ()

    kind = "image"

    def __post_init__(self) -> None:
        if self.family not in _QWEN_VISION_DEFAULTS:
            raise ValueError(f"unknown Qwen vision family {self.family!r}")
        if self.embed_dim % self.num_heads or (self.embed_dim // self.num_heads) % 4:
            raise ValueError(
                f"vision embed_dim {self.embed_dim} must split into {self.num_heads} heads "
                "of a width divisible by 4 (the 2-D rotary halves)"
            )
        if self.windowed and self.window_size < self.patch_size * self.spatial_merge_size:
            raise ValueError(
                f"window_size {self.window_size} is smaller than one merged patch "
                f"({self.patch_size * self.spatial_merge_size} pixels)"
            )

    @property
    def windowed(self) -> bool:
        return self.family == "qwen2_5_vl"

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch: channels x temporal x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    bounds: ClassVar[Bounds] = NO_BOUNDS

    @property
    def placeholder(self) -> int:
        return self.image_token_id

    def build(self, text_hidden: int) -> Qwen2VLImageEncoder:
        """The tower (its merger outputs `out_hidden_size`, the decoder's width)."""
        return Qwen2VLImageEncoder(self)

    def preparer(self, processor_config: dict[str, Any]) -> Callable[[Any], PreparedItem]:
        patches = Qwen2VLImageProcessor.from_config(processor_config, self)
        merge = self.spatial_merge_size

        def prepare(image: Any) -> PreparedItem:
            data, (t, h, w) = patches(image)
            grid = (t, h // merge, w // merge)
            key = content_key("image", data, f"{t}x{h}x{w}")
            return PreparedItem((data, (t, h, w)), t * h * w // merge**2, key, grid)

        return prepare


def qwen2_vl_vision_from_hf(cfg: dict[str, Any]) -> Qwen2VLVisionConfig:
    """The image tower of a Qwen2-VL or Qwen2.5-VL `config.json` dict: transformers 5's layout
    (decoder fields in text_config) or the older hub one (decoder fields at the top level)."""
    archs = cfg.get("architectures") or []
    family = next((QWEN2_VL_FAMILIES[a] for a in archs if a in QWEN2_VL_FAMILIES), None)
    family = family or cfg.get("model_type")
    if family not in _QWEN_VISION_DEFAULTS:
        raise ValueError(
            f"not a Qwen2-VL config: {archs or cfg.get('model_type')!r}; "
            f"supported: {', '.join(QWEN2_VL_FAMILIES)}"
        )
    vision = {**_QWEN_VISION_DEFAULTS[family], **(cfg.get("vision_config") or {})}
    text_hidden = (cfg.get("text_config") or {}).get("hidden_size", cfg.get("hidden_size"))
    if family == "qwen2_vl":
        width = vision["embed_dim"]
        intermediate = int(width * vision["mlp_ratio"])
        # Qwen2-VL's vision_config.hidden_size is the merger's output: the decoder's width.
        out = vision.get("hidden_size", text_hidden)
    else:
        width, intermediate = vision["hidden_size"], vision["intermediate_size"]
        out = vision["out_hidden_size"]
    if out is None:
        raise ValueError("a Qwen2-VL config.json needs the decoder's hidden_size")
    rope = vision.get("rope_parameters") or {}
    return Qwen2VLVisionConfig(
        family=family,
        depth=vision["depth"],
        embed_dim=width,
        intermediate_size=intermediate,
        num_heads=vision["num_heads"],
        hidden_act=vision["hidden_act"],
        patch_size=vision.get("patch_size", 14),
        temporal_patch_size=vision.get("temporal_patch_size", 2),
        spatial_merge_size=vision.get("spatial_merge_size", 2),
        # Older hub configs spell it in_chans.
        in_channels=vision.get("in_channels", vision.get("in_chans", 3)),
        out_hidden_size=out,
        image_token_id=int(cfg.get("image_token_id", 151655)),
        vision_start_token_id=int(cfg.get("vision_start_token_id", 151652)),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        window_size=vision["window_size"] if family == "qwen2_5_vl" else None,
        fullatt_block_indexes=tuple(vision.get("fullatt_block_indexes", ())),
    )


# Hugging Face's eps for every norm of both towers.
_EPS = 1e-6


def merged_grid(grid_thw: tuple[int, int, int], merge: int) -> tuple[int, int, int]:
    """The (t, h, w) grid of an image's prompt tokens, given its grid in patches: each
    merge x merge block of patches of a frame becomes one token."""
    t, h, w = grid_thw
    if min(grid_thw) < 1 or h % merge or w % merge:
        raise ValueError(f"a patch grid {tuple(grid_thw)} does not merge in {merge}x{merge} blocks")
    return t, h // merge, w // merge


def _activation(name: str):
    return F.silu if name == "silu" else activation(name)


class _RMSNorm(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In float32 whatever the weights' dtype, as Hugging Face's.
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + _EPS)
        return self.weight * y.to(x.dtype)


def _norm(config: Qwen2VLVisionConfig, size: int) -> nn.Module:
    return _RMSNorm(size) if config.windowed else nn.LayerNorm(size, eps=_EPS)


class _PatchEmbed(nn.Module):
    def __init__(self, config: Qwen2VLVisionConfig) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(
            config.in_channels, config.embed_dim, kernel, stride=kernel, bias=False
        )

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        # A stride-equals-kernel convolution of one patch each is a matmul (a patch is
        # flattened channel, time, row, column: the kernel's own order), and cheaper on GPUs.
        return F.linear(patches, self.proj.weight.flatten(1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position on x [tokens, heads, head_dim], in float32 as Hugging Face does."""
    y = x.float()
    half = y.shape[-1] // 2
    turned = torch.cat((-y[..., half:], y[..., :half]), dim=-1)
    return (y * cos[:, None] + turned * sin[:, None]).to(x.dtype)


def _segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: list[torch.Tensor]
) -> torch.Tensor:
    """Attention of q, k, v [tokens, heads, head_dim] within segments of consecutive tokens,
    `groups` holding the segments of each length as token indices [segments, length]: one
    batched call per length rather than one per segment (windows are mostly of one size)."""
    out = torch.empty_like(q)
    for index in groups:
        qs, ks, vs = (t[index].transpose(1, 2) for t in (q, k, v))
        out[index] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
    return out


class VisionAttention(nn.Module):
    """A 2-D-rotary ViT's attention, each image's tokens (or window's: `groups`) apart; Qwen2-VL's
    and Qwen3-VL's (Qwen3-Omni's) alike."""

    def __init__(self, width: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: list[torch.Tensor]
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv(x).view(tokens, 3, self.num_heads, -1).unbind(1)
        out = _segment_attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v, groups)
        return self.proj(out.reshape(tokens, -1))


class _MLP(nn.Module):
    def __init__(self, config: Qwen2VLVisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.embed_dim, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.embed_dim)
        self.act = _activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _GatedMLP(nn.Module):
    """Qwen2.5-VL's: SwiGLU-style, with biases."""

    def __init__(self, config: Qwen2VLVisionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.embed_dim, config.intermediate_size)
        self.up_proj = nn.Linear(config.embed_dim, config.intermediate_size)
        self.down_proj = nn.Linear(config.intermediate_size, config.embed_dim)
        self.act = _activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _Block(nn.Module):
    def __init__(self, config: Qwen2VLVisionConfig) -> None:
        super().__init__()
        self.norm1 = _norm(config, config.embed_dim)
        self.attn = VisionAttention(config.embed_dim, config.num_heads)
        self.norm2 = _norm(config, config.embed_dim)
        self.mlp = _GatedMLP(config) if config.windowed else _MLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: list[torch.Tensor]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, groups)
        return x + self.mlp(self.norm2(x))


class _Merger(nn.Module):
    def __init__(self, config: Qwen2VLVisionConfig) -> None:
        super().__init__()
        self.width = config.embed_dim * config.spatial_merge_size**2
        self.ln_q = _norm(config, config.embed_dim)
        self.mlp = nn.Sequential(
            nn.Linear(self.width, self.width),
            nn.GELU(),
            nn.Linear(self.width, config.out_hidden_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A merge block's patches are consecutive (the processor's order): one row each.
        return self.mlp(self.ln_q(x).view(-1, self.width))


@dataclass(frozen=True)
class _Layout:
    """Where a call's patches go: all follow from the images' grids."""

    positions: torch.Tensor  # [patches, 2] (row, column) of each patch, in tower order
    order: torch.Tensor | None  # tower order of the merge blocks (Qwen2.5-VL's windows)
    frames: list[torch.Tensor]  # attention segments of one frame each (see _segment_attention)
    windows: list[torch.Tensor]  # of one window each (Qwen2.5-VL)


def length_groups(lengths: list[int], device: torch.device) -> list[torch.Tensor]:
    """Consecutive segments of these lengths, as token indices grouped by length."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    lengths_np = np.asarray(lengths)
    return [
        torch.from_numpy(starts[lengths_np == n][:, None] + np.arange(n)).to(device)
        for n in sorted(set(lengths))
    ]


def _positions(grid: tuple[int, int, int], merge: int) -> torch.Tensor:
    """(row, column) of an image's patches in the processor's order: frame by frame, merge
    block by merge block (raster over the merged grid), raster within a block."""
    t, h, w = grid
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    blocks = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(blocks).transpose(1, 2).flatten()
    cols = cols.reshape(blocks).transpose(1, 2).flatten()
    return torch.stack([rows, cols], dim=-1).repeat(t, 1)


def _windows(grid: tuple[int, int, int], side: int) -> tuple[np.ndarray, list[int]]:
    """Qwen2.5-VL's windows over an image's merged grid: the merge blocks in window order
    (frame, window row, window column, then raster within the window; windows at the right
    and bottom edges are cut short) and the number of blocks in each window."""
    t, h, w = grid
    rows, cols = math.ceil(h / side), math.ceil(w / side)
    padded = np.full((t, rows * side, cols * side), -1, np.int64)
    padded[:, :h, :w] = np.arange(t * h * w).reshape(t, h, w)
    windows = padded.reshape(t, rows, side, cols, side).transpose(0, 1, 3, 2, 4)
    windows = windows.reshape(t * rows * cols, side * side)
    return windows[windows >= 0], (windows >= 0).sum(1).tolist()


def _layout(
    config: Qwen2VLVisionConfig, grids: list[tuple[int, int, int]], device: torch.device
) -> _Layout:
    merge = config.spatial_merge_size
    unit = merge * merge
    positions = torch.cat([_positions(grid, merge) for grid in grids])
    # The window order keeps each frame's patches together, so frames are consecutive either way.
    frames = length_groups([h * w for t, h, w in grids for _ in range(t)], device)
    if not config.windowed:
        return _Layout(positions.to(device), None, frames, [])
    side = config.window_size // config.patch_size // merge
    order, sizes, offset = [], [], 0
    for grid in grids:
        merged = merged_grid(grid, merge)
        blocks, counts = _windows(merged, side)
        order.append(blocks + offset)
        sizes += [count * unit for count in counts]
        offset += math.prod(merged)
    block_order = torch.from_numpy(np.concatenate(order))
    positions = positions.view(-1, unit, 2)[block_order].view(-1, 2)
    return _Layout(
        positions.to(device), block_order.to(device), frames, length_groups(sizes, device)
    )


def vision_rotary(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [patches, head_dim] of a ViT's 2-D rotary at (row, column) `positions`: the
    first quarter of the frequencies turn with the row, the second with the column, and both
    halves of the head (rotate-half layout) repeat them. Computed per call, in float32: never
    cast with the weights."""
    half = head_dim // 2
    exponents = torch.arange(0, half, 2, dtype=torch.float) / half
    inv_freq = (1.0 / theta**exponents).to(positions.device)
    angles = (positions[..., None].float() * inv_freq).flatten(1)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def pack_images(
    items: list[tuple[np.ndarray, tuple[int, int, int]]],
    merge: int,
    patch_dim: int,
    weight: torch.Tensor,
) -> tuple[torch.Tensor, list[tuple[int, int, int]], list[int]]:
    """Images as a tower takes them in one forward: their patches stacked (on `weight`'s device,
    in its dtype), their grids, and the tokens each yields; a ValueError where an image's
    patches are not its grid's."""
    grids, counts = [], []
    for patches, grid in items:
        grid = tuple(int(n) for n in grid)
        counts.append(math.prod(merged_grid(grid, merge)))
        want = (math.prod(grid), patch_dim)
        if tuple(patches.shape) != want:
            raise ValueError(f"patches of a {grid} grid must be {want}, got {tuple(patches.shape)}")
        grids.append(grid)
    pixels = np.concatenate([np.asarray(patches, np.float32) for patches, _ in items])
    return torch.from_numpy(pixels).to(weight.device, weight.dtype), grids, counts


class _VisionTransformer(nn.Module):
    def __init__(self, config: Qwen2VLVisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = _PatchEmbed(config)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.depth))
        self.merger = _Merger(config)

    def forward(self, patches: torch.Tensor, layout: _Layout) -> torch.Tensor:
        x = self.patch_embed(patches)
        width, unit = x.shape[-1], self.config.spatial_merge_size**2
        if layout.order is not None:
            x = x.view(-1, unit, width)[layout.order].view(-1, width)
        head_dim = self.config.embed_dim // self.config.num_heads
        cos, sin = vision_rotary(layout.positions, head_dim, self.config.rope_theta)
        full = set(self.config.fullatt_block_indexes)
        for i, block in enumerate(self.blocks):
            windowed = self.config.windowed and i not in full
            x = block(x, cos, sin, layout.windows if windowed else layout.frames)
        merged = self.merger(x)
        if layout.order is None:
            return merged
        restored = torch.empty_like(merged)
        restored[layout.order] = merged
        return restored


class Qwen2VLImageEncoder(nn.Module):
    def __init__(self, config: Qwen2VLVisionConfig) -> None:
        super().__init__()
        self.config = config
        self.visual = _VisionTransformer(config)

    @torch.inference_mode()
    def encode(self, items: list[tuple[np.ndarray, tuple[int, int, int]]]) -> list[torch.Tensor]:
        """Prompt embeddings of images, each given as (flattened patches float32
        [t*h*w, channels*temporal*patch*patch], grid (t, h, w) in patches) as the processor
        makes them: for each, [t*h*w / merge^2, out_hidden_size] in the weights' dtype and
        device, in the order of the merged grid (t-major, then row, then column). Views of
        one tensor: all images run in one tower forward."""
        if not items:
            return []
        config = self.config
        weight = self.visual.patch_embed.proj.weight
        pixels, grids, counts = pack_images(
            items, config.spatial_merge_size, config.patch_dim, weight
        )
        embeds = self.visual(pixels, _layout(config, grids, weight.device))
        return list(embeds.split(counts))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors (`visual.*`, any `model.` level already stripped)
        in: a missing or unknown one, or a shape that differs, is a ValueError."""
        copy_weights(self, weights, "image encoder")

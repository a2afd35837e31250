"""Image preprocessing of Gemma-4 (and DiffusionGemma, which shares its vision tower) as a
checkpoint's `preprocessor_config.json` asks for it: Hugging Face's Gemma4ImageProcessorPil,
which `AutoImageProcessor` picks where torchvision is not installed. RGB, an aspect-preserving
resize to the largest size within the soft-token budget whose sides are multiples of one
pooling block (patch x pooling kernel), rescale to [0, 1] (no normalization by default: the
tower maps its pixels to [-1, 1] itself), and patches in raster order, each row, column,
channel. Pillow and numpy only."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from PIL import Image

from inflight.model.encoders.image_processor import _RESAMPLE, rescaled
from inflight.model.encoders.qwen2_vl_processor import _rgb

# The soft-token budgets Hugging Face's processor accepts (its checkpoints were trained on them).
SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)
_MAX_SOFT_TOKENS = 280


class PoolingGeometry(Protocol):
    """What the processor reads of its tower's config (`gemma4_vision.Gemma4VisionConfig`)."""

    @property
    def patch_size(self) -> int: ...

    @property
    def pooling_kernel_size(self) -> int: ...


def patch_positions(rows: int, cols: int) -> np.ndarray:
    """The (x, y) = (column, row) of each patch of a rows x cols grid in raster order, int64
    [rows * cols, 2]: Hugging Face's `image_position_ids` without the padding."""
    ys, xs = np.divmod(np.arange(rows * cols, dtype=np.int64), cols)
    return np.stack([xs, ys], axis=-1)


@dataclass(frozen=True)
class Gemma4ImageProcessor:
    patch_size: int
    pooling_kernel_size: int
    max_soft_tokens: int
    resize: bool
    resample: Image.Resampling
    rescale: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None

    @classmethod
    def from_config(cls, config: dict[str, Any], vision: PoolingGeometry) -> Gemma4ImageProcessor:
        """From a `preprocessor_config.json` dict ({} takes Hugging Face's defaults; a
        `processor_config.json` dict is read through its `image_processor` part). Its patch and
        pooling geometry must be the tower's."""
        if isinstance(config.get("image_processor"), dict):
            config = config["image_processor"]
        geometry = {
            "patch_size": vision.patch_size,
            "pooling_kernel_size": vision.pooling_kernel_size,
        }
        for key, want in geometry.items():
            if config.get(key, want) != want:
                raise ValueError(
                    f"preprocessor_config.json {key} {config[key]} differs from the vision "
                    f"tower's {want}"
                )
        budget = int(config.get("max_soft_tokens", _MAX_SOFT_TOKENS))
        if budget not in SOFT_TOKEN_BUDGETS:
            raise ValueError(
                f"preprocessor_config.json max_soft_tokens must be one of "
                f"{list(SOFT_TOKEN_BUDGETS)}, got {budget}"
            )
        resample = int(config.get("resample", Image.Resampling.BICUBIC))
        if resample not in _RESAMPLE:
            raise ValueError(f"preprocessor_config.json: unknown resample {resample}")
        normalize = config.get("do_normalize", False)
        rescale = config.get("rescale_factor", 1 / 255) if config.get("do_rescale", True) else None
        return cls(
            max_soft_tokens=budget,
            resize=bool(config.get("do_resize", True)),
            resample=_RESAMPLE[resample],
            rescale=rescale,
            mean=tuple(config.get("image_mean", (0.0, 0.0, 0.0))) if normalize else None,
            std=tuple(config.get("image_std", (1.0, 1.0, 1.0))) if normalize else None,
            **geometry,
        )

    @property
    def side(self) -> int:
        """What both sides of a processed image are multiples of: one pooling block, in pixels."""
        return self.patch_size * self.pooling_kernel_size

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling_kernel_size**2

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) an image of this size is resized to: scaled (aspect kept, up or
        down) to the patch budget, each side rounded down to a multiple of `side`; a side that
        rounds to nothing gets one block, the other the aspect ratio's whole blocks (at most
        the budget's)."""
        if min(height, width) < 1:
            raise ValueError(f"an image must have pixels, got {width}x{height}")
        # Hugging Face's float arithmetic, step for step: its floors decide the sizes.
        budget_px = self.max_patches * self.patch_size**2
        factor = math.sqrt(budget_px / (height * width))
        side = self.side
        h = math.floor(factor * height / side) * side
        w = math.floor(factor * width / side) * side
        if h == 0 and w == 0:
            raise ValueError(f"a {width}x{height} image cannot be resized into the patch budget")
        longest = (self.max_patches // self.pooling_kernel_size**2) * side
        if h == 0:
            h, w = side, min(width // height * side, longest)
        elif w == 0:
            h, w = min(height // width * side, longest), side
        if h * w > budget_px:
            raise ValueError(
                f"a {width}x{height} image is too elongated for {self.max_soft_tokens} soft "
                f"tokens ({w}x{h} after resizing)"
            )
        return h, w

    def __call__(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int]]:
        """The tower's input for an image: its patches, float32 [rows * cols, p * p * 3] in
        raster order (each patch row, column, channel), and their grid (rows, cols), both
        multiples of the pooling kernel."""
        if not isinstance(image, Image.Image):
            raise ValueError(f"an image must be a PIL image, got {type(image).__name__}")
        image = _rgb(image)
        width, height = image.size
        if self.resize:
            size = self.target_size(height, width)
            if size != (height, width):
                height, width = size
                image = image.resize((width, height), self.resample)
        elif height % self.side or width % self.side:
            raise ValueError(
                f"without resizing, an image's sides must be multiples of {self.side}, "
                f"got {width}x{height}"
            )
        pixels = rescaled(np.asarray(image), self.rescale, self.mean, self.std)
        p = self.patch_size
        rows, cols = height // p, width // p
        patches = pixels.reshape(rows, p, cols, p, 3).transpose(0, 2, 1, 3, 4)
        return np.ascontiguousarray(patches.reshape(rows * cols, p * p * 3)), (rows, cols)

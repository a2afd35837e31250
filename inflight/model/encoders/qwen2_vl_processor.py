"""Image preprocessing of Qwen2-VL and Qwen2.5-VL as a checkpoint's `preprocessor_config.json`
asks for it (Hugging Face's Qwen2VLImageProcessor): RGB, resize to the nearest size whose sides
are multiples of patch x merge within a pixel budget, rescale, normalize, and flatten into the
patches `Qwen2VLImageEncoder.encode` takes. Pillow and numpy only."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from PIL import Image

from inflight.model.encoders.image_processor import _CLIP_MEAN, _CLIP_STD, _RESAMPLE, rescaled

# Qwen2VLImageProcessor's pixel budget when the config names none.
_MIN_PIXELS = 56 * 56
_MAX_PIXELS = 28 * 28 * 1280
# The most elongated image smart_resize takes (Hugging Face's limit).
_MAX_ASPECT = 200


class PatchGeometry(Protocol):
    """What the processor reads of its vision tower's config (`qwen2_vl.Qwen2VLVisionConfig`)."""

    @property
    def patch_size(self) -> int: ...

    @property
    def temporal_patch_size(self) -> int: ...

    @property
    def spatial_merge_size(self) -> int: ...


@dataclass(frozen=True)
class Qwen2VLImageProcessor:
    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    resize: bool
    resample: Image.Resampling
    rescale: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None

    @classmethod
    def from_config(cls, config: dict[str, Any], vision: PatchGeometry) -> Qwen2VLImageProcessor:
        """From a `preprocessor_config.json` dict ({} takes Hugging Face's defaults). Its patch
        geometry must be the tower's."""
        # Newer files write size {shortest_edge, longest_edge} (pixel counts, despite the
        # names); older ones min_pixels and max_pixels, which win when both are there.
        size = config.get("size") or {}
        min_pixels = config.get("min_pixels", size.get("shortest_edge", size.get("min_pixels")))
        max_pixels = config.get("max_pixels", size.get("longest_edge", size.get("max_pixels")))
        geometry = {
            "patch_size": vision.patch_size,
            "temporal_patch_size": vision.temporal_patch_size,
            "merge_size": vision.spatial_merge_size,
        }
        for key, want in geometry.items():
            if config.get(key, want) != want:
                raise ValueError(
                    f"preprocessor_config.json {key} {config[key]} differs from the vision "
                    f"tower's {want}"
                )
        resample = int(config.get("resample", Image.Resampling.BICUBIC))
        if resample not in _RESAMPLE:
            raise ValueError(f"preprocessor_config.json: unknown resample {resample}")
        normalize = config.get("do_normalize", True)
        rescale = config.get("rescale_factor", 1 / 255) if config.get("do_rescale", True) else None
        return cls(
            min_pixels=int(min_pixels or _MIN_PIXELS),
            max_pixels=int(max_pixels or _MAX_PIXELS),
            resize=bool(config.get("do_resize", True)),
            resample=_RESAMPLE[resample],
            rescale=rescale,
            mean=tuple(config.get("image_mean", _CLIP_MEAN)) if normalize else None,
            std=tuple(config.get("image_std", _CLIP_STD)) if normalize else None,
            **geometry,
        )

    @property
    def factor(self) -> int:
        """What both sides of a resized image are multiples of: one merge block, in pixels."""
        return self.patch_size * self.merge_size

    def smart_resize(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) an image of this size is resized to: the nearest multiples of
        `factor`, scaled (aspect kept) into [min_pixels, max_pixels] when outside it."""
        if min(height, width) < 1:
            raise ValueError(f"an image must have pixels, got {width}x{height}")
        if max(height, width) / min(height, width) > _MAX_ASPECT:
            raise ValueError(
                f"an image's aspect ratio must be at most {_MAX_ASPECT}, got {width}x{height}"
            )
        factor = self.factor
        h, w = round(height / factor) * factor, round(width / factor) * factor
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h = math.ceil(height * beta / factor) * factor
            w = math.ceil(width * beta / factor) * factor
        return h, w

    def __call__(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int, int]]:
        """The encoder's input for an image: its flattened patches, float32
        [t*h*w, 3*temporal*patch*patch], and their grid (t, h, w) in patches, t = 1. Patches run
        merge block by merge block (raster over the merged grid), raster within a block; each
        is channel, time (the one frame repeated), row, column."""
        if not isinstance(image, Image.Image):
            raise ValueError(f"an image must be a PIL image, got {type(image).__name__}")
        image = _rgb(image)
        width, height = image.size
        if self.resize:
            height, width = self.smart_resize(height, width)
            image = image.resize((width, height), self.resample)
        elif height % self.factor or width % self.factor:
            raise ValueError(
                f"without resizing, an image's sides must be multiples of {self.factor}, "
                f"got {width}x{height}"
            )
        pixels = rescaled(np.asarray(image), self.rescale, self.mean, self.std)
        return self._patches(pixels)

    def _patches(self, pixels: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        patch, merge, frames = self.patch_size, self.merge_size, self.temporal_patch_size
        height, width, channels = pixels.shape
        rows, cols = height // patch, width // patch
        blocks = pixels.reshape(rows // merge, merge, patch, cols // merge, merge, patch, channels)
        # -> block row, block column, row in block, column in block, channel, pixel row, column
        blocks = blocks.transpose(0, 3, 1, 4, 6, 2, 5)[:, :, :, :, :, None]
        # A still image is a clip of temporal_patch_size identical frames.
        blocks = np.broadcast_to(blocks, (*blocks.shape[:5], frames, patch, patch))
        flat = blocks.reshape(rows * cols, channels * frames * patch * patch)
        return np.ascontiguousarray(flat, np.float32), (1, rows, cols)


def _rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency over white (as Hugging Face's convert_to_rgb)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")

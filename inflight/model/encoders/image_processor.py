"""Image preprocessing as a checkpoint's `preprocessor_config.json` asks for it (Hugging Face's
CLIP and SigLIP image processors): RGB, resize, center crop, rescale, normalize, channels
first. Pillow and numpy only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from PIL import Image

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# Hugging Face's `resample` codes are Pillow's.
_RESAMPLE = {int(f): f for f in Image.Resampling}


class Tower(Protocol):
    """What the processor reads of its vision tower's config (`vision.VisionConfig`)."""

    @property
    def tower(self) -> str: ...

    @property
    def image_size(self) -> int: ...


@dataclass(frozen=True)
class ImageProcessor:
    shortest_edge: int | None  # resize so the shorter side is this (aspect kept)...
    size: tuple[int, int] | None  # ... or to this (height, width)
    crop: tuple[int, int] | None  # center crop to (height, width)
    resample: Image.Resampling
    rescale: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None

    @classmethod
    def from_config(cls, config: dict[str, Any], vision: Tower) -> ImageProcessor:
        """From a `preprocessor_config.json` dict ({} takes the tower's usual processor)."""
        clip = vision.tower == "clip"
        edge = vision.image_size
        size = config.get("size", {"shortest_edge": edge} if clip else edge)
        if isinstance(size, int):
            size = {"height": size, "width": size}
        crop = config.get("crop_size", edge)
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        resize = config.get("do_resize", True)
        normalize = config.get("do_normalize", True)
        mean = config.get("image_mean", _CLIP_MEAN if clip else (0.5, 0.5, 0.5))
        std = config.get("image_std", _CLIP_STD if clip else (0.5, 0.5, 0.5))
        resample = int(config.get("resample", Image.Resampling.BICUBIC))
        rescale = config.get("rescale_factor", 1 / 255) if config.get("do_rescale", True) else None
        if resample not in _RESAMPLE:
            raise ValueError(f"preprocessor_config.json: unknown resample {resample}")
        return cls(
            shortest_edge=size.get("shortest_edge") if resize else None,
            size=(size["height"], size["width"]) if resize and "height" in size else None,
            crop=(crop["height"], crop["width"]) if config.get("do_center_crop", clip) else None,
            resample=_RESAMPLE[resample],
            rescale=rescale,
            mean=tuple(mean) if normalize else None,
            std=tuple(std) if normalize else None,
        )

    def __call__(self, image: Image.Image) -> np.ndarray:
        """The pixels the encoder takes: float32 [3, height, width]."""
        if not isinstance(image, Image.Image):
            raise ValueError(f"an image must be a PIL image, got {type(image).__name__}")
        image = image.convert("RGB")
        if self.shortest_edge is not None:
            width, height = image.size
            short, long = sorted((width, height))
            other = int(self.shortest_edge * long / short)
            size = (self.shortest_edge, other) if width <= height else (other, self.shortest_edge)
            image = image.resize(size, self.resample)
        elif self.size is not None:
            image = image.resize((self.size[1], self.size[0]), self.resample)
        pixels = np.asarray(image, dtype=np.uint8)
        if self.crop is not None:
            pixels = _center_crop(pixels, *self.crop)
        out = pixels.astype(np.float32)
        if self.rescale is not None:
            out = out * np.float32(self.rescale)
        if self.mean is not None and self.std is not None:
            out = (out - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
        return np.ascontiguousarray(out.transpose(2, 0, 1))


def _center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """The centered height x width window, padded with zeros where the image is smaller."""
    h, w = pixels.shape[:2]
    if h < height or w < width:
        padded = np.zeros((max(h, height), max(w, width), pixels.shape[2]), pixels.dtype)
        top, left = (padded.shape[0] - h) // 2, (padded.shape[1] - w) // 2
        padded[top : top + h, left : left + w] = pixels
        pixels, (h, w) = padded, padded.shape[:2]
    top, left = (h - height) // 2, (w - width) // 2
    return pixels[top : top + height, left : left + width]


def rescaled(
    pixels: np.ndarray,
    rescale: float | None,
    mean: tuple[float, ...] | None,
    std: tuple[float, ...] | None,
) -> np.ndarray:
    """uint8 pixels as float32, rescaled through float64 (as Hugging Face's rescale) and
    normalized where the processor does either."""
    if rescale is not None:
        pixels = pixels.astype(np.float64) * rescale
    pixels = pixels.astype(np.float32)
    if mean is not None and std is not None:
        pixels = (pixels - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    return pixels

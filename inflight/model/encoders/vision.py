"""The image side of a LLaVA-style model: a CLIP or SigLIP vision tower and the projector that
maps its patch features into the decoder's embedding width, its config (`VisionConfig`, read
from a LLaVA `config.json` by `vision_from_hf`), and the visual-token pruner.

`ImageEncoder` turns preprocessed images [N, 3, H, W] (`image_processor.py`) into
[N, tokens_per_image, hidden] prompt embeddings, which the decoder takes in place of the image
placeholder tokens. It runs eagerly, in the decoder's dtype, once per image: in the step that
starts its request's prefill (see `runtime/device/executor.py`, `runtime/device/encoder_cache.py`).
Parameters keep Hugging Face names below `vision_tower` and `multi_modal_projector`
(older checkpoints have a `vision_tower.vision_model` level, read as well).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from inflight.model.encoders.base import NO_BOUNDS, Bounds, PreparedItem, content_key
from inflight.model.encoders.image_processor import ImageProcessor
from inflight.model.weights import copy_weights


@dataclass(frozen=True)
class VisionConfig:
    """LLaVA-style image input: a CLIP or SigLIP vision tower, whose `feature_layer` output
    (Hugging Face's `vision_feature_layer`: 0 the embeddings, -1 the last layer) is projected
    into the decoder's width and takes the place of `image_token_id` placeholders, one per
    patch feature (`keep_cls`: the "full" strategy; "default" drops the first)."""

    tower: str  # "clip" or "siglip"
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    hidden_act: str
    image_token_id: int
    feature_layer: int = -2
    keep_cls: bool = False
    projector_act: str = "gelu"
    projector_bias: bool = True

    kind = "image"

    def __post_init__(self) -> None:
        if not 0 <= self.layers_run <= self.num_layers:
            raise ValueError(
                f"vision_feature_layer {self.feature_layer} is outside a tower of "
                f"{self.num_layers} layers"
            )

    @property
    def num_positions(self) -> int:
        patches = (self.image_size // self.patch_size) ** 2
        return patches + 1 if self.tower == "clip" else patches

    @property
    def layers_run(self) -> int:
        """Tower layers computed: those up to the one whose output is read."""
        return (
            self.feature_layer
            if self.feature_layer >= 0
            else self.num_layers + 1 + self.feature_layer
        )

    @property
    def tokens_per_image(self) -> int:
        return self.num_positions - (0 if self.keep_cls else 1)

    bounds: ClassVar[Bounds] = NO_BOUNDS

    @property
    def placeholder(self) -> int:
        return self.image_token_id

    def build(self, text_hidden: int) -> ImageEncoder:
        return ImageEncoder(self, text_hidden)

    def preparer(self, processor_config: dict[str, Any]) -> Callable[[Any], PreparedItem]:
        pixels = ImageProcessor.from_config(processor_config, self)
        tokens = self.tokens_per_image

        def prepare(image: Any) -> PreparedItem:
            data = pixels(image)
            return PreparedItem(data, tokens, content_key("image", data))

        return prepare


# CLIPVisionConfig's and SiglipVisionConfig's defaults (both a ViT-B at 224 pixels), for what
# a vision_config leaves out.
_VIT_B = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    image_size=224,
)
_TOWER_DEFAULTS = {
    "clip_vision_model": dict(_VIT_B, patch_size=32, hidden_act="quick_gelu", layer_norm_eps=1e-5),
    "siglip_vision_model": dict(
        _VIT_B, patch_size=16, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6
    ),
}


def vision_from_hf(cfg: dict[str, Any]) -> VisionConfig:
    """The vision tower of a LLaVA `config.json` dict."""
    vision = dict(cfg.get("vision_config") or {})
    kind = vision.get("model_type", "clip_vision_model")
    if kind not in _TOWER_DEFAULTS:
        raise ValueError(
            f"unsupported vision tower {kind!r}; supported: {', '.join(_TOWER_DEFAULTS)}"
        )
    vision = {**_TOWER_DEFAULTS[kind], **vision}
    layer = cfg.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise ValueError(f"vision_feature_layer {layer!r}: only a single layer is supported")
    strategy = cfg.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(f"unsupported vision_feature_select_strategy {strategy!r}")
    token = cfg.get("image_token_id", cfg.get("image_token_index"))
    if token is None:
        raise ValueError("a LLaVA config.json needs image_token_index (or image_token_id)")
    return VisionConfig(
        tower="clip" if kind == "clip_vision_model" else "siglip",
        hidden_size=vision["hidden_size"],
        intermediate_size=vision["intermediate_size"],
        num_layers=vision["num_hidden_layers"],
        num_heads=vision["num_attention_heads"],
        image_size=vision["image_size"],
        patch_size=vision["patch_size"],
        layer_norm_eps=float(vision["layer_norm_eps"]),
        hidden_act=vision["hidden_act"],
        image_token_id=int(token),
        feature_layer=layer,
        keep_cls=strategy == "full",
        projector_act=cfg.get("projector_hidden_act", "gelu"),
        projector_bias=bool(cfg.get("multimodal_projector_bias", True)),
    )


_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class _Embeddings(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        clip = config.tower == "clip"
        hidden, patch = config.hidden_size, config.patch_size
        # CLIP's patches carry no bias and a class token leads them; SigLIP's have neither.
        self.patch_embedding = nn.Conv2d(3, hidden, patch, stride=patch, bias=not clip)
        self.class_embedding = nn.Parameter(torch.empty(hidden)) if clip else None
        self.position_embedding = nn.Embedding(config.num_positions, hidden)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        return x + self.position_embedding.weight


class _Attention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_heads
        self.q_proj, self.k_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.v_proj, self.out_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, tokens, hidden = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(n, tokens, self.num_heads, -1).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        # Every patch attends to every patch of its image.
        out = F.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(q.shape[-1]))
        return self.out_proj(out.transpose(1, 2).reshape(n, tokens, hidden))


class _MLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _EncoderLayer(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        eps = config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.self_attn = _Attention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = _MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _Layers(nn.Module):
    def __init__(self, config: VisionConfig, count: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_EncoderLayer(config) for _ in range(count))


class _VisionModel(nn.Module):
    """The tower up to the layer whose output LLaVA takes (later layers are never run)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.embeddings = _Embeddings(config)
        # CLIP normalizes the embeddings before its first layer (Hugging Face's spelling).
        self.pre_layrnorm = (
            nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
            if config.tower == "clip"
            else None
        )
        self.encoder = _Layers(config, config.layers_run)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        for layer in self.encoder.layers:
            x = layer(x)
        return x


class _Projector(nn.Module):
    def __init__(self, config: VisionConfig, text_hidden: int) -> None:
        super().__init__()
        bias = config.projector_bias
        self.linear_1 = nn.Linear(config.hidden_size, text_hidden, bias=bias)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)
        self.act = activation(config.projector_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def prune_image_tokens(embeds: torch.Tensor, keep: int) -> torch.Tensor | None:
    """The visual-token pruner: the indices of the `keep` of one image's token embeddings
    [tokens, hidden] least similar (cosine) to the image's mean embedding, in their original
    order (None: all are kept). Patches alike (a uniform background) resemble the mean and go
    first; the distinctive ones stay. With 1-D positions the kept tokens take consecutive
    prompt positions; with M-RoPE each keeps its own 3-D position."""
    if keep >= embeds.shape[0]:
        return None
    scores = F.cosine_similarity(embeds.float(), embeds.float().mean(0, keepdim=True), dim=-1)
    return torch.topk(-scores, keep).indices.sort().values


class ImageEncoder(nn.Module):
    def __init__(self, config: VisionConfig, text_hidden: int) -> None:
        super().__init__()
        self.config = config
        self.vision_tower = _VisionModel(config)
        self.multi_modal_projector = _Projector(config, text_hidden)

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Prompt embeddings [N, tokens_per_image, text hidden] of images [N, 3, H, W]."""
        size = self.config.image_size
        if pixels.dim() != 4 or tuple(pixels.shape[1:]) != (3, size, size):
            raise ValueError(f"images must be [N, 3, {size}, {size}], got {tuple(pixels.shape)}")
        weight = self.multi_modal_projector.linear_1.weight
        features = self.vision_tower(pixels.to(weight.device, weight.dtype))
        if not self.config.keep_cls:
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    def encode(self, items: list[np.ndarray]) -> list[torch.Tensor]:
        """The prompt embeddings [tokens_per_image, text hidden] of each of preprocessed images
        [3, H, W] (`VisionConfig.preparer`), in one tower run."""
        device = self.multi_modal_projector.linear_1.weight.device
        return list(self(torch.from_numpy(np.stack(items)).to(device)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in: those of layers past the one LLaVA reads, the
        final norm and the pooling head are skipped (never run), and so is the positions'
        index buffer; a missing or unknown one, or a shape that differs, is a ValueError."""
        copy_weights(self, self._read(weights), "image encoder")

    def _read(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors this encoder holds, under its names."""
        prefix = "vision_tower."
        for name, tensor in weights:
            # The tower's own model level is in older checkpoints only.
            name = name.replace("vision_tower.vision_model.", prefix, 1)
            if name.startswith(prefix):
                rest = name.removeprefix(prefix)
                # Older checkpoints also saved the positions' index buffer.
                unused = ("post_layernorm.", "head.", "embeddings.position_ids")
                if rest.startswith(unused) or self._past_read(rest):
                    continue
                if rest == "embeddings.class_embedding":
                    tensor = tensor.reshape(-1)  # some checkpoints keep it [1, 1, hidden]
            yield name, tensor

    def _past_read(self, name: str) -> bool:
        if not name.startswith("encoder.layers."):
            return False
        return int(name.split(".")[2]) >= self.config.layers_run

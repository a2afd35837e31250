"""The shape of a Llama-family decoder, read from a Hugging Face `config.json` or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

# Hugging Face `architectures` entries this decoder implements, and the family each belongs to.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

ROPE_TYPES = ("default", "linear", "llama3")

# How a model's linear layers may run their matmuls (see `checkpoints/loader.build_model`).
QUANTIZATIONS = ("auto", "none", "int8", "q4")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # Llama-3 GGUF files store the scaling as per-frequency divisors (tensor `rope_freqs`).
    freq_factors: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.type not in ROPE_TYPES:
            raise ValueError(
                f"unsupported rope scaling type {self.type!r}; supported: {', '.join(ROPE_TYPES)}"
            )


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


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # Mistral v0.1 attends over a sliding window; sequences never grow past it here.
    sliding_window: int | None = None
    vision: VisionConfig | None = None  # image input (LLaVA), if any

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def max_context(self) -> int:
        """The longest sequence (prompt plus output) this model computes exactly."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings


def _rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta inside); older configs write `rope_theta`
    # and `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    return RopeConfig(
        theta=float(theta),
        type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))
        ),
    )


# Multimodal `architectures` entries: their decoder is `text_config`, of one of the families.
HF_MULTIMODAL = ("LlavaForConditionalGeneration",)
# A text_config names its family by model_type (the family's name) and may leave the rest at
# transformers' defaults (llava-1.5 writes a few fields only): those of LlamaConfig.
_TEXT_ARCHITECTURES = {family: arch for arch, family in HF_ARCHITECTURES.items()}
_LLAMA_DEFAULTS = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
)
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


def _vision_from_hf(cfg: dict[str, Any]) -> VisionConfig:
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


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from the dict in a Hugging Face `config.json`."""
    archs = cfg.get("architectures") or []
    if any(a in HF_MULTIMODAL for a in archs):
        text = dict(cfg.get("text_config") or {})
        kind = text.get("model_type", "llama")
        if kind not in _TEXT_ARCHITECTURES:
            raise ValueError(
                f"unsupported LLaVA text model {kind!r}; "
                f"supported: {', '.join(_TEXT_ARCHITECTURES)}"
            )
        text = {**_LLAMA_DEFAULTS, **text, "architectures": [_TEXT_ARCHITECTURES[kind]]}
        text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
        return replace(config_from_hf(text), vision=_vision_from_hf(cfg))
    family = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
    if family is None:
        raise ValueError(
            f"unsupported architecture {archs or cfg.get('model_type')!r}; "
            f"supported: {', '.join([*HF_ARCHITECTURES, *HF_MULTIMODAL])}"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}; this decoder implements SwiGLU (silu)")
    num_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
    sliding = cfg.get("sliding_window") if family == "mistral" else None
    attention_bias = bool(cfg.get("attention_bias", False))
    return ModelConfig(
        family=family,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        rope=_rope_from_hf(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or attention_bias,
        o_bias=family in ("llama", "qwen3") and attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=family == "qwen3",
        sliding_window=sliding,
    )

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
    # M-RoPE (Qwen2-VL): the rotary pairs split into (temporal, height, width) sections, each
    # rotated by its own coordinate of a token's 3-D position (text tokens: all three equal).
    mrope_section: tuple[int, ...] | None = None

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
    vision: VisionConfig | Qwen2VLVisionConfig | None = None  # image input, if any
    audio: AudioConfig | None = None  # audio input (Voxtral), if any
    mamba: MambaConfig | None = None  # hybrid Mamba2 layers (Bamba, NemotronH), if any

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
    section = params.get("mrope_section")
    if rope_type == "mrope":  # what Qwen2-VL's older configs call M-RoPE's default rotation
        rope_type = "default"
    return RopeConfig(
        theta=float(theta),
        type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))
        ),
        mrope_section=tuple(section) if section else None,
    )


# Multimodal `architectures` entries, by the layout of their config: their decoder is one of
# the families.
# Qwen2-VL's and Qwen2.5-VL's `architectures` entries, and the family of their image towers.
QWEN2_VL_FAMILIES = {
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
}
HF_MULTIMODAL = {
    "LlavaForConditionalGeneration": "llava",
    "VoxtralForConditionalGeneration": "llava",  # the same layout, an audio tower instead
    **dict.fromkeys(QWEN2_VL_FAMILIES, "qwen2_vl"),
}
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


def _multimodal_text(cfg: dict[str, Any], layout: str) -> dict[str, Any]:
    """The decoder's config of a multimodal config.json, as a text model's config.json."""
    if layout == "qwen2_vl":
        # transformers 5 nests it in text_config; older files keep it at the top level.
        text = cfg.get("text_config") or {k: v for k, v in cfg.items() if k != "vision_config"}
        return {**text, "architectures": ["Qwen2ForCausalLM"]}
    text = dict(cfg.get("text_config") or {})
    kind = text.get("model_type", "llama")
    if kind not in _TEXT_ARCHITECTURES:
        raise ValueError(
            f"unsupported multimodal text model {kind!r}; "
            f"supported: {', '.join(_TEXT_ARCHITECTURES)}"
        )
    return {**_LLAMA_DEFAULTS, **text, "architectures": [_TEXT_ARCHITECTURES[kind]]}


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from the dict in a Hugging Face `config.json`."""
    archs = cfg.get("architectures") or []
    if any(a in HF_HYBRID_ARCHITECTURES for a in archs):
        return hybrid_from_hf(cfg)
    layout = next((HF_MULTIMODAL[a] for a in archs if a in HF_MULTIMODAL), None)
    if layout is not None:
        text = _multimodal_text(cfg, layout)
        text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
        config = config_from_hf(text)
        if "audio_config" in cfg:
            return replace(config, audio=audio_from_hf(cfg))
        if layout == "qwen2_vl":
            if config.rope.mrope_section is None:
                raise ValueError("a Qwen2-VL config.json needs rope mrope_section")
            return replace(config, vision=qwen2_vl_vision_from_hf(cfg))
        return replace(config, vision=_vision_from_hf(cfg))
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


@dataclass(frozen=True)
class AudioConfig:
    """Voxtral's audio input: a Whisper-style encoder over log-mel windows of
    `frames_per_window` frames, which halves them to `max_source_positions` encoder frames;
    the projector stacks `intermediate_size // hidden_size` consecutive frames into one vector
    and maps it into the decoder's width, where it takes the place of one `audio_token_id`
    placeholder."""

    num_mel_bins: int
    hidden_size: int  # Whisper's d_model
    num_layers: int
    num_heads: int
    intermediate_size: int  # the layers' MLP width, and the width of a stack of frames
    max_source_positions: int
    audio_token_id: int
    activation: str = "gelu"
    projector_act: str = "gelu"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"audio hidden_size {self.hidden_size} is not a multiple of "
                f"num_attention_heads {self.num_heads}"
            )
        # Transformers flattens the whole batch before stacking: only whole stacks per window
        # keep one window's frames out of another's tokens.
        if (
            self.intermediate_size % self.hidden_size
            or self.max_source_positions % self.frames_per_token
        ):
            raise ValueError(
                f"audio intermediate_size {self.intermediate_size} must stack a whole number "
                f"of {self.hidden_size}-wide frames, dividing max_source_positions "
                f"{self.max_source_positions}"
            )

    @property
    def frames_per_token(self) -> int:
        """Encoder frames stacked into one audio token."""
        return self.intermediate_size // self.hidden_size

    @property
    def frames_per_window(self) -> int:
        """Mel frames one encoder window takes (its second convolution has stride 2)."""
        return 2 * self.max_source_positions

    @property
    def tokens_per_window(self) -> int:
        return self.max_source_positions * self.hidden_size // self.intermediate_size


# VoxtralEncoderConfig's defaults (Voxtral Mini's encoder), for what an audio_config leaves
# out, and the Whisper spellings it also accepts.
_VOXTRAL_ENCODER = dict(
    num_mel_bins=128,
    hidden_size=1280,
    num_hidden_layers=32,
    num_attention_heads=20,
    intermediate_size=5120,
    max_source_positions=1500,
    activation_function="gelu",
)
_WHISPER_NAMES = {
    "d_model": "hidden_size",
    "encoder_layers": "num_hidden_layers",
    "encoder_attention_heads": "num_attention_heads",
    "encoder_ffn_dim": "intermediate_size",
}


def audio_from_hf(cfg: dict[str, Any]) -> AudioConfig:
    """The audio side of a `VoxtralForConditionalGeneration` config.json dict."""
    audio = dict(cfg.get("audio_config") or {})
    kind = audio.get("model_type", "voxtral_encoder")
    if kind != "voxtral_encoder":
        raise ValueError(f"unsupported audio encoder {kind!r}; supported: voxtral_encoder")
    for whisper, name in _WHISPER_NAMES.items():
        if whisper in audio:
            audio.setdefault(name, audio[whisper])
    audio = {**_VOXTRAL_ENCODER, **audio}
    token = cfg.get("audio_token_id")
    if token is None:
        raise ValueError("a Voxtral config.json needs audio_token_id")
    return AudioConfig(
        num_mel_bins=audio["num_mel_bins"],
        hidden_size=audio["hidden_size"],
        num_layers=audio["num_hidden_layers"],
        num_heads=audio["num_attention_heads"],
        intermediate_size=audio["intermediate_size"],
        max_source_positions=audio["max_source_positions"],
        audio_token_id=int(token),
        activation=audio["activation_function"],
        projector_act=cfg.get("projector_hidden_act", "gelu"),
    )


# Hybrid Mamba2/attention `architectures` entries, and the family each belongs to.
HF_HYBRID_ARCHITECTURES = {
    "BambaForCausalLM": "bamba",
    "NemotronHForCausalLM": "nemotron_h",
}
MAMBA_LAYER_TYPES = ("mamba", "attention", "mlp")
# transformers' default scan block length of each family, for a config.json that gives none and
# for GGUF files, which never record it. The scan's block length changes results by rounding only.
MAMBA_CHUNK_SIZES = {"bamba": 256, "nemotron_h": 128}
# config.time_step_min's default: transformers' NemotronH clamps softplus(dt + dt_bias) from below
# at it.
NEMOTRON_H_TIME_STEP_MIN = 0.001


@dataclass(frozen=True)
class MambaConfig:
    """The Mamba2 side of a hybrid decoder (Bamba, NemotronH), and how its layers are laid out.

    Each decoder layer is one kind (`layer_types`): "mamba" (a Mamba2 mixer with a state slot
    per sequence), "attention" (paged KV) or "mlp" (NemotronH only). Bamba follows every layer's
    mixer with a SwiGLU MLP of its own; NemotronH's MLPs are layers of their own, relu² without a
    gate. A Mamba2 mixer has `n_heads` heads of `head_dim` channels, whose state is `d_state` wide
    and whose B and C are shared by groups of n_heads / n_groups heads."""

    layer_types: tuple[str, ...]
    n_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    d_conv: int
    chunk_size: int  # the chunked scan's block length
    conv_bias: bool
    proj_bias: bool  # in_proj and out_proj
    norm_eps: float  # the gated RMSNorm's
    # softplus(dt + dt_bias) is clamped into this range. NemotronH's is (time_step_min, inf):
    # transformers' NemotronH mixer clamps so, whatever config.json's time_step_limit says.
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    # The attention heads' leading fraction that RoPE rotates (Bamba 0.5; 0: no RoPE, NemotronH).
    partial_rotary_factor: float = 1.0

    def __post_init__(self) -> None:
        unknown = set(self.layer_types) - set(MAMBA_LAYER_TYPES)
        if unknown:
            raise ValueError(
                f"unsupported hybrid layer types {sorted(unknown)}; "
                f"supported: {', '.join(MAMBA_LAYER_TYPES)}"
            )
        if self.n_heads % self.n_groups:
            raise ValueError(
                f"mamba heads ({self.n_heads}) must be a multiple of its groups ({self.n_groups})"
            )
        if self.d_conv < 2:
            raise ValueError(f"mamba conv kernel {self.d_conv} is shorter than 2")

    @property
    def d_inner(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal convolution: x, B and C."""
        return self.d_inner + 2 * self.n_groups * self.d_state

    @property
    def num_mamba_layers(self) -> int:
        return self.layer_types.count("mamba")

    @property
    def num_attention_layers(self) -> int:
        return self.layer_types.count("attention")


def _hf_float(value: Any) -> float:
    # transformers 5 writes infinity as {"__float__": "Infinity"}; Python's json reads Infinity.
    if isinstance(value, dict):
        value = value["__float__"]
    return float(value)


def _first(cfg: dict[str, Any], names: tuple[str, ...], default: Any) -> Any:
    """The value of the first of `names` that `cfg` has (older configs spell some fields so)."""
    return next((cfg[name] for name in names if name in cfg), default)


# NemotronH's layer kinds, in all the spellings its configs use (a hybrid_override_pattern is a
# string of one character per layer).
_NEMOTRON_H_KINDS = {
    "linear_attention": "mamba",
    "mamba": "mamba",
    "M": "mamba",
    "full_attention": "attention",
    "attention": "attention",
    "*": "attention",
    "mlp": "mlp",
    "-": "mlp",
    "moe": "moe",
    "E": "moe",
}


def _bamba_from_hf(cfg: dict[str, Any]) -> tuple[ModelConfig, MambaConfig]:
    hidden, heads = cfg.get("hidden_size", 4096), cfg.get("num_attention_heads", 32)
    layers = cfg.get("num_hidden_layers", 32)
    attention = set(cfg.get("attn_layer_indices") or ())
    n_heads, expand = cfg.get("mamba_n_heads", 128), cfg.get("mamba_expand", 2)
    head_dim = cfg.get("mamba_d_head", "auto")
    if head_dim == "auto":
        head_dim = expand * hidden // n_heads
    if n_heads * head_dim != expand * hidden:
        raise ValueError(
            f"mamba_n_heads * mamba_d_head ({n_heads} * {head_dim}) must be mamba_expand * "
            f"hidden_size ({expand} * {hidden})"
        )
    rope = _rope_from_hf(cfg)
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    eps = float(cfg.get("rms_norm_eps", 1e-5))
    limit = cfg.get("time_step_limit") or (0.0, float("inf"))
    mamba = MambaConfig(
        layer_types=tuple("attention" if i in attention else "mamba" for i in range(layers)),
        n_heads=n_heads,
        head_dim=head_dim,
        n_groups=cfg.get("mamba_n_groups", 1),
        d_state=cfg.get("mamba_d_state", 256),
        d_conv=cfg.get("mamba_d_conv", 4),
        chunk_size=cfg.get("mamba_chunk_size", MAMBA_CHUNK_SIZES["bamba"]),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        norm_eps=eps,
        time_step_limit=(_hf_float(limit[0]), _hf_float(limit[1])),
        # transformers forces 0.5 whatever the config says; older configs leave it out.
        partial_rotary_factor=float(params.get("partial_rotary_factor", 0.5)),
    )
    bias = bool(cfg.get("attention_bias", False))
    config = ModelConfig(
        family="bamba",
        vocab_size=cfg.get("vocab_size", 128000),
        hidden_size=hidden,
        intermediate_size=cfg.get("intermediate_size", 14336),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        rms_norm_eps=eps,
        max_position_embeddings=cfg.get("max_position_embeddings", 262144),
        rope=rope,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
    )
    return config, mamba


def _nemotron_h_from_hf(cfg: dict[str, Any]) -> tuple[ModelConfig, MambaConfig]:
    kinds = cfg.get("layers_block_type") or cfg.get("hybrid_override_pattern")
    if not kinds:
        raise ValueError("a NemotronH config.json needs layers_block_type")
    unknown = [kind for kind in kinds if kind not in _NEMOTRON_H_KINDS]
    if unknown:
        raise ValueError(f"unknown NemotronH layer type {unknown[0]!r}")
    layer_types = tuple(_NEMOTRON_H_KINDS[kind] for kind in kinds)
    if "moe" in layer_types:
        raise ValueError("NemotronH mixture-of-experts layers are not supported")
    act = cfg.get("mlp_hidden_act", "relu2")
    if act != "relu2":
        raise ValueError(f"unsupported NemotronH mlp_hidden_act {act!r}; supported: relu2")
    hidden, heads = cfg.get("hidden_size", 4096), cfg.get("num_attention_heads", 32)
    eps = float(cfg.get("layer_norm_epsilon", 1e-5))
    mamba = MambaConfig(
        layer_types=layer_types,
        n_heads=cfg.get("mamba_num_heads", 128),
        head_dim=cfg.get("mamba_head_dim", 64),
        n_groups=_first(cfg, ("n_groups", "mamba_n_groups"), 8),
        d_state=cfg.get("ssm_state_size", 128),
        d_conv=_first(cfg, ("conv_kernel", "mamba_d_conv"), 4),
        chunk_size=_first(cfg, ("chunk_size", "mamba_chunk_size"), MAMBA_CHUNK_SIZES["nemotron_h"]),
        conv_bias=bool(_first(cfg, ("use_conv_bias", "mamba_conv_bias"), True)),
        proj_bias=bool(cfg.get("use_bias", False)),
        norm_eps=eps,
        time_step_limit=(
            _hf_float(_first(cfg, ("time_step_min", "mamba_dt_min"), NEMOTRON_H_TIME_STEP_MIN)),
            float("inf"),
        ),
        partial_rotary_factor=0.0,
    )
    config = ModelConfig(
        family="nemotron_h",
        vocab_size=cfg.get("vocab_size", 131072),
        hidden_size=hidden,
        intermediate_size=cfg.get("intermediate_size", 21504),
        num_layers=len(layer_types),
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg.get("attention_head_dim") or hidden // heads,
        rms_norm_eps=eps,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
    )
    return config, mamba


def hybrid_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """The ModelConfig, its `mamba` filled in, of a `BambaForCausalLM` or
    `NemotronHForCausalLM` config.json dict (transformers' defaults for what it leaves out)."""
    archs = cfg.get("architectures") or []
    family = next((HF_HYBRID_ARCHITECTURES[a] for a in archs if a in HF_HYBRID_ARCHITECTURES), None)
    if family is None:
        raise ValueError(f"not a hybrid Mamba2 architecture: {archs!r}")
    act = cfg.get("hidden_act" if family == "bamba" else "mamba_hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hybrid activation {act!r}; supported: silu")
    build = _bamba_from_hf if family == "bamba" else _nemotron_h_from_hf
    return hybrid_config(*build(cfg))


def hybrid_config(config: ModelConfig, mamba: MambaConfig) -> ModelConfig:
    """`config` with `mamba` as its hybrid side, whichever format the checkpoint came in; a
    ValueError where the partial rotary factor would split a rotated pair."""
    if mamba.partial_rotary_factor and (
        int(config.head_dim * mamba.partial_rotary_factor) % 2 or mamba.partial_rotary_factor > 1
    ):
        raise ValueError(
            f"partial_rotary_factor {mamba.partial_rotary_factor} of heads of {config.head_dim} "
            "does not rotate whole pairs"
        )
    return replace(config, mamba=mamba)

"""The shape of a Llama-family decoder, read from a Hugging Face `config.json` or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from inflight.model.encoders.audio import audio_from_hf
from inflight.model.encoders.qwen2_vl import QWEN2_VL_FAMILIES, qwen2_vl_vision_from_hf
from inflight.model.encoders.vision import vision_from_hf

if TYPE_CHECKING:
    from inflight.model.encoders.base import EncoderConfig

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
    vision: EncoderConfig | None = None  # image input, if any
    audio: EncoderConfig | None = None  # audio input (Voxtral), if any
    mamba: MambaConfig | None = None  # hybrid Mamba2 layers (Bamba, NemotronH), if any

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def encoders(self) -> tuple[EncoderConfig, ...]:
        """The media encoders it takes input through (images', then audio's)."""
        return tuple(encoder for encoder in (self.vision, self.audio) if encoder is not None)

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
        return replace(config, vision=vision_from_hf(cfg))
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

"""The shape of a Llama-family decoder, read from a Hugging Face `config.json` or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
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


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from the dict in a Hugging Face `config.json`."""
    archs = cfg.get("architectures") or []
    family = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
    if family is None:
        raise ValueError(
            f"unsupported architecture {archs or cfg.get('model_type')!r}; "
            f"supported: {', '.join(HF_ARCHITECTURES)}"
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

"""The shape of a decoder, whichever family it belongs to (see `registry.py`): what its family's
parser reads from a Hugging Face `config.json` or GGUF metadata, and what those parsers share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inflight.model.encoders.base import EncoderConfig

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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
    # Qwen3-VL and Qwen3-Omni interleave the sections instead: pair i reads the height
    # coordinate where i % 3 == 1 (within the first 3 * section[1] pairs), the width one where
    # i % 3 == 2 (within 3 * section[2]), the temporal one otherwise.
    mrope_interleaved: bool = False
    # YaRN (gpt-oss): frequencies interpolated below `beta_slow` rotations over the original
    # context, kept above `beta_fast`, ramped between (the bounds rounded outwards where
    # `truncate`); cos and sin scaled by `attention_factor` (None: from `factor`, and
    # `mscale` / `mscale_all_dim` where both are given).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None

    def __post_init__(self) -> None:
        if self.type not in ROPE_TYPES:
            raise ValueError(
                f"unsupported rope scaling type {self.type!r}; supported: {', '.join(ROPE_TYPES)}"
            )


# The kinds of a hybrid decoder's layers.
MAMBA_LAYER_TYPES = ("mamba", "attention", "mlp", "moe")


@dataclass(frozen=True)
class MambaConfig:
    """The Mamba2 side of a hybrid decoder (Bamba, NemotronH), and how its layers are laid out.

    Each decoder layer is one kind (`layer_types`): "mamba" (a Mamba2 mixer with a state slot
    per sequence), "attention" (paged KV), "mlp" or "moe" (NemotronH only: the mixture of
    experts `ModelConfig.moe` describes). Bamba follows every layer's mixer with a SwiGLU MLP of
    its own; NemotronH's MLPs are layers of their own, relu² without a gate. A Mamba2 mixer has
    `n_heads` heads of `head_dim` channels, whose state is `d_state` wide and whose B and C are
    shared by groups of n_heads / n_groups heads."""

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


# How a router scores the experts: "softmax" (top-k of the logits, weighted by their softmax:
# over the k, or over all experts where the weights are not renormalized) or "sigmoid" (each
# expert's sigmoid, chosen with a selection bias, within the best groups).
ROUTER_SCORINGS = ("softmax", "sigmoid")
# An expert's feed-forward: "silu" (SwiGLU), "relu2" (relu(up x)², no gate), "swiglu_clamped"
# (gpt-oss: gate and up clamped, (up + 1) * gate * sigmoid(alpha * gate)).
EXPERT_ACTIVATIONS = ("silu", "relu2", "swiglu_clamped", "gelu_tanh")


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts layers of a decoder: which layers are sparse, how their router
    picks `top_k` of `num_experts` experts for each token and weights them, and the experts'
    shape. A sparse layer may add a shared expert (an MLP every token runs, of
    `shared_intermediate_size`; `shared_gate`: scaled by sigmoid(x · w), Qwen2-MoE)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    sparse_layers: tuple[int, ...]  # the decoder layers whose MLP is the mixture
    scoring: str = "softmax"
    renormalize: bool = True  # the k weights divided by their sum
    router_bias: bool = False  # gpt-oss: a bias on the router's logits
    selection_bias: bool = False  # sigmoid routers: a per-expert bias that only chooses
    num_groups: int = 1  # sigmoid routers: experts in groups, of which the best `topk_groups`
    topk_groups: int = 1
    scaling_factor: float = 1.0  # the chosen weights scaled by it
    activation: str = "silu"
    expert_bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    shared_intermediate_size: int = 0
    shared_gate: bool = False
    # NemotronH: the routed experts run on x projected down to this width and their sum is
    # projected back (0: they run on x itself); `latent_bias`: the projections have biases.
    latent_size: int = 0
    latent_bias: bool = False

    def __post_init__(self) -> None:
        if self.scoring not in ROUTER_SCORINGS:
            raise ValueError(
                f"unsupported router scoring {self.scoring!r}; "
                f"supported: {', '.join(ROUTER_SCORINGS)}"
            )
        if self.activation not in EXPERT_ACTIVATIONS:
            raise ValueError(
                f"unsupported expert activation {self.activation!r}; "
                f"supported: {', '.join(EXPERT_ACTIVATIONS)}"
            )
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(
                f"experts per token ({self.top_k}) must be in 1..{self.num_experts} (the experts)"
            )
        if self.num_experts % self.num_groups or not 0 < self.topk_groups <= self.num_groups:
            raise ValueError(
                f"{self.num_experts} experts in {self.num_groups} groups, of which "
                f"{self.topk_groups} chosen: the groups must divide the experts and hold the "
                "chosen ones"
            )

    @property
    def gated(self) -> bool:
        """Whether an expert's first matmul yields a gate and an up half (all but relu²)."""
        return self.activation != "relu2"


@dataclass(frozen=True)
class SpeechConfig:
    """A text-to-speech model's side beside its talker decoder (Qwen3-TTS): the decoder reads
    one embedding per position (projected text plus codec rows) and predicts a frame's first
    codebook; a small code predictor fills the frame's other `num_code_groups - 1` codebooks;
    the speech tokenizer's decoder turns frames into audio.

    `kind` is `tts_model_type`: "custom_voice" (preset `speakers`, by codec row),
    "voice_design" (a voice described by instructions) or "base" (a voice cloned from reference
    audio through the speaker encoder). Special ids: text tokens (`text_ids`: im_start, im_end,
    tts_pad, tts_bos, tts_eos) and codec rows (`codec_ids`: pad, bos, eos, think, nothink,
    think_bos, think_eos). `dialects`: the language a dialect speaker switches to."""

    kind: str
    num_code_groups: int
    text_vocab_size: int
    text_hidden_size: int
    text_ids: dict[str, int]
    codec_ids: dict[str, int]
    speakers: dict[str, int]
    languages: dict[str, int]
    dialects: dict[str, str]
    code_predictor: ModelConfig
    # The speech tokenizer's `decoder_config` and the speaker encoder's config, as in the
    # checkpoint (their modules read them: model/speech/).
    codec_decoder: dict[str, Any]
    speaker_encoder: dict[str, Any] | None
    sample_rate: int = 24000


@dataclass(frozen=True)
class TalkerConfig:
    """The spoken side of a model that answers in text and speech (Qwen3-Omni): a talker
    decoder over the codec vocabulary (`decoder`, mixture-of-experts with a shared expert) that
    reads the thinker's rows projected into its width, one reply token a frame; a code
    predictor filling a frame's other codebooks; Code2Wav (`code2wav`, as in the checkpoint)
    turning frames into audio.

    Special ids: the thinker's (`text_ids`: im_start, im_end, user, assistant, system, tts_pad,
    tts_bos, tts_eos; and the media placeholders in `media_ids`: audio, image, video) and the
    codec's (`codec_ids`: pad, bos, eos, nothink, think_bos, think_eos). `speakers`: voice name
    (lower case) -> codec row. `accept_hidden_layer`: the thinker layer whose hidden states of
    a prompt's media positions the talker reads."""

    decoder: ModelConfig
    code_predictor: ModelConfig
    num_code_groups: int
    thinker_hidden_size: int
    accept_hidden_layer: int
    text_ids: dict[str, int]
    media_ids: dict[str, int]
    codec_ids: dict[str, int]
    speakers: dict[str, int]
    code2wav: dict[str, Any]
    sample_rate: int = 24000


@dataclass(frozen=True)
class DenoiseDefaults:
    """A block-diffusion model's denoising settings where a request leaves them unset (its
    generation_config.json, else transformers' defaults): at most `max_denoising_steps` steps a
    canvas, the temperature falling linearly from `t_max` to `t_min` over them, positions
    accepted while their entropies beyond the largest sum to at most `entropy_bound`, and a
    canvas ends early once its argmax held for `stability_threshold` steps and its mean entropy
    is below `confidence_threshold`."""

    max_denoising_steps: int = 48
    t_min: float = 0.4
    t_max: float = 0.8
    entropy_bound: float = 0.1
    stability_threshold: int = 1
    confidence_threshold: float = 0.005


@dataclass(frozen=True)
class DiffusionConfig:
    """A block-diffusion decoder (DiffusionGemma): the text is written a canvas of
    `canvas_length` tokens at a time. The decoder's layers serve two passes: a causal one that
    writes the KV of the prompt and of each finished canvas, and a bidirectional one over
    [KV | canvas] that reads it (self-conditioned on the previous step's predictions).

    Its full-attention layers (`ModelConfig.layer_windows` None) have heads of
    `global_head_dim` and `global_kv_heads` key/value heads, whose values are their keys before
    the key norm and rotation (no value projection), and a rotation of the first
    `global_rotary_fraction` of the head at `global_rope_theta`; the sliding layers' are the
    decoder's `head_dim`, `num_kv_heads` and `rope`. The logits are soft-capped at
    `logit_softcap`."""

    canvas_length: int
    global_head_dim: int
    global_kv_heads: int
    global_rope_theta: float
    global_rotary_fraction: float
    logit_softcap: float
    defaults: DenoiseDefaults = field(default_factory=DenoiseDefaults)
    # The encode pass lets an image's tokens attend to each other both ways
    # (`use_bidirectional_attention: "vision"`); otherwise it is causal throughout.
    media_bidirectional: bool = False


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
    # A learned logit per query head that joins each softmax of the head's as one more score
    # and weights no value (gpt-oss).
    attention_sinks: bool = False
    # Each decoder layer's attention window: its queries at position p see keys p - w + 1 .. p
    # (None: every key before them). Empty: every layer attends fully.
    layer_windows: tuple[int | None, ...] = ()
    vision: EncoderConfig | None = None  # image input, if any
    audio: EncoderConfig | None = None  # audio input (Voxtral), if any
    mamba: MambaConfig | None = None  # hybrid Mamba2 layers (Bamba, NemotronH), if any
    moe: MoEConfig | None = None  # mixture-of-experts layers, if any
    speech: SpeechConfig | None = None  # a text-to-speech model's (its output is audio)
    talker: TalkerConfig | None = None  # a model that may speak its replies (Qwen3-Omni)
    diffusion: DiffusionConfig | None = None  # a block-diffusion model (DiffusionGemma)

    def __post_init__(self) -> None:
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(
                f"{len(self.layer_windows)} attention windows for {self.num_layers} layers"
            )
        if any(w is not None and w < 1 for w in self.layer_windows):
            raise ValueError(f"an attention window of no tokens: {self.layer_windows}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def encoders(self) -> tuple[EncoderConfig, ...]:
        """The media encoders it takes input through (images', then audio's)."""
        return tuple(encoder for encoder in (self.vision, self.audio) if encoder is not None)

    def window(self, layer: int) -> int | None:
        """Decoder layer `layer`'s attention window (None: full attention)."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def kv_window(self) -> int | None:
        """How far back any layer looks when every layer slides: the widest window, past which
        a sequence's KV is never read again; None where some layer attends fully."""
        if not self.layer_windows or None in self.layer_windows:
            return None
        return max(w for w in self.layer_windows if w is not None)

    @property
    def sliding_group_window(self) -> int | None:
        """Where some layers slide and others attend fully (gpt-oss, Qwen `layer_types`): the
        sliding layers' widest window, past which their KV is never read again; None
        otherwise."""
        windows = [w for w in self.layer_windows if w is not None]
        if not windows or len(windows) == len(self.layer_windows):
            return None
        return max(windows)


def rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    """The rotary embedding of a `config.json` dict."""
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
        mrope_interleaved=bool(params.get("mrope_interleaved", False)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
    )

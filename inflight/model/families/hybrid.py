"""Hybrid Mamba2/attention decoders: Bamba and NemotronH, their config parsing (Hugging Face and
GGUF: llama.cpp's `granitehybrid` and `nemotron_h`) and llama.cpp's names and layouts of their
tensors. Registers the flavours bamba and nemotron_h (a config's `family`).

Each layer is of one kind (`MambaConfig.layer_types`): a Mamba2 mixer (layers/mamba.py), which
reads and writes each sequence's state slot; attention over the paged KV cache (llama.py's,
with RoPE on the leading part of each head only (Bamba) or none at all (NemotronH)); or
NemotronH's relu² MLP, or its mixture of relu² experts (layers/moe.py: a sigmoid router with a
selection bias, and a relu² MLP as the shared expert). A layer is norm -> mixer, added to the
residual stream; Bamba's layers then add norm -> SwiGLU MLP. Only attention layers have a KV
cache.

Parameters are named `layers.{i}.norm`, `layers.{i}.mixer.*` (and Bamba's `layers.{i}.mlp_norm`,
`layers.{i}.mlp.*`), `embed_tokens`, `norm`, `lm_head`, below the layer as transformers names
them, but that q/k/v and gate/up are stored fused (`qkv_proj`, `gate_up_proj`) as in llama.py
and a mixture's shared expert is `mixer.shared_expert` (transformers: `shared_experts`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from inflight.model.attention import AttentionBackend
from inflight.model.config import MambaConfig, ModelConfig, MoEConfig, rope_from_hf
from inflight.model.contract import ForwardBatch, ModelCaches
from inflight.model.families.llama import (
    GLOBAL_TENSORS,
    MLP,
    Attention,
    build_lm_head,
    decoder_linear,
    gguf_layer_kind,
    gguf_rope,
    gguf_vocab_size,
    shard_sizes,
    unpermute_qk,
)
from inflight.model.layers.linear import process_weights_after_loading
from inflight.model.layers.lora import LoRAMapping
from inflight.model.layers.lora_adapters import LoRAAdapters
from inflight.model.layers.mamba import Mamba2Mixer, MambaRows, MambaStates
from inflight.model.layers.moe import Experts, SparseMoeBlock, load_expert_tensors
from inflight.model.layers.norm import RMSNorm
from inflight.model.layers.parallel import TensorParallel
from inflight.model.layers.platform import Platform
from inflight.model.layers.quantization import LinearMethods
from inflight.model.layers.rotary import Angles, RotaryEmbedding
from inflight.model.metadata import AttentionMetadata, KVCache
from inflight.model.registry import Family, GGUFMetadata, register
from inflight.model.weights import load_fused

# Checkpoint name prefix -> ours, per family (NemotronH's checkpoints say `backbone.`,
# transformers' module tree `model.`).
_PREFIXES = {
    "bamba": (
        ("model.embed_tokens.", "embed_tokens."),
        ("model.final_layernorm.", "norm."),
        ("model.layers.", "layers."),
    ),
    "nemotron_h": tuple(
        (f"{root}.{theirs}", ours)
        for root in ("backbone", "model")
        for theirs, ours in (
            ("embeddings.", "embed_tokens."),
            ("norm_f.", "norm."),
            ("layers.", "layers."),
        )
    ),
}
# A Bamba layer's module names -> ours.
_BAMBA_MODULES = {
    ".input_layernorm.": ".norm.",
    ".mamba.": ".mixer.",
    ".self_attn.": ".mixer.",
    ".pre_ff_layernorm.": ".mlp_norm.",
    ".feed_forward.": ".mlp.",
}
# Fused parameter -> the parts it stacks, in order. NemotronH's MLP (`mixer.up_proj`) has no
# gate and stays unfused.
_FUSED_PARTS = {
    ".mixer.qkv_proj.": (".mixer.q_proj.", ".mixer.k_proj.", ".mixer.v_proj."),
    ".mlp.gate_up_proj.": (".mlp.gate_proj.", ".mlp.up_proj."),
}
_FUSED = {part: (fused, i) for fused, parts in _FUSED_PARTS.items() for i, part in enumerate(parts)}
# Where a mixture's experts are, below a layer.
_EXPERTS = ".mixer.experts."


class PartialRotaryAttention(Attention):
    """Llama's attention, RoPE rotating the leading `rotary_dim` values of each query and key
    head (transformers' partial_rotary_factor) and leaving the rest; 0: no RoPE."""

    def __init__(
        self,
        config: ModelConfig,
        platform: Platform,
        methods: LinearMethods,
        prefix: str,
        rotary_dim: int,
    ) -> None:
        super().__init__(config, platform, methods, prefix)
        self.rotary_dim = rotary_dim

    def forward(
        self,
        x: torch.Tensor,
        angles: Angles | None,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        tokens, heads, rotary = x.shape[0], self.num_heads, self.rotary_dim
        qkv = self.qkv_proj(x)
        qk_size = self.q_size + self.kv_size
        qk = qkv[:, :qk_size].view(tokens, heads + self.num_kv_heads, self.head_dim)
        if rotary == self.head_dim:
            qk = self.rope(qk, angles)
        elif rotary:
            qk = torch.cat((self.rope(qk[..., :rotary], angles), qk[..., rotary:]), dim=-1)
        v = qkv[:, qk_size:].view(tokens, self.num_kv_heads, self.head_dim)
        out = backend.forward(qk[:, :heads], qk[:, heads:], v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(tokens, self.q_size))


class Relu2MLP(nn.Module):
    """NemotronH's MLP: down_proj(relu(up_proj(x))²), no gate; `intermediate` wide (default
    the config's: a mixture's shared expert has a width of its own)."""

    def __init__(
        self,
        config: ModelConfig,
        methods: LinearMethods,
        prefix: str,
        intermediate: int | None = None,
    ) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, config.mlp_bias
        intermediate = intermediate or config.intermediate_size
        self.up_proj = decoder_linear(hidden, intermediate, bias, methods, f"{prefix}.up_proj")
        self.down_proj = decoder_linear(intermediate, hidden, bias, methods, f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor, lora: LoRAMapping | None = None) -> torch.Tensor:
        # `lora`: what SparseMoeBlock hands its shared expert; a hybrid has no adapters.
        return self.down_proj(torch.relu(self.up_proj(x)).square())


def _mixture(
    config: ModelConfig, platform: Platform, methods: LinearMethods, prefix: str
) -> SparseMoeBlock:
    """NemotronH's mixture-of-experts layer, its shared expert a relu² MLP of its own width."""
    moe = config.moe
    shared = None
    if moe.shared_intermediate_size:
        shared = Relu2MLP(config, methods, f"{prefix}.shared_expert", moe.shared_intermediate_size)
    return SparseMoeBlock(config.hidden_size, moe, platform, methods, prefix, shared)


@dataclass
class _Step:
    """What a forward pass hands every layer."""

    angles: Angles | None
    meta: AttentionMetadata
    backend: AttentionBackend
    rows: MambaRows | None


# A layer's cache: attention's KV pair, a Mamba mixer's (conv, ssm) states, an MLP's nothing.
LayerCache = tuple[torch.Tensor, torch.Tensor] | None


class HybridLayer(nn.Module):
    def __init__(
        self,
        kind: str,
        config: ModelConfig,
        platform: Platform,
        methods: LinearMethods,
        prefix: str,
        rotary_dim: int,
    ) -> None:
        super().__init__()
        self.kind = kind
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.norm = RMSNorm(hidden, eps, platform)
        if kind == "mamba":
            self.mixer = Mamba2Mixer(config.mamba, hidden, methods, f"{prefix}.mixer")
        elif kind == "attention":
            self.mixer = PartialRotaryAttention(
                config, platform, methods, f"{prefix}.mixer", rotary_dim
            )
        elif kind == "moe":
            self.mixer = _mixture(config, platform, methods, f"{prefix}.mixer")
        else:
            self.mixer = Relu2MLP(config, methods, f"{prefix}.mixer")
        self.mlp_norm = self.mlp = None
        if config.family == "bamba":
            self.mlp_norm = RMSNorm(hidden, eps, platform)
            self.mlp = MLP(config, platform, methods, f"{prefix}.mlp")

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cache: LayerCache, step: _Step
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's output before its residual add, and the residual stream (each residual
        add fused into the norm that follows it, as in llama.py)."""
        if residual is None:
            h, residual = self.norm(x), x
        else:
            h, residual = self.norm.add_forward(x, residual)
        if self.kind == "mamba":
            h = self.mixer(h, step.meta, step.rows, *cache)
        elif self.kind == "attention":
            h = self.mixer(h, step.angles, cache, step.meta, step.backend)
        else:  # an MLP or a mixture of experts
            h = self.mixer(h)
        if self.mlp is not None:
            h, residual = self.mlp_norm.add_forward(h, residual)
            h = self.mlp(h, None)
        return h, residual


class HybridForCausalLM(nn.Module):
    """A Bamba or NemotronH model (config.mamba set), with LlamaForCausalLM's surface where the
    runtime uses it; no LoRA (no adapter slots), no media input and no tensor parallelism
    (`parallel` is refused)."""

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        platform: Platform,
        methods: LinearMethods,
        max_loras: int = 0,
        max_lora_rank: int = 16,
        parallel: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        if config.mamba is None:
            raise ValueError(f"a {config.family} config describes no hybrid Mamba model")
        if parallel is not None or max_loras:
            # The deployment plan refuses both with their alternatives; a direct build too.
            raise ValueError(f"a {config.family} model is built whole, with no LoRA slots")
        self.config = config
        hidden = config.hidden_size
        rotary_dim = int(config.head_dim * config.mamba.partial_rotary_factor)
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.layers = nn.ModuleList(
            HybridLayer(kind, config, platform, methods, f"layers.{i}", rotary_dim)
            for i, kind in enumerate(config.mamba.layer_types)
        )
        self.norm = RMSNorm(hidden, config.rms_norm_eps, platform)
        self.lm_head = build_lm_head(config, methods)
        # NemotronH (rotary_dim 0) gets an empty table, which no layer reads.
        self.rotary = RotaryEmbedding(config, max_positions, rotary_dim)
        self.lora = LoRAAdapters(self.layers, {}, 0, max_lora_rank, platform)

    @property
    def max_loras(self) -> int:
        return self.lora.max_loras

    @property
    def num_attention_layers(self) -> int:
        """Layers with a KV cache: `forward` takes one (k, v) pair per such layer, in order."""
        return self.config.mamba.num_attention_layers

    @property
    def num_mamba_layers(self) -> int:
        """Layers with a state slot per sequence (`MambaStates.allocate`)."""
        return self.config.mamba.num_mamba_layers

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for every packed token. `caches.kv`:
        one pair per attention layer; `batch.recurrent`: each row's state slot in
        `caches.states`, which the Mamba layers read and update in place."""
        if batch.lora is not None or batch.media is not None:
            raise ValueError(f"a {self.config.family} model takes no LoRA and no media input")
        kv_caches, states, mamba, meta = caches.kv, caches.states, batch.recurrent, batch.attention
        if len(kv_caches) != self.num_attention_layers:
            raise ValueError(
                f"{len(kv_caches)} KV caches for {self.num_attention_layers} attention layers"
            )
        if self.num_mamba_layers and (mamba is None or states is None):
            raise ValueError(f"a {self.config.family} model needs its Mamba rows and states")
        if states is not None and len(states.ssm) != self.num_mamba_layers:
            raise ValueError(f"states of {len(states.ssm)} layers for {self.num_mamba_layers}")
        if mamba is not None and len(mamba.slots_host) != len(meta.query_lens_host):
            raise ValueError(
                f"Mamba slots for {len(mamba.slots_host)} rows, {len(meta.query_lens_host)} rows"
            )
        x = self.embed_tokens(batch.input_ids)
        angles = self.rotary.angles(batch.positions, x.dtype) if self.rotary.rotary_dim else None
        step = _Step(angles, meta, caches.backend, mamba)
        layer_caches = {"attention": iter(kv_caches)}
        if states is not None:
            layer_caches["mamba"] = zip(states.conv, states.ssm, strict=True)
        residual = None
        for layer in self.layers:
            source = layer_caches.get(layer.kind)  # MLP layers have none
            x, residual = layer(x, residual, None if source is None else next(source), step)
        return self.norm.add_forward(x, residual)[0]

    def allocate_states(
        self, num_slots: int, dtype: torch.dtype, device: torch.device
    ) -> MambaStates:
        """Zeroed conv and SSM states of every Mamba layer, `num_slots` slots each."""
        return MambaStates.allocate(self.config, num_slots, dtype, device)

    def media_encoders(self) -> dict[str, nn.Module]:
        return {}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def parameter_name(self, name: str) -> str | None:
        """Our parameter for a checkpoint tensor's name, before unfusing; None: skip it."""
        family = self.config.family
        if name.startswith("mtp.") or "rotary_emb." in name:
            return None  # NemotronH's multi-token prediction layers; RoPE's frequency buffers
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None  # tied: the embedding is the head
        for theirs, ours in _PREFIXES[family]:
            if name.startswith(theirs):
                name = ours + name.removeprefix(theirs)
                break
        if family == "bamba":
            for theirs, ours in _BAMBA_MODULES.items():
                name = name.replace(theirs, ours)
        return name.replace(".mixer.shared_experts.", ".mixer.shared_expert.")

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy transformers-named tensors in (fail if a parameter is missing or unknown), then
        turn every linear layer's weight into the form its method runs."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        ours = ((self.parameter_name(name), tensor) for name, tensor in weights)
        named = ((name, tensor) for name, tensor in ours if name is not None)
        named = load_expert_tensors(named, _EXPERTS, self._experts)
        load_fused(self, named, _FUSED, shard_sizes(self.config), (_EXPERTS,))
        process_weights_after_loading(self)
        for layer in self.layers:
            if layer.kind == "moe":
                layer.mixer.experts.finish_loading()

    def _experts(self, index: int) -> Experts | None:
        """Layer `index`'s experts, if it is a mixture of experts."""
        if index < len(self.layers) and self.layers[index].kind == "moe":
            return self.layers[index].mixer.experts
        return None


# Each flavour's Hugging Face `architectures` entry and llama.cpp's `general.architecture`
# (`granitehybrid` is what llama.cpp's converter makes of BambaForCausalLM, and of IBM's
# Granite 4.0-H, whose multipliers and experts are refused).
HF_ARCHITECTURES = {"BambaForCausalLM": "bamba", "NemotronHForCausalLM": "nemotron_h"}
GGUF_ARCHITECTURES = {
    "granitehybrid": "bamba",
    "nemotron_h": "nemotron_h",
    "nemotron_h_moe": "nemotron_h",  # llama.cpp's name where the layers hold experts
}
# transformers' default scan block length of each family, for a config.json that gives none and
# for GGUF files, which never record it. The scan's block length changes results by rounding only.
MAMBA_CHUNK_SIZES = {"bamba": 256, "nemotron_h": 128}


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
    rope = rope_from_hf(cfg)
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
        # The clamp of softplus(dt + dt_bias): `time_step_limit` (NVIDIA's name) or
        # `mamba_dt_limit`, none where absent; `time_step_min` only seeds dt_bias at training
        # (transformers before 5.25 clamped at it).
        time_step_limit=tuple(
            _hf_float(v)
            for v in _first(cfg, ("time_step_limit", "mamba_dt_limit"), (0.0, float("inf")))
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
        moe=_nemotron_h_moe(cfg, layer_types),
    )
    return config, mamba


def _nemotron_h_moe(cfg: dict[str, Any], layer_types: tuple[str, ...]) -> MoEConfig | None:
    """The mixture of experts of a NemotronH config.json's "moe" layers (None: it has none):
    sigmoid scores, chosen with the selection bias `e_score_correction_bias` within the best
    groups, relu² experts, and one relu² shared expert (transformers builds one whatever
    n_shared_experts says)."""
    sparse = tuple(i for i, kind in enumerate(layer_types) if kind == "moe")
    if not sparse:
        return None
    return MoEConfig(
        num_experts=cfg.get("n_routed_experts", 8),
        top_k=cfg.get("num_experts_per_tok", 2),
        intermediate_size=cfg.get("moe_intermediate_size", 7688),
        sparse_layers=sparse,
        scoring="sigmoid",
        renormalize=bool(cfg.get("norm_topk_prob", True)),
        selection_bias=True,
        num_groups=cfg.get("n_group", 1),
        topk_groups=cfg.get("topk_group", 1),
        scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        activation="relu2",
        shared_intermediate_size=cfg.get("moe_shared_expert_intermediate_size", 7688),
        latent_size=cfg.get("moe_latent_size") or 0,
        latent_bias=bool(cfg.get("mlp_bias", False)),
    )


def hybrid_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """The ModelConfig, its `mamba` filled in, of a `BambaForCausalLM` or
    `NemotronHForCausalLM` config.json dict (transformers' defaults for what it leaves out)."""
    archs = cfg.get("architectures") or []
    family = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
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


# A layer's tensors in a GGUF file (after "blk.N.") -> HybridForCausalLM's parameters (after
# "layers.N."). The Mamba2 mixer's A, D and dt bias are stored without a ".weight"/".bias" of
# their own.
_LAYER_TENSORS = {
    "attn_norm.weight": "norm.weight",
    "ssm_a": "mixer.A_log",
    "ssm_d": "mixer.D",
    "ssm_dt.bias": "mixer.dt_bias",
    "exp_probs_b.bias": "mixer.gate.e_score_correction_bias",
    **{
        f"{gguf}.{suffix}": f"mixer.{ours}.{suffix}"
        for gguf, ours in (
            ("ssm_in", "in_proj"),
            ("ssm_conv1d", "conv1d"),
            ("ssm_norm", "norm"),
            ("ssm_out", "out_proj"),
            ("attn_q", "q_proj"),
            ("attn_k", "k_proj"),
            ("attn_v", "v_proj"),
            ("attn_output", "o_proj"),
        )
        for suffix in ("weight", "bias")
    },
}
# The MLPs: Bamba's follows every layer's mixer (SwiGLU, its own norm); NemotronH's (relu², no
# gate) is a layer's mixer.
_MLP_TENSORS = {
    "bamba": {
        "ffn_norm": "mlp_norm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    },
    "nemotron_h": {
        "ffn_up": "mixer.up_proj",
        "ffn_down": "mixer.down_proj",
        # A mixture of experts: the router, the stacked experts, the shared expert and the
        # latent projections around the experts.
        "ffn_gate_inp": "mixer.gate",
        "ffn_up_exps": "mixer.experts.up_proj",
        "ffn_down_exps": "mixer.experts.down_proj",
        "ffn_up_shexp": "mixer.shared_experts.up_proj",
        "ffn_down_shexp": "mixer.shared_experts.down_proj",
        "ffn_latent_down": "mixer.fc1_latent_proj",
        "ffn_latent_up": "mixer.fc2_latent_proj",
    },
}
# Granite's multipliers, as llama.cpp's converter writes transformers' embedding_multiplier,
# residual_multiplier and logits_scaling (llama.cpp skips a product whose key is absent or 0).
# Bamba has none, nor does our hybrid model.
_GRANITE_SCALES = ("embedding_scale", "residual_scale", "logit_scale")
# The kinds of tensor `_undo_mamba2_layout` reshapes.
_RESHAPED = ("ssm_a", "ssm_d", "ssm_norm", "ssm_conv1d")


def hybrid_from_gguf(gguf: GGUFMetadata, flavour: str) -> ModelConfig:
    """A NemotronH or Bamba config from llama.cpp's metadata. A layer's kind is what llama.cpp
    makes of it: recurrent where it has no KV heads (and, NemotronH, no FFN); NemotronH's
    layers with a router are mixtures of experts, those with an FFN MLPs."""
    a = gguf.architecture
    if flavour == "bamba":
        _refuse_experts(gguf)
    layers = gguf.required(f"{a}.block_count")
    hidden = gguf.required(f"{a}.embedding_length")
    kv_key, ffn_key = f"{a}.attention.head_count_kv", f"{a}.feed_forward_length"
    kv, ffn = _per_layer(gguf, kv_key, layers), _per_layer(gguf, ffn_key, layers)
    if flavour == "nemotron_h":
        routed = [f"blk.{i}.ffn_gate_inp.weight" in gguf.tensor_names for i in range(layers)]
        kinds = [
            "moe" if r else "mlp" if f else "attention" if k else "mamba"
            for k, f, r in zip(kv, ffn, routed, strict=True)
        ]
    else:
        kinds = ["attention" if k else "mamba" for k in kv]
    # The MLPs' width: what the converter writes on a mixture's layers is not an MLP's.
    ffn = [f if kind != "moe" else 0 for f, kind in zip(ffn, kinds, strict=True)]
    heads_key = f"{a}.attention.head_count"
    heads = _one_size(heads_key, _per_layer(gguf, heads_key, layers))
    kv_heads = _one_size(kv_key, kv) or heads
    head_dim = gguf.field(f"{a}.attention.key_length") or hidden // heads
    _refuse_granite_scales(gguf, head_dim)
    n_heads = gguf.required(f"{a}.ssm.time_step_rank")  # the converter writes the head count
    inner = gguf.required(f"{a}.ssm.inner_size")
    if inner % n_heads:
        raise ValueError(f"GGUF {a}.ssm.inner_size {inner} is no multiple of its {n_heads} heads")
    # One epsilon for every norm, the mixer's too. llama.cpp reads the RMS key, which the
    # converter writes from rms_norm_eps; NemotronH's configs may name it layer_norm_epsilon
    # only, which the converter writes as the plain key.
    eps = float(
        gguf.field(
            f"{a}.attention.layer_norm_rms_epsilon",
            gguf.field(f"{a}.attention.layer_norm_epsilon", 1e-5),
        )
    )
    partial_rotary_factor = 0.0  # NemotronH's attention has no RoPE
    # Granite runs RoPE where rope.scaling.finetuned says so (llama.cpp's default: it does),
    # on the leading rope.dimension_count values of a head: the converter writes Bamba's
    # attn_rotary_emb there, half a head.
    if flavour == "bamba" and gguf.field(f"{a}.rope.scaling.finetuned", True):
        partial_rotary_factor = gguf.field(f"{a}.rope.dimension_count", head_dim) / head_dim
    mamba = MambaConfig(
        layer_types=tuple(kinds),
        n_heads=n_heads,
        head_dim=inner // n_heads,
        n_groups=gguf.required(f"{a}.ssm.group_count"),
        d_state=gguf.required(f"{a}.ssm.state_size"),
        d_conv=gguf.required(f"{a}.ssm.conv_kernel"),
        # GGUF keeps no scan block length: transformers' default of the family.
        chunk_size=MAMBA_CHUNK_SIZES[flavour],
        conv_bias=_has_bias(gguf, "ssm_conv1d"),
        proj_bias=_has_bias(gguf, "ssm_in"),
        norm_eps=eps,
        # ggml's ssm_scan takes softplus(dt + dt_bias) as it is, as transformers does where a
        # config gives no limit; the converter writes none.
        time_step_limit=(0.0, float("inf")),
        partial_rotary_factor=partial_rotary_factor,
    )
    config = ModelConfig(
        family=flavour,
        vocab_size=gguf_vocab_size(gguf),
        hidden_size=hidden,
        intermediate_size=_one_size(ffn_key, ffn),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=eps,
        max_position_embeddings=gguf.field(f"{a}.context_length", 4096),
        rope=gguf_rope(gguf),
        tie_word_embeddings="output.weight" not in gguf.tensor_names,
        qkv_bias=_has_bias(gguf, "attn_q"),
        o_bias=_has_bias(gguf, "attn_output"),
        # NemotronH's mlp_bias: its MLPs', its shared experts' and latent projections' biases.
        mlp_bias=_has_bias(gguf, "ffn_up") or _has_bias(gguf, "ffn_up_shexp"),
        moe=_nemotron_h_moe_from_gguf(gguf, tuple(kinds)),
    )
    return hybrid_config(config, mamba)


def _nemotron_h_moe_from_gguf(gguf: GGUFMetadata, kinds: tuple[str, ...]) -> MoEConfig | None:
    """The mixture of experts of a `nemotron_h_moe` file's "moe" layers (None: it has none), as
    `_nemotron_h_moe` reads a config.json: llama.cpp's keys for what transformers' names."""
    sparse = tuple(i for i, kind in enumerate(kinds) if kind == "moe")
    if not sparse:
        return None
    a = gguf.architecture
    return MoEConfig(
        num_experts=gguf.required(f"{a}.expert_count"),
        top_k=gguf.required(f"{a}.expert_used_count"),
        intermediate_size=gguf.required(f"{a}.expert_feed_forward_length"),
        sparse_layers=sparse,
        scoring="sigmoid",
        renormalize=bool(gguf.field(f"{a}.expert_weights_norm", True)),
        selection_bias=True,
        num_groups=gguf.field(f"{a}.expert_group_count", 1) or 1,
        topk_groups=gguf.field(f"{a}.expert_group_used_count", 1) or 1,
        scaling_factor=float(gguf.field(f"{a}.expert_weights_scale", 1.0)),
        activation="relu2",
        shared_intermediate_size=gguf.required(f"{a}.expert_shared_feed_forward_length"),
        latent_size=gguf.field(f"{a}.moe_latent_size", 0) or 0,
        latent_bias=_has_bias(gguf, "ffn_latent_down"),
    )


def _per_layer(gguf: GGUFMetadata, key: str, layers: int) -> list[int]:
    """A per-layer metadata value: llama.cpp writes an array where layers differ."""
    value = gguf.required(key)
    values = list(value) if isinstance(value, list) else [value] * layers
    if len(values) != layers:
        raise ValueError(f"GGUF {key} lists {len(values)} layers, block_count {layers}")
    return values


def _one_size(key: str, values: list[int]) -> int:
    """The one nonzero value of a per-layer array (0: none); layers of one kind that differ
    in size are not supported."""
    sizes = set(values) - {0}
    if len(sizes) > 1:
        raise ValueError(f"GGUF {key} differs across layers {sorted(sizes)}: not supported")
    return sizes.pop() if sizes else 0


def _has_bias(gguf: GGUFMetadata, kind: str) -> bool:
    """Whether any layer's `kind` tensor has a bias (layer 0 may lack `kind`)."""
    return any(name.endswith(f".{kind}.bias") for name in gguf.tensor_names)


def _refuse_experts(gguf: GGUFMetadata) -> None:
    a = gguf.architecture
    experts = sorted(n for n in gguf.tensor_names if _is_expert_tensor(n))
    count = gguf.field(f"{a}.expert_count", 0)
    if count or experts:
        found = f"e.g. tensor {experts[0]!r}" if experts else f"{a}.expert_count {count}"
        raise ValueError(
            f"GGUF file {gguf.path} has mixture-of-experts layers ({found}): not supported"
        )


def _is_expert_tensor(name: str) -> bool:
    """A mixture-of-experts tensor: the router, stacked or shared experts, expert biases."""
    kind = gguf_layer_kind(name)
    return kind in ("ffn_gate_inp", "exp_probs_b") or kind.endswith(("_exps", "_shexp"))


def _refuse_granite_scales(gguf: GGUFMetadata, head_dim: int) -> None:
    a = gguf.architecture
    for name in _GRANITE_SCALES:
        value = gguf.field(f"{a}.{name}")
        if value not in (None, 0.0, 1.0):
            raise ValueError(
                f"GGUF {a}.{name} is {value}: Granite's multipliers are not supported "
                "(neither Bamba nor NemotronH has one)"
            )
    # llama.cpp's attention scale replaces 1/sqrt(head_dim) where set and nonzero.
    scale = gguf.field(f"{a}.attention.scale")
    if scale and not math.isclose(scale, head_dim**-0.5, rel_tol=1e-6):
        raise ValueError(
            f"GGUF {a}.attention.scale is {scale}, not 1/sqrt(head_dim): Granite's "
            "attention_multiplier is not supported (neither Bamba nor NemotronH has one)"
        )


class HybridGGUFTensors:
    """A hybrid's tensors in llama.cpp's files, named as HybridForCausalLM loads them (before
    fusing): transformers' names below NemotronH's layers, `parameter_name`'s renaming of
    Bamba's modules (LinearMethods looks a layer's stored type up by them too). The converter
    hands the attention layers to its llama conversion (q/k rows interleaved) and lays the
    Mamba2 mixers out as its Mamba2Model does."""

    def __init__(self, flavour: str) -> None:
        self.mlp = _MLP_TENSORS[flavour]

    def hf_name(self, name: str) -> str | None:
        base, _, suffix = name.rpartition(".")
        if base in GLOBAL_TENSORS:
            return f"{GLOBAL_TENSORS[base]}.{suffix}"
        parts = name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
            layer, rest = parts[1:]
            if rest in _LAYER_TENSORS:
                return f"layers.{layer}.{_LAYER_TENSORS[rest]}"
            kind, _, suffix = rest.partition(".")
            if kind in self.mlp and suffix in ("weight", "bias"):
                return f"layers.{layer}.{self.mlp[kind]}.{suffix}"
        raise KeyError(name)

    def rows(self, name: str, rows: np.ndarray, config: ModelConfig) -> np.ndarray:
        return unpermute_qk(name, rows, config)

    def keeps_shape(self, name: str) -> bool:
        return gguf_layer_kind(name) not in _RESHAPED

    def reshape(self, name: str, values: np.ndarray) -> np.ndarray:
        return _undo_mamba2_layout(gguf_layer_kind(name), values)


def _undo_mamba2_layout(kind: str, values: np.ndarray) -> np.ndarray:
    """A Mamba2 mixer tensor as transformers holds it, from llama.cpp's converter's layout
    (its Mamba2Model): A as -exp(A_log) and D in columns [heads, 1], the conv weight's channel
    axis of 1 squeezed out, the gated norm's weight in rows of one group."""
    if kind == "ssm_a":
        # In float64, then rounded: the float32 nearest to log(-A).
        return np.log(-values.astype(np.float64)).astype(np.float32).reshape(-1)
    if kind in ("ssm_d", "ssm_norm"):
        return values.reshape(-1)
    if kind == "ssm_conv1d" and values.ndim == 2:  # the weight, not its bias
        return np.expand_dims(values, 1)
    return values


def _flavour(name: str) -> Family:
    """One flavour of the family, with its Hugging Face and GGUF architectures."""
    return Family(
        name,
        HybridForCausalLM,
        hf_architectures=tuple(a for a, f in HF_ARCHITECTURES.items() if f == name),
        from_hf=hybrid_from_hf,
        gguf_architectures=tuple(a for a, f in GGUF_ARCHITECTURES.items() if f == name),
        from_gguf=functools.partial(hybrid_from_gguf, flavour=name),
        gguf_tensors=HybridGGUFTensors(name),
    )


register(_flavour("bamba"))
register(_flavour("nemotron_h"))

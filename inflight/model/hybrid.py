"""Hybrid Mamba2/attention decoders: Bamba and NemotronH.

Each layer is of one kind (`MambaConfig.layer_types`): a Mamba2 mixer (layers/mamba.py), which reads
and writes each sequence's state slot; attention over the paged KV cache (llama.py's, with RoPE
on the leading part of each head only (Bamba) or none at all (NemotronH)); or NemotronH's relu²
MLP. A layer is norm -> mixer, added to the residual stream; Bamba's layers then add norm ->
SwiGLU MLP. Only attention layers have a KV cache.

Parameters are named `layers.{i}.norm`, `layers.{i}.mixer.*` (and Bamba's `layers.{i}.mlp_norm`,
`layers.{i}.mlp.*`), `embed_tokens`, `norm`, `lm_head`, below the layer as transformers names
them, but that q/k/v and gate/up are stored fused (`qkv_proj`, `gate_up_proj`) as in llama.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from inflight.model.attention import AttentionBackend
from inflight.model.config import ModelConfig
from inflight.model.contract import ForwardBatch, ModelCaches
from inflight.model.layers.linear import process_weights_after_loading
from inflight.model.layers.lora_adapters import LoRAAdapters
from inflight.model.layers.mamba import Mamba2Mixer, MambaRows, MambaStates
from inflight.model.layers.norm import RMSNorm
from inflight.model.layers.platform import Platform
from inflight.model.layers.quantization import LinearMethods
from inflight.model.layers.rotary import Angles, RotaryEmbedding
from inflight.model.llama import MLP, Attention, build_lm_head, decoder_linear, shard_sizes
from inflight.model.metadata import AttentionMetadata, KVCache
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
    """NemotronH's MLP: down_proj(relu(up_proj(x))²), no gate."""

    def __init__(self, config: ModelConfig, methods: LinearMethods, prefix: str) -> None:
        super().__init__()
        hidden, intermediate, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.up_proj = decoder_linear(hidden, intermediate, bias, methods, f"{prefix}.up_proj")
        self.down_proj = decoder_linear(intermediate, hidden, bias, methods, f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())


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
        else:
            h = self.mixer(h)
        if self.mlp is not None:
            h, residual = self.mlp_norm.add_forward(h, residual)
            h = self.mlp(h, None)
        return h, residual


class HybridForCausalLM(nn.Module):
    """A Bamba or NemotronH model (config.mamba set), with LlamaForCausalLM's surface where the
    runtime uses it; no LoRA (no adapter slots) and no media input."""

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        platform: Platform,
        methods: LinearMethods,
        max_loras: int = 0,
        max_lora_rank: int = 16,
    ) -> None:
        super().__init__()
        if config.mamba is None:
            raise ValueError(f"a {config.family} config describes no hybrid Mamba model")
        if max_loras:
            raise ValueError(f"LoRA is not supported on {config.family} models (max_loras=0)")
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

    def _our_name(self, name: str) -> str | None:
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
        return name

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy transformers-named tensors in (fail if a parameter is missing or unknown), then
        turn every linear layer's weight into the form its method runs."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        ours = ((self._our_name(name), tensor) for name, tensor in weights)
        named = ((name, tensor) for name, tensor in ours if name is not None)
        load_fused(self, named, _FUSED, shard_sizes(self.config))
        process_weights_after_loading(self)

"""One Llama-family decoder: Llama 2/3, Mistral, Qwen2/2.5, Qwen3 and SmolLM2.

The forward pass runs over a packed ragged batch (see `attention/base.py`): tokens [T],
positions [T] and one KV cache pair per layer. Parameters keep Hugging Face names, except that
q/k/v and gate/up are stored fused (`qkv_proj`, `gate_up_proj`) so that each is one matmul per
layer.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from inflight.model.attention import AttentionBackend, AttentionMetadata, KVCache
from inflight.model.config import ModelConfig
from inflight.model.layers.activation import SiluAndMul
from inflight.model.layers.linear import Linear, process_weights_after_loading
from inflight.model.layers.norm import RMSNorm
from inflight.model.layers.platform import Platform
from inflight.model.layers.quantization import LinearMethods
from inflight.model.layers.rotary import Angles, Rope, RotaryEmbedding

# Fused parameter -> the Hugging Face parameters it stacks, in order.
_FUSED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
# Hugging Face parameter name part -> (fused parameter, index of the shard inside it).
_FUSED = {part: (fused, i) for fused, parts in _FUSED_PARTS.items() for i, part in enumerate(parts)}


def _linear(
    in_features: int, out_features: int, bias: bool, methods: LinearMethods, name: str
) -> Linear:
    """The linear layer `name` ("layers.0.mlp.down_proj"), with the method its checkpoint
    tensors call for (a fused layer's are its parts)."""
    prefix, _, leaf = name.rpartition(".")
    sources = [f"{prefix}.{part}.weight" for part in _FUSED_PARTS.get(leaf, (leaf,))]
    return Linear(in_features, out_features, bias, methods.choose(in_features, sources))


class Attention(nn.Module):
    def __init__(
        self, config: ModelConfig, platform: Platform, methods: LinearMethods, prefix: str
    ) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = _linear(
            config.hidden_size,
            self.q_size + 2 * self.kv_size,
            config.qkv_bias,
            methods,
            f"{prefix}.qkv_proj",
        )
        self.o_proj = _linear(
            self.q_size, config.hidden_size, config.o_bias, methods, f"{prefix}.o_proj"
        )
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, platform)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, platform)
        else:
            self.q_norm = self.k_norm = None
        self.rope = Rope(platform)

    def forward(
        self,
        x: torch.Tensor,
        angles: Angles,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        tokens, heads = x.shape[0], self.num_heads
        qkv = self.qkv_proj(x)
        qk_size = self.q_size + self.kv_size
        v = qkv[:, qk_size:].view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            # q's and k's heads side by side in the fused projection: one rotation.
            qk = qkv[:, :qk_size].view(tokens, heads + self.num_kv_heads, self.head_dim)
            qk = self.rope(qk, angles)
            q, k = qk[:, :heads], qk[:, heads:]
        else:
            q = qkv[:, : self.q_size].view(tokens, heads, self.head_dim)
            k = qkv[:, self.q_size : qk_size].view(tokens, self.num_kv_heads, self.head_dim)
            q, k = self.rope(self.q_norm(q), angles), self.rope(self.k_norm(k), angles)
        out = backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(tokens, self.q_size))


class MLP(nn.Module):
    def __init__(
        self, config: ModelConfig, platform: Platform, methods: LinearMethods, prefix: str
    ) -> None:
        super().__init__()
        hidden, intermediate = config.hidden_size, config.intermediate_size
        self.gate_up_proj = _linear(
            hidden, 2 * intermediate, config.mlp_bias, methods, f"{prefix}.gate_up_proj"
        )
        self.act = SiluAndMul(platform)
        self.down_proj = _linear(
            intermediate, hidden, config.mlp_bias, methods, f"{prefix}.down_proj"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, platform: Platform, methods: LinearMethods, prefix: str
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, platform)
        self.self_attn = Attention(config, platform, methods, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(hidden, eps, platform)
        self.mlp = MLP(config, platform, methods, f"{prefix}.mlp")

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        angles: Angles,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's output before its residual add, and the residual stream: each residual
        add is fused into the norm that follows it."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, angles, kv_cache, meta, backend)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """Built for one platform, each linear layer with the method `methods` chooses for it (see
    `checkpoints.loader.build_model`)."""

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        platform: Platform,
        methods: LinearMethods,
    ) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.layers = nn.ModuleList(
            DecoderLayer(config, platform, methods, f"layers.{i}") for i in range(config.num_layers)
        )
        self.norm = RMSNorm(hidden, config.rms_norm_eps, platform)
        # A tied head computes with the embedding's weight (see load_weights).
        head_source = "embed_tokens" if config.tie_word_embeddings else "lm_head"
        self.lm_head = Linear(
            hidden,
            config.vocab_size,
            False,
            methods.choose(hidden, [f"{head_source}.weight"], head=True),
        )
        self.rotary = RotaryEmbedding(config, max_positions)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for every packed token."""
        x = self.embed_tokens(input_ids)
        angles = self.rotary.angles(positions, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, angles, kv_cache, meta, backend)
        return self.norm.add_forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in (fail if a parameter is missing or unknown), then
        turn every linear layer's weight into the form its method runs."""
        if self.config.tie_word_embeddings:
            # Shared, the head's weight is loaded with the embedding's; a method that runs
            # another form makes its copy after loading and leaves the embedding as it is.
            self.lm_head.weight = self.embed_tokens.weight
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        shard_sizes = {
            "qkv_proj": [self.layers[0].self_attn.q_size, *[self.layers[0].self_attn.kv_size] * 2],
            "gate_up_proj": [self.config.intermediate_size] * 2,
        }
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding is the head
            if "rotary_emb" in name:
                continue
            target, shard = name, None
            for part, (fused, index) in _FUSED.items():
                if f".{part}." in name:
                    target, shard = name.replace(f".{part}.", f".{fused}."), index
                    break
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in this model")
            param = params[target]
            if shard is None:
                dest, label = param, target
            else:
                sizes = shard_sizes[target.split(".")[-2]]
                offset = sum(sizes[:shard])
                dest, label = param.narrow(0, offset, sizes[shard]), f"{target}[{shard}]"
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            loaded.add(label)
        expected = set()
        for pname, _ in self.named_parameters():
            parts = _FUSED_PARTS.get(pname.split(".")[-2], ())
            expected.update([f"{pname}[{i}]" for i in range(len(parts))] if parts else [pname])
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
        process_weights_after_loading(self)

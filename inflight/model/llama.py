"""One Llama-family decoder: Llama 2/3, Mistral, Qwen2/2.5, Qwen3 and SmolLM2.

The forward pass runs over a packed ragged batch (see `attention.py`): tokens [T], positions [T]
and one KV cache pair per layer. Parameters keep Hugging Face names, except that q/k/v and
gate/up are stored fused (`qkv_proj`, `gate_up_proj`) so that each is one matmul per layer.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from inflight.model.attention import AttentionBackend, AttentionMetadata, KVCache
from inflight.model.config import ModelConfig
from inflight.model.kernels.cpu import ops as cpu_ops
from inflight.model.kernels.cpu.int8 import BLOCK, QuantizedWeight, int8_linear, quantize_weight
from inflight.model.kernels.cpu.int8 import load_kernel as load_int8_kernel
from inflight.model.kernels.cpu.q4 import Q4Weight, q4_linear, quantize_q4
from inflight.model.kernels.cpu.q4 import load_kernel as load_q4_kernel
from inflight.model.layers.rotary import Angles, RotaryEmbedding, rotate


class Linear(nn.Linear):
    """nn.Linear whose float32 CPU weight can be prepacked into oneDNN's blocked layout, which
    runs the small-batch matmuls of decoding about twice as fast as the plain layout, or
    quantized for the AVX2 kernels of `int8_linear` and `q4_linear`, faster again."""

    packed: torch.Tensor | None = None
    quantized: QuantizedWeight | Q4Weight | None = None

    def pack(self) -> None:
        """Replace the weight by its packed form (after loading; CPU float32 only)."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        del self.weight
        self.register_parameter("weight", None)

    def quantize(self, kind: str) -> None:
        """Replace the weight by its "int8" or "q4" form (after loading; CPU float32 only,
        in_features a multiple of 32)."""
        weight = self.weight.detach()
        self.quantized = quantize_weight(weight) if kind == "int8" else quantize_q4(weight)
        del self.weight
        self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.quantized, Q4Weight):
            return q4_linear(x, self.quantized, self.bias)
        if self.quantized is not None:
            return int8_linear(x, self.quantized, self.bias)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


@functools.cache
def _triton_ops() -> ModuleType:
    """The fused CUDA kernels, imported on first use: CPU machines need not have Triton."""
    from inflight.model.kernels.triton import ops as triton_ops

    return triton_ops


def _cpu_ops(x: torch.Tensor) -> ctypes.CDLL | None:
    """The fused CPU ops for a float32 CPU tensor with unit inner stride, where they built."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.stride(-1) != 1:
        return None
    return cpu_ops.library()


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return _triton_ops().rms_norm(x, self.weight, self.eps)[0]
        if x.dim() == 2 and (lib := _cpu_ops(x)) is not None:
            return cpu_ops.rms_norm(lib, x, self.weight, self.eps)[0]
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The norm of `x + residual`, and that sum (the next residual) — one kernel on CUDA."""
        if x.is_cuda:
            return _triton_ops().rms_norm(x, self.weight, self.eps, residual)
        if x.dim() == 2 and residual.stride(-1) == 1 and (lib := _cpu_ops(x)) is not None:
            return cpu_ops.rms_norm(lib, x, self.weight, self.eps, residual)
        summed = x + residual
        return self.forward(summed), summed


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

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
        if self.q_norm is None and (lib := _cpu_ops(qkv)) is not None:
            # q's and k's heads side by side in the fused projection: one rotation call.
            qk = qkv[:, :qk_size].view(tokens, heads + self.num_kv_heads, self.head_dim)
            qk = cpu_ops.rope(lib, qk, *angles)
            q, k = qk[:, :heads], qk[:, heads:]
        else:
            q = qkv[:, : self.q_size].view(tokens, heads, self.head_dim)
            k = qkv[:, self.q_size : qk_size].view(tokens, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            if (lib := _cpu_ops(q)) is not None:
                q, k = cpu_ops.rope(lib, q, *angles), cpu_ops.rope(lib, k, *angles)
            else:
                q, k = rotate(q, k, angles)
        out = backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if gate_up.is_cuda:
            return self.down_proj(_triton_ops().silu_mul(gate_up))
        if (lib := _cpu_ops(gate_up)) is not None:
            return self.down_proj(cpu_ops.silu_mul(lib, gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        angles: Angles,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output before its residual add, and the residual stream: each residual
        add is fused into the norm that follows it."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, angles, kv_cache, meta, backend)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


# Hugging Face parameter name suffix -> (fused parameter, index of the shard inside it).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.rotary = RotaryEmbedding(config, max_positions)
        self.packed_head: torch.Tensor | None = None
        self.quantized_head: QuantizedWeight | None = None

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
        if self.lm_head is not None:
            return self.lm_head(hidden)
        if self.quantized_head is not None:
            return int8_linear(hidden, self.quantized_head)
        if self.packed_head is not None:
            return torch.ops.mkldnn._linear_pointwise(
                hidden, self.packed_head, None, "none", [], ""
            )
        return F.linear(hidden, self.embed_tokens.weight)

    def pack_for_cpu(self, quantization: str | None = None) -> None:
        """Prepack every matmul weight for oneDNN (CPU, float32), after the weights are loaded.

        quantization="int8" quantizes instead every matmul whose in_features is a multiple of
        32, the head included, for the int8 kernel (weights and activations in blocks of 32;
        see int8_linear.py); the others stay packed float32. quantization="q4" does the same
        with 4-bit weights for the decoder layers (GGUF's Q4_1, so a Q4_1 checkpoint keeps its
        own weights; see q4_linear.py) and int8 for the head, whose errors reach the logits
        undamped."""
        if quantization not in (None, "int8", "q4"):
            raise ValueError(
                f"unknown CPU quantization {quantization!r}; expected None, 'int8' or 'q4'"
            )
        if quantization is not None:
            # A missing compiler or CPU feature shows here, not mid-generation.
            load_int8_kernel()
            if quantization == "q4":
                load_q4_kernel()
        for module in self.modules():
            if isinstance(module, Linear):
                if quantization is not None and module.in_features % BLOCK == 0:
                    module.quantize("int8" if module is self.lm_head else quantization)
                else:
                    module.pack()
        if self.lm_head is None:
            # Tied head: the embedding keeps its plain weight for lookups; the head gets a copy.
            head = self.embed_tokens.weight.detach()
            if quantization is not None and head.shape[1] % BLOCK == 0:
                self.quantized_head = quantize_weight(head)
            else:
                self.packed_head = torch.ops.mkldnn._reorder_linear_weight(head, None)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in; fail if a parameter is missing or unknown."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        shard_sizes = {
            "qkv_proj": [self.layers[0].self_attn.q_size, *[self.layers[0].self_attn.kv_size] * 2],
            "gate_up_proj": [self.config.intermediate_size] * 2,
        }
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.lm_head is None:
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
            if pname.endswith("qkv_proj.weight") or pname.endswith("qkv_proj.bias"):
                expected.update(f"{pname}[{i}]" for i in range(3))
            elif pname.endswith("gate_up_proj.weight") or pname.endswith("gate_up_proj.bias"):
                expected.update(f"{pname}[{i}]" for i in range(2))
            else:
                expected.add(pname)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

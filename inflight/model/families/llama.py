"""The Llama family: one decoder for Llama 2/3, Mistral, Qwen2/2.5, Qwen3 and SmolLM2, its
flavours' config parsing (Hugging Face and GGUF) and llama.cpp's names for its tensors. Registers
the flavours llama, mistral, qwen2 and qwen3 (a config's `family`).

The forward pass runs over a packed ragged batch (see `metadata.py`): tokens [T],
positions [T] and one KV cache pair per layer. Parameters keep Hugging Face names, except that
q/k/v and gate/up are stored fused (`qkv_proj`, `gate_up_proj`) so that each is one matmul per
layer.

Built with `max_loras` > 0, every decoder linear also holds that many LoRA adapter slots
(`LoRAAdapters`, the model's `lora`), and a forward pass may run each packed token with the
adapter of its slot (`LoRAMapping`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from inflight.model.attention import AttentionBackend
from inflight.model.attention.cpu import CpuAttentionBackend
from inflight.model.config import ModelConfig, MoEConfig, RopeConfig, rope_from_hf
from inflight.model.contract import ForwardBatch, ModelCaches
from inflight.model.kernels.cpu import decoder
from inflight.model.layers.activation import SiluAndMul
from inflight.model.layers.linear import Fp8Rows, Linear, process_weights_after_loading
from inflight.model.layers.lora import LoRAMapping
from inflight.model.layers.lora_adapters import LoRAAdapters
from inflight.model.layers.mamba import MambaStates
from inflight.model.layers.moe import Experts, SparseMoeBlock, load_expert_tensors
from inflight.model.layers.norm import RMSNorm
from inflight.model.layers.parallel import TensorParallel, VocabParallelEmbedding
from inflight.model.layers.platform import Platform
from inflight.model.layers.quantization import LinearMethods
from inflight.model.layers.rotary import Angles, Rope, RotaryEmbedding
from inflight.model.metadata import AttentionMetadata, KVCache
from inflight.model.registry import Family, GGUFMetadata, register
from inflight.model.weights import load_fused

# Fused parameter -> the Hugging Face parameters it stacks, in order.
_FUSED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
# Hugging Face parameter name part -> (fused parameter, index of the shard inside it).
_FUSED = {
    f".{part}.": (f".{fused}.", i)
    for fused, parts in _FUSED_PARTS.items()
    for i, part in enumerate(parts)
}
# Multimodal checkpoints nest the decoder (transformers 5: `model.language_model.`, 4:
# `language_model.model.`) and the encoder side (5: under `model.`).
_MULTIMODAL_NAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.visual.", "visual."),
    ("model.audio_tower.", "audio_tower."),
)
# Mixtral's checkpoints call a layer's mixture of experts `block_sparse_moe`.
_EXPERT_BLOCK_NAMES = (".block_sparse_moe.", ".mlp.")
# Where a layer's experts are.
_EXPERTS = ".mlp.experts."
# The media encoder's tensors (LLaVA's and Voxtral's, Qwen2-VL's).
_ENCODER_NAMES = ("vision_tower.", "multi_modal_projector.", "visual.", "audio_tower.")


def shard_sizes(config: ModelConfig) -> dict[str, list[int]]:
    """The output size of each part of a fused decoder parameter."""
    kv_size = config.num_kv_heads * config.head_dim
    sizes = {
        "qkv_proj": [config.num_heads * config.head_dim, kv_size, kv_size],
        "gate_up_proj": [config.intermediate_size] * 2,
    }
    if config.moe is not None and config.moe.shared_intermediate_size:
        sizes["shared_expert.gate_up_proj"] = [config.moe.shared_intermediate_size] * 2
    return sizes


def build_lm_head(config: ModelConfig, methods: LinearMethods, rows: int | None = None) -> Linear:
    """The LM head (of `rows` vocabulary rows: a tensor-parallel rank's; default all), with the
    method its weight calls for; a tied one holds no weight of its own (load_weights gives it
    the embedding's: one of its own would be allocated for nothing)."""
    hidden = config.hidden_size
    source = "embed_tokens" if config.tie_word_embeddings else "lm_head"
    sources = (f"{source}.weight",)
    head = Linear(
        hidden,
        rows or config.vocab_size,
        False,
        methods.choose(hidden, sources, head=True),
        sources,
    )
    if config.tie_word_embeddings:
        head.weight = None
    return head


def decoder_linear(
    in_features: int, out_features: int, bias: bool, methods: LinearMethods, name: str
) -> Linear:
    """The linear layer `name` ("layers.0.mlp.down_proj"), with the method its checkpoint
    tensors call for (a fused layer's are its parts)."""
    prefix, _, leaf = name.rpartition(".")
    sources = tuple(f"{prefix}.{part}.weight" for part in _FUSED_PARTS.get(leaf, (leaf,)))
    return Linear(in_features, out_features, bias, methods.choose(in_features, sources), sources)


class Attention(nn.Module):
    """`config`: this rank's shape (its share of the heads under tensor parallelism, whose
    o_proj outputs `parallel` sums over the ranks); `window`: the layer's attention window
    (None: full attention), which the backend applies, as it does the `sinks` (a logit per
    head, where the config has them: gpt-oss)."""

    def __init__(
        self,
        config: ModelConfig,
        platform: Platform,
        methods: LinearMethods,
        prefix: str,
        parallel: TensorParallel | None = None,
        window: int | None = None,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.window = window
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = decoder_linear(
            config.hidden_size,
            self.q_size + 2 * self.kv_size,
            config.qkv_bias,
            methods,
            f"{prefix}.qkv_proj",
        )
        self.o_proj = decoder_linear(
            self.q_size, config.hidden_size, config.o_bias, methods, f"{prefix}.o_proj"
        )
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, platform)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, platform)
        else:
            self.q_norm = self.k_norm = None
        self.sinks = nn.Parameter(torch.empty(config.num_heads)) if config.attention_sinks else None
        self.rope = Rope(platform)

    def forward(
        self,
        x: torch.Tensor | Fp8Rows,
        angles: Angles,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        lora: LoRAMapping | None,
    ) -> torch.Tensor:
        meta = meta.for_window(self.window)  # a sliding layer's KV may be in a pool of its own
        qkv = self.qkv_proj(x, lora)
        tokens, heads = qkv.shape[0], self.num_heads
        if backend.takes_qkv:
            norms = None
            if self.q_norm is not None and self.k_norm is not None:
                norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            out = backend.forward_qkv(
                qkv, heads, angles, norms, kv_cache, meta, self.scale, self.window, self.sinks
            )
        else:
            qk_size = self.q_size + self.kv_size
            v = qkv[:, qk_size:].view(tokens, self.num_kv_heads, self.head_dim)
            if self.q_norm is None:
                # q's and k's heads side by side in the fused projection: one rotation.
                qk = qkv[:, :qk_size].view(tokens, heads + self.num_kv_heads, self.head_dim)
                qk = self.rope(qk, angles)
                q, k = qk[:, :heads], qk[:, heads:]
            else:
                # Heads as rows [T * H, D] (a copy out of the projection), which the native
                # norm takes.
                dim = self.head_dim
                q = self.q_norm(qkv[:, : self.q_size].reshape(-1, dim))
                k = self.k_norm(qkv[:, self.q_size : qk_size].reshape(-1, dim))
                q = self.rope(q.view(tokens, heads, dim), angles)
                k = self.rope(k.view(tokens, self.num_kv_heads, dim), angles)
            out = backend.forward(q, k, v, kv_cache, meta, self.scale, self.window, self.sinks)
        out = self.o_proj(out.reshape(tokens, self.q_size), lora)
        return out if self.parallel is None else self.parallel.all_reduce(out)


class MLP(nn.Module):
    """SwiGLU of `intermediate` (default: the config's intermediate_size)."""

    def __init__(
        self,
        config: ModelConfig,
        platform: Platform,
        methods: LinearMethods,
        prefix: str,
        parallel: TensorParallel | None = None,
        intermediate: int | None = None,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        hidden = config.hidden_size
        intermediate = intermediate or config.intermediate_size
        self.gate_up_proj = decoder_linear(
            hidden, 2 * intermediate, config.mlp_bias, methods, f"{prefix}.gate_up_proj"
        )
        self.act = SiluAndMul(platform)
        self.down_proj = decoder_linear(
            intermediate, hidden, config.mlp_bias, methods, f"{prefix}.down_proj"
        )

    def forward(self, x: torch.Tensor | Fp8Rows, lora: LoRAMapping | None) -> torch.Tensor:
        h = self.act(self.gate_up_proj(x, lora), fp8=self.down_proj.takes_fp8_rows)
        out = self.down_proj(h, lora)
        return out if self.parallel is None else self.parallel.all_reduce(out)


def feed_forward(
    config: ModelConfig,
    index: int,
    platform: Platform,
    methods: LinearMethods,
    prefix: str,
    parallel: TensorParallel | None = None,
) -> MLP | SparseMoeBlock:
    """Decoder layer `index`'s feed-forward: its mixture of experts where the config makes the
    layer sparse (with its shared expert, a SwiGLU MLP), else the dense MLP."""
    moe = config.moe
    if moe is None or index not in moe.sparse_layers:
        return MLP(config, platform, methods, prefix, parallel)
    shared = None
    if moe.shared_intermediate_size:
        shared = MLP(
            config,
            platform,
            methods,
            f"{prefix}.shared_expert",
            parallel,
            moe.shared_intermediate_size,
        )
    return SparseMoeBlock(config.hidden_size, moe, platform, methods, prefix, shared)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        index: int,
        platform: Platform,
        methods: LinearMethods,
        parallel: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        prefix = f"layers.{index}"
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, platform)
        self.self_attn = Attention(
            config, platform, methods, f"{prefix}.self_attn", parallel, config.window(index)
        )
        self.post_attention_layernorm = RMSNorm(hidden, eps, platform)
        self.mlp = feed_forward(config, index, platform, methods, f"{prefix}.mlp", parallel)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        angles: Angles,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        lora: LoRAMapping | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's output before its residual add, and the residual stream: each residual
        add is fused into the norm that follows it, and so is the quantization of the norm's
        rows where they feed an FP8 linear layer (a mixture of experts routes float rows)."""
        fp8 = self.self_attn.qkv_proj.takes_fp8_rows
        if residual is None:
            h, residual = self.input_layernorm(x, fp8), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual, fp8)
        h = self.self_attn(h, angles, kv_cache, meta, backend, lora)
        fp8 = isinstance(self.mlp, MLP) and self.mlp.gate_up_proj.takes_fp8_rows
        h, residual = self.post_attention_layernorm.add_forward(h, residual, fp8)
        return self.mlp(h, lora), residual

    def native_kernels(self, kv_cache: KVCache) -> decoder.LayerKernels | None:
        """This layer over `kv_cache` as the native CPU decoder step runs it; None where one of
        its linear layers runs no native kernel, its feed-forward is a mixture of experts the
        step does not run (see `SparseMoeBlock.native_kernels`), or its attention has sinks
        (the step's attention kernel takes none)."""
        attention, mlp, moe = self.self_attn, self.mlp, None
        if attention.sinks is not None:
            return None
        if isinstance(mlp, SparseMoeBlock):
            moe = mlp.native_kernels()
            if moe is None:
                return None
            mlp = mlp.shared_expert  # what runs beside the experts on every token, if anything
        if not isinstance(mlp, MLP | None):
            return None
        ffn = () if mlp is None else (mlp.gate_up_proj, mlp.down_proj)
        linears = [
            linear.native_kernels() for linear in (attention.qkv_proj, attention.o_proj, *ffn)
        ]
        if any(linear is None for linear in linears):
            return None
        qkv, o, gate_up, down = linears if ffn else (*linears, None, None)
        norms = None
        if attention.q_norm is not None and attention.k_norm is not None:
            norms = (attention.q_norm.weight.detach(), attention.k_norm.weight.detach())
        return decoder.LayerKernels(
            self.input_layernorm.weight.detach(),
            self.post_attention_layernorm.weight.detach(),
            qkv,
            o,
            gate_up,
            down,
            kv_cache=kv_cache,
            qk_norms=norms,
            window=attention.window,
            moe=moe,
        )


class LlamaForCausalLM(nn.Module):
    """Built for one platform, each linear layer with the method `methods` chooses for it (see
    `checkpoints.loader.build_model`), and with `max_loras` LoRA adapter slots of ranks up to
    `max_lora_rank` in every decoder linear (none: LoRA off, at no cost). With `parallel`, this
    rank's shard of the model (see `layers/parallel.py`)."""

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
        self.config = config
        self.parallel = parallel
        # The decoder layers' shape on this rank.
        self.layer_config = config
        hidden = config.hidden_size
        if parallel is None:
            self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
            self.lm_head = build_lm_head(config, methods)
        else:
            self.layer_config = parallel.local_config(config)
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, parallel)
            start, end = parallel.vocab_rows(config.vocab_size)
            self.lm_head = build_lm_head(config, methods, end - start)
        self.layers = nn.ModuleList(
            DecoderLayer(self.layer_config, i, platform, methods, parallel)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(hidden, config.rms_norm_eps, platform)
        # A tied head computes with the embedding's weight (see load_weights).
        self.rotary = RotaryEmbedding(config, max_positions)
        # The media encoders, by the kind of media each takes.
        self.encoders = nn.ModuleDict(
            {encoder.kind: encoder.build(hidden) for encoder in config.encoders}
        )
        self.lora = LoRAAdapters(
            self.layers, shard_sizes(config), max_loras, max_lora_rank, platform
        )
        self._cpu_ops = platform.cpu_ops
        # The switch: steps run every layer in one native call where the model allows
        # (`_native_step`); False keeps them on the Python layers (what the native step
        # matches). `ran_native_step`: whether the last forward pass ran in it.
        self.native_step = True
        self.ran_native_step = False
        # The native step, and the KV caches it was built over.
        self._step: tuple[list[KVCache], decoder.DecoderStep | None] | None = None
        # Whether the sliding layers' caches are a pool of their own, and of which caches.
        self._pools: tuple[list[KVCache], bool] | None = None

    @property
    def max_loras(self) -> int:
        return self.lora.max_loras

    @property
    def num_attention_layers(self) -> int:
        """Layers with a KV cache: all of them."""
        return self.config.num_layers

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for every packed token; `batch.lora`
        says which tokens run with which loaded adapter (None: all with the base model),
        `batch.media` which take an encoder's output instead of their token's embedding."""
        input_ids, meta, lora = batch.input_ids, batch.attention, batch.lora
        if lora is not None and lora.num_tokens != input_ids.shape[0]:
            raise ValueError(f"LoRA mapping of {lora.num_tokens} tokens for {input_ids.shape[0]}")
        kv_caches, backend = caches.kv, caches.backend
        if meta.window is None and self._window_pool(kv_caches):
            raise ValueError(
                "the sliding layers' KV is in a pool of its own, and the step has no block "
                "tables for it (AttentionMetadata.window)"
            )
        x, angles = batch.embed(self.embed_tokens, self.rotary)
        # Inputs that join or are read between the layers run them one by one.
        between = batch.between_layers(x.shape[-1])
        step = None
        if (lora is None or lora.per_token) and input_ids.shape[0] > 0 and between is None:
            step = self._native_step(kv_caches, backend)
        self.ran_native_step = step is not None
        if step is not None:
            slots = None if lora is None else lora.token_slots
            x, residual = step(x, *angles, meta, slots)
        else:
            residual = None
            if between is not None:
                x = between(-1, x, residual)
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
                x, residual = layer(x, residual, angles, kv_cache, meta, backend, lora)
                if between is not None:
                    x = between(i, x, residual)
        return self.norm.add_forward(x, residual)[0]

    def _window_pool(self, kv_caches: list[KVCache]) -> bool:
        """Whether the sliding layers' caches are a pool of their own (the window group's: of
        another size than the full layers'); found once per set of caches."""
        if self._pools is None or self._pools[0] is not kv_caches:
            sizes = {
                layer.self_attn.window is not None: kv[0].numel()
                for layer, kv in zip(self.layers, kv_caches, strict=True)
            }
            self._pools = (kv_caches, len(sizes) == 2 and sizes[True] != sizes[False])
        return self._pools[1]

    def _experts(self, index: int) -> Experts | None:
        """Layer `index`'s experts, if its feed-forward is a mixture of experts."""
        if index < len(self.layers) and isinstance(self.layers[index].mlp, SparseMoeBlock):
            return self.layers[index].mlp.experts
        return None

    def allocate_states(
        self, num_slots: int, dtype: torch.dtype, device: torch.device
    ) -> MambaStates | None:
        """None: a Llama-family decoder keeps no state beside its KV."""
        return None

    def _native_step(
        self, kv_caches: list[KVCache], backend: AttentionBackend
    ) -> decoder.DecoderStep | None:
        """The native decoder step over `kv_caches` (built on first use), or None where a
        layer cannot run in it: off the CPU float32 path with its native attention, under
        tensor parallelism, or a linear layer without a native kernel."""
        if not self.native_step:
            return None
        if self._step is None or self._step[0] is not kv_caches:
            self._step = (kv_caches, self._build_native_step(kv_caches, backend))
        return self._step[1]

    def _build_native_step(
        self, kv_caches: list[KVCache], backend: AttentionBackend
    ) -> decoder.DecoderStep | None:
        # The CPU backend implies float32 caches and a head_dim its kernels take.
        if (
            not isinstance(backend, CpuAttentionBackend)
            or self._cpu_ops is None
            or self.parallel is not None
        ):
            return None
        config = self.layer_config
        shape = decoder.StepShape(
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            config.rms_norm_eps,
            self.layers[0].self_attn.scale,
        )
        layers = [
            layer.native_kernels(kv) for layer, kv in zip(self.layers, kv_caches, strict=True)
        ]
        return decoder.build_step(layers, shape, self._cpu_ops, backend.library)

    def _route_to_encoders(
        self, weights: list[tuple[str, torch.Tensor]]
    ) -> dict[str, list[tuple[str, torch.Tensor]]]:
        """Each encoder's tensors: all of them where it is the only one; else each tensor to
        the encoder holding a parameter of its name (none: a ValueError naming it)."""
        if len(self.encoders) < 2:
            return {kind: weights for kind in self.encoders}
        owners = {
            name: kind for kind, encoder in self.encoders.items() for name in encoder.state_dict()
        }
        routed: dict[str, list[tuple[str, torch.Tensor]]] = {kind: [] for kind in self.encoders}
        for name, tensor in weights:
            if name not in owners:
                raise ValueError(f"checkpoint tensor {name!r} belongs to no media encoder")
            routed[owners[name]].append((name, tensor))
        return routed

    def media_encoders(self) -> dict[str, nn.Module]:
        """The encoder of each kind of media the model takes."""
        return dict(self.encoders)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.parallel is None:
            return logits
        return self.parallel.gather_vocab(logits, self.config.vocab_size)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in (fail if a parameter is missing or unknown), then
        turn every linear layer's weight into the form its method runs."""
        if self.config.tie_word_embeddings:
            # Shared, the head's weight is loaded with the embedding's; a method that runs
            # another form makes its copy after loading and leaves the embedding as it is.
            self.lm_head.weight = self.embed_tokens.weight
        encoder_weights = []

        def decoder_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                for old, new in _MULTIMODAL_NAMES:
                    if name.startswith(old):
                        name = new + name.removeprefix(old)
                        break
                if name.startswith(_ENCODER_NAMES):
                    encoder_weights.append((name, tensor))
                    continue
                name = name.removeprefix("model.").replace(*_EXPERT_BLOCK_NAMES)
                if name == "lm_head.weight" and self.config.tie_word_embeddings:
                    continue  # tied: the embedding is the head
                if "rotary_emb" in name:
                    continue
                if self.parallel is not None:
                    tensor = self.parallel.shard(name, tensor, self.config)
                yield name, tensor

        load_fused(
            self,
            load_expert_tensors(decoder_weights(), _EXPERTS, self._experts),
            _FUSED,
            shard_sizes(self.layer_config),
            ("encoders.", _EXPERTS),
        )
        for kind, tensors in self._route_to_encoders(encoder_weights).items():
            self.encoders[kind].load_weights(tensors)
        if encoder_weights and not self.encoders:
            raise ValueError(
                f"checkpoint tensor {encoder_weights[0][0]!r} belongs to a media encoder, "
                "which this model's config does not describe"
            )
        process_weights_after_loading(self)
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoeBlock):
                layer.mlp.experts.finish_loading()
        self.lora.reset()


class AroundDecoder(nn.Module):
    """A model the runtime runs as one Llama-family decoder among its parts (`runs`): the
    CausalLM contract, that decoder's."""

    def runs(self) -> LlamaForCausalLM:
        raise NotImplementedError

    @property
    def max_loras(self) -> int:
        return self.runs().max_loras

    @property
    def num_attention_layers(self) -> int:
        return self.runs().num_attention_layers

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        return self.runs()(batch, caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.runs().compute_logits(hidden)

    def allocate_states(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        return None

    def media_encoders(self) -> dict[str, nn.Module]:
        return self.runs().media_encoders()


# The family's flavours: its configs' `family`.
FLAVOURS = ("llama", "mistral", "qwen2", "qwen3")


def llama_from_hf(cfg: dict[str, Any], flavour: str) -> ModelConfig:
    """The ModelConfig of a `config.json` dict of the family's `flavour` (its `family`)."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}; this decoder implements SwiGLU (silu)")
    num_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
    attention_bias = bool(cfg.get("attention_bias", False))
    return ModelConfig(
        family=flavour,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        rope=rope_from_hf(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=flavour == "qwen2" or attention_bias,
        o_bias=flavour in ("llama", "qwen3") and attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=flavour == "qwen3",
        layer_windows=_layer_windows(cfg, flavour),
    )


def _layer_windows(cfg: dict[str, Any], flavour: str) -> tuple[int | None, ...]:
    """Each layer's attention window, as transformers 5 reads the config (empty: none slides).
    Mistral's (and Mixtral's) `sliding_window` is every layer's. A Qwen config's only counts
    under `use_sliding_window`, for the layers its `layer_types` mark "sliding_attention", or
    by its model type's default: Qwen2's and Qwen3's layers from `max_window_layers` on,
    Qwen2-MoE's even layers below it, Qwen3-MoE's every layer (it reads no `layer_types`)."""
    layers = cfg["num_hidden_layers"]
    if flavour == "mistral":
        window = cfg.get("sliding_window")
        return () if window is None else (window,) * layers
    # Absent keys take transformers' Qwen defaults.
    window = cfg.get("sliding_window", 4096)
    if not cfg.get("use_sliding_window", False) or window is None:
        return ()
    first, model_type = cfg.get("max_window_layers", 28), cfg.get("model_type")
    if model_type == "qwen3_moe":
        sliding = [True] * layers
    elif cfg.get("layer_types"):
        sliding = [kind == "sliding_attention" for kind in cfg["layer_types"]]
    elif model_type == "qwen2_moe":
        sliding = [i % 2 == 0 and i < first for i in range(layers)]
    else:
        sliding = [i >= first for i in range(layers)]
    return tuple(window if s else None for s in sliding) if any(sliding) else ()


# A layer's tensor (after "blk.N.") -> its Hugging Face name (after "layers.N.").
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # A mixture of experts: the router, every expert's gate, up and down stacked [E, rows,
    # cols], and a shared expert with its gate.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# The tensors outside the layers (hybrids' files name them so too).
GLOBAL_TENSORS = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}


def llama_from_gguf(gguf: GGUFMetadata, flavour: str) -> ModelConfig:
    """The ModelConfig of a GGUF file of the family's `flavour`, from llama.cpp's metadata. A
    `llama` file with experts is Mixtral (llama.cpp converts it so)."""
    a = gguf.architecture
    hidden = gguf.field(f"{a}.embedding_length")
    heads = gguf.field(f"{a}.attention.head_count")
    names = gguf.tensor_names
    moe = gguf_moe(gguf, renormalize=True)
    if moe is not None and flavour == "llama":
        flavour = "mixtral"
    return ModelConfig(
        family=flavour,
        vocab_size=gguf_vocab_size(gguf),
        hidden_size=hidden,
        intermediate_size=gguf.field(f"{a}.feed_forward_length"),
        num_layers=gguf.field(f"{a}.block_count"),
        num_heads=heads,
        num_kv_heads=gguf.field(f"{a}.attention.head_count_kv") or heads,
        head_dim=gguf.field(f"{a}.attention.key_length") or hidden // heads,
        rms_norm_eps=float(gguf.field(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=gguf.field(f"{a}.context_length", 4096),
        rope=gguf_rope(gguf),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_up.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        layer_windows=gguf_layer_windows(gguf),
        moe=moe,
    )


def gguf_layer_windows(gguf: GGUFMetadata) -> tuple[int | None, ...]:
    """Each layer's attention window from llama.cpp's metadata (empty: none slides): its
    `sliding_window`, over the layers its `sliding_window_pattern` marks (a flag per layer, or
    n: all but every n-th layer, as llama.cpp reads it), else over every layer."""
    a = gguf.architecture
    window = gguf.field(f"{a}.attention.sliding_window")
    if not window:
        return ()
    layers = gguf.field(f"{a}.block_count")
    pattern = gguf.field(f"{a}.attention.sliding_window_pattern", 0)
    if isinstance(pattern, int):
        sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    else:
        sliding = [bool(flag) for flag in pattern]
    return tuple(window if s else None for s in sliding) if any(sliding) else ()


def gguf_moe(gguf: GGUFMetadata, renormalize: bool) -> MoEConfig | None:
    """The mixture of experts of a GGUF file with an expert count (None without one): its
    sparse layers are those with a router (`ffn_gate_inp`); whether the k weights are
    renormalized is `{arch}.expert_weights_norm`, else what llama.cpp does for the
    architecture (`renormalize`)."""
    a = gguf.architecture
    experts = gguf.field(f"{a}.expert_count") or 0
    if not experts:
        return None
    layers = gguf.field(f"{a}.block_count")
    sparse = tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in gguf.tensor_names)
    shared = gguf.field(f"{a}.expert_shared_feed_forward_length", 0)
    return MoEConfig(
        num_experts=experts,
        top_k=gguf.required(f"{a}.expert_used_count"),
        intermediate_size=gguf.field(f"{a}.expert_feed_forward_length")
        or gguf.required(f"{a}.feed_forward_length"),
        sparse_layers=sparse,
        renormalize=bool(gguf.field(f"{a}.expert_weights_norm", renormalize)),
        shared_intermediate_size=shared,
        shared_gate=bool(shared) and "blk.0.ffn_gate_inp_shexp.weight" in gguf.tensor_names,
    )


def gguf_vocab_size(gguf: GGUFMetadata) -> int:
    """The vocabulary's size: the metadata's, or the tokenizer's token count."""
    a = gguf.architecture
    return gguf.field(f"{a}.vocab_size") or len(gguf.field("tokenizer.ggml.tokens") or [])


def gguf_rope(gguf: GGUFMetadata) -> RopeConfig:
    """The rotary embedding of a GGUF file; Llama 3's frequency scaling comes as the divisors of
    tensor `rope_freqs`."""
    a = gguf.architecture
    scaling = gguf.field(f"{a}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ValueError(f"unsupported GGUF rope scaling type {scaling!r}")
    freq_factors = None
    if "rope_freqs.weight" in gguf.tensor_names:
        freq_factors = tuple(float(x) for x in gguf.tensor("rope_freqs.weight"))
    return RopeConfig(
        theta=float(gguf.field(f"{a}.rope.freq_base", 10000.0)),
        type="linear" if scaling == "linear" else "default",
        factor=float(gguf.field(f"{a}.rope.scaling.factor", 1.0)),
        freq_factors=freq_factors,
    )


def gguf_layer_kind(name: str) -> str:
    """What a layer's tensor is ("attn_q" of "blk.3.attn_q.weight"); "" outside the layers."""
    return name.split(".")[2] if name.startswith("blk.") else ""


def unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of each head's rotary halves (rows of q/k, or a bias)."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def unpermute_qk(name: str, rows: np.ndarray, config: ModelConfig) -> np.ndarray:
    """`rows` of tensor `name` with llama.cpp's q/k permutation undone where it applies."""
    kind = gguf_layer_kind(name)
    if kind in ("attn_q", "attn_k"):
        return unpermute(rows, config.num_heads if kind == "attn_q" else config.num_kv_heads)
    return rows


class LlamaGGUFTensors:
    """The family's tensors in llama.cpp's files; `permuted`: the converter interleaved q's and
    k's rotary halves (its llama conversion; not its qwen2 or qwen3)."""

    def __init__(self, permuted: bool) -> None:
        self.permuted = permuted

    def hf_name(self, name: str) -> str | None:
        base, _, suffix = name.rpartition(".")
        if base == "rope_freqs":
            return None  # folded into the rope config
        parts = base.split(".")
        if parts[0] == "blk" and len(parts) == 3:
            return f"layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
        return f"{GLOBAL_TENSORS[base]}.{suffix}"

    def rows(self, name: str, rows: np.ndarray, config: ModelConfig) -> np.ndarray:
        return unpermute_qk(name, rows, config) if self.permuted else rows

    def keeps_shape(self, name: str) -> bool:
        return gguf_layer_kind(name) != "ffn_gate_inp_shexp"

    def reshape(self, name: str, values: np.ndarray) -> np.ndarray:
        if gguf_layer_kind(name) == "ffn_gate_inp_shexp":  # stored [H]: the model's is [1, H]
            return values.reshape(1, -1)
        return values


def _flavour(name: str, architecture: str, gguf: str | None = None) -> Family:
    """One flavour of the family: its Hugging Face architecture and, where llama.cpp converts
    it to one of its own, its GGUF architecture."""
    return Family(
        name,
        LlamaForCausalLM,
        hf_architectures=(architecture,),
        from_hf=functools.partial(llama_from_hf, flavour=name),
        gguf_architectures=() if gguf is None else (gguf,),
        from_gguf=functools.partial(llama_from_gguf, flavour=name),
        gguf_tensors=LlamaGGUFTensors(permuted=gguf == "llama"),
    )


register(_flavour("llama", "LlamaForCausalLM", gguf="llama"))
register(_flavour("mistral", "MistralForCausalLM"))  # llama.cpp converts Mistral to llama
register(_flavour("qwen2", "Qwen2ForCausalLM", gguf="qwen2"))
register(_flavour("qwen3", "Qwen3ForCausalLM", gguf="qwen3"))

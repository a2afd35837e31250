"""Random-weight checkpoints of real model shapes, built in memory (nothing is downloaded)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models

from inflight.model.checkpoints.loader import Checkpoint
from inflight.model.checkpoints.tokenizer import SpecialTokens, Tokenizer
from inflight.model.config import MambaConfig, ModelConfig, MoEConfig, RopeConfig
from inflight.model.encoders.audio import AudioConfig
from inflight.model.encoders.qwen2_vl import Qwen2VLVisionConfig
from inflight.model.encoders.vision import VisionConfig
from inflight.model.families.diffusion_gemma import LAYER_NORMS

SHAPES = {
    "qwen3-0.6b": ModelConfig(
        family="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
        max_position_embeddings=40960, rope=RopeConfig(theta=1_000_000.0),
        tie_word_embeddings=True, qk_norm=True,
    ),
    "llama-3.1-8b": ModelConfig(
        family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        rope=RopeConfig(theta=500_000.0, type="llama3", factor=8.0, low_freq_factor=1.0,
                        high_freq_factor=4.0, original_max_position_embeddings=8192),
    ),
    # 128 experts of 768, 8 a token, in each of its 48 layers (30.5B parameters, 3.3B active).
    "qwen3-30b-a3b": ModelConfig(
        family="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6,
        max_position_embeddings=40960, rope=RopeConfig(theta=1_000_000.0), qk_norm=True,
        moe=MoEConfig(num_experts=128, top_k=8, intermediate_size=768,
                      sparse_layers=tuple(range(48))),
    ),
    # gpt-oss-20b: 24 layers alternating a 128-token window and full attention, each with
    # sinks and 32 experts of 2,880 (clamped SwiGLU with biases), 4 a token; YaRN rope.
    "gpt-oss-20b": ModelConfig(
        family="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
        num_layers=24, num_heads=64, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        rope=RopeConfig(theta=150_000.0, type="yarn", factor=32.0, truncate=False,
                        original_max_position_embeddings=4096),
        qkv_bias=True, o_bias=True, attention_sinks=True,
        layer_windows=tuple(128 if i % 2 == 0 else None for i in range(24)),
        moe=MoEConfig(num_experts=32, top_k=4, intermediate_size=2880,
                      sparse_layers=tuple(range(24)), router_bias=True,
                      activation="swiglu_clamped", expert_bias=True),
    ),
    # SmolLM2-135M's decoder, its last id standing for an image, behind a CLIP ViT-B/16 tower
    # of 224-pixel images (196 image tokens), as LLaVA builds them.
    "llava-clip-b16-smollm2": ModelConfig(
        family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
        max_position_embeddings=8192, rope=RopeConfig(theta=100_000.0),
        tie_word_embeddings=True,
        vision=VisionConfig(
            tower="clip", hidden_size=768, intermediate_size=3072, num_layers=12,
            num_heads=12, image_size=224, patch_size=16, layer_norm_eps=1e-5,
            hidden_act="quick_gelu", image_token_id=49151,
        ),
    ),
    # Qwen2-VL-2B: a 32-block tower of 14-pixel patches merged 2x2 (an image's tokens are its
    # pixels / 28^2), M-RoPE on a Qwen2 decoder.
    "qwen2-vl-2b": ModelConfig(
        family="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
        num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128, rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        rope=RopeConfig(theta=1_000_000.0, mrope_section=(16, 24, 24)),
        tie_word_embeddings=True, qkv_bias=True,
        vision=Qwen2VLVisionConfig(
            family="qwen2_vl", depth=32, embed_dim=1280, intermediate_size=5120, num_heads=16,
            hidden_act="quick_gelu", patch_size=14, temporal_patch_size=2,
            spatial_merge_size=2, in_channels=3, out_hidden_size=1536,
            image_token_id=151655, vision_start_token_id=151652,
        ),
    ),
    # Voxtral-Mini-3B: a Whisper-large-style encoder (128 mel bins, 30 s windows of 375 tokens)
    # before a Llama decoder.
    "voxtral-mini-3b": ModelConfig(
        family="llama", vocab_size=131072, hidden_size=3072, intermediate_size=8192,
        num_layers=30, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
        max_position_embeddings=131072, rope=RopeConfig(theta=100_000_000.0),
        audio=AudioConfig(
            num_mel_bins=128, hidden_size=1280, num_layers=32, num_heads=20,
            intermediate_size=5120, max_source_positions=1500, audio_token_id=24,
        ),
    ),
    # Bamba-9B: the width of Llama-3.1-8B, 32 layers of which 3 attend (9, 18, 27) and the
    # others are Mamba2 mixers of 128 heads x 64 channels with a 128-wide state.
    "bamba-9b": ModelConfig(
        family="bamba", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
        max_position_embeddings=8192, rope=RopeConfig(theta=10000.0),
        mamba=MambaConfig(
            layer_types=tuple("attention" if i in (9, 18, 27) else "mamba" for i in range(32)),
            n_heads=128, head_dim=64, n_groups=1, d_state=128, d_conv=4, chunk_size=256,
            conv_bias=True, proj_bias=False, norm_eps=1e-5, partial_rotary_factor=0.5,
        ),
    ),
    # One small Qwen3 layer with a 2,048-token vocabulary: a step of it costs the host's work
    # (scheduling, sampling bookkeeping, outputs), not the forward pass.
    "host-step": ModelConfig(
        family="qwen3", vocab_size=2048, hidden_size=64, intermediate_size=128,
        num_layers=1, num_heads=2, num_kv_heads=1, head_dim=32, rms_norm_eps=1e-6,
        max_position_embeddings=40960, rope=RopeConfig(theta=1_000_000.0),
        tie_word_embeddings=True, qk_norm=True,
    ),
}  # fmt: skip

# The same with 4 of their layers: small enough for a device check to build each three times.
SHAPES["qwen3-30b-a3b-4-layers"] = replace(
    SHAPES["qwen3-30b-a3b"],
    num_layers=4,
    moe=replace(SHAPES["qwen3-30b-a3b"].moe, sparse_layers=(0, 1, 2, 3)),
)
SHAPES["gpt-oss-20b-4-layers"] = replace(
    SHAPES["gpt-oss-20b"],
    num_layers=4,
    layer_windows=(128, None, 128, None),
    moe=replace(SHAPES["gpt-oss-20b"].moe, sparse_layers=(0, 1, 2, 3)),
)


class RandomWeights:
    """Normal(0, 0.02) matrices and unit norms, generated on `device` as they are loaded."""

    def __init__(self, config: ModelConfig, device: torch.device, seed: int = 0) -> None:
        self.config = config
        self.device = device
        self.seed = seed

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        c = self.config
        gen = torch.Generator(device=self.device).manual_seed(self.seed)

        def matrix(rows: int, cols: int) -> torch.Tensor:
            w = torch.empty(rows, cols, device=self.device, dtype=torch.bfloat16)
            return w.normal_(0.0, 0.02, generator=gen)

        def ones(size: int) -> torch.Tensor:
            return torch.ones(size, device=self.device, dtype=torch.bfloat16)

        if c.mamba is not None:
            yield from self._bamba_weights(matrix, ones)
            return
        if c.diffusion is not None:
            yield from self._diffusion_weights(matrix, ones)
            return
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        yield "embed_tokens.weight", matrix(c.vocab_size, c.hidden_size)
        for i in range(c.num_layers):
            p = f"layers.{i}."
            yield p + "input_layernorm.weight", ones(c.hidden_size)
            yield p + "post_attention_layernorm.weight", ones(c.hidden_size)
            yield p + "self_attn.q_proj.weight", matrix(q, c.hidden_size)
            yield p + "self_attn.k_proj.weight", matrix(kv, c.hidden_size)
            yield p + "self_attn.v_proj.weight", matrix(kv, c.hidden_size)
            yield p + "self_attn.o_proj.weight", matrix(c.hidden_size, q)
            if c.qkv_bias:
                for name, size in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                    yield p + f"self_attn.{name}.bias", ones(size).zero_()
            if c.o_bias:
                yield p + "self_attn.o_proj.bias", ones(c.hidden_size).zero_()
            if c.attention_sinks:  # logits of the size of the scores'
                yield p + "self_attn.sinks", matrix(1, c.num_heads).view(-1) * 50
            if c.qk_norm:
                yield p + "self_attn.q_norm.weight", ones(c.head_dim)
                yield p + "self_attn.k_norm.weight", ones(c.head_dim)
            if c.moe is not None and i in c.moe.sparse_layers:
                e, inner = c.moe.num_experts, c.moe.intermediate_size
                yield p + "mlp.gate.weight", matrix(e, c.hidden_size)
                if c.moe.router_bias:
                    yield p + "mlp.gate.bias", ones(e).zero_()
                if c.family == "gpt_oss":  # transformers' layout, with biases
                    yield (
                        p + "mlp.experts.gate_up_proj",
                        matrix(e * c.hidden_size, 2 * inner).view(e, c.hidden_size, 2 * inner),
                    )
                    yield p + "mlp.experts.gate_up_proj_bias", matrix(e, 2 * inner)
                    yield (
                        p + "mlp.experts.down_proj",
                        matrix(e * inner, c.hidden_size).view(e, inner, c.hidden_size),
                    )
                    yield p + "mlp.experts.down_proj_bias", matrix(e, c.hidden_size)
                    continue
                yield (
                    p + "mlp.experts.gate_up_proj",
                    matrix(e * 2 * inner, c.hidden_size).view(e, 2 * inner, c.hidden_size),
                )
                yield (
                    p + "mlp.experts.down_proj",
                    matrix(e * c.hidden_size, inner).view(e, c.hidden_size, inner),
                )
                continue
            yield p + "mlp.gate_proj.weight", matrix(c.intermediate_size, c.hidden_size)
            yield p + "mlp.up_proj.weight", matrix(c.intermediate_size, c.hidden_size)
            yield p + "mlp.down_proj.weight", matrix(c.hidden_size, c.intermediate_size)
        yield "norm.weight", ones(c.hidden_size)
        if not c.tie_word_embeddings:
            yield "lm_head.weight", matrix(c.vocab_size, c.hidden_size)
        yield from self._encoder_weights(matrix, ones)

    def _bamba_weights(self, matrix, ones) -> Iterator[tuple[str, torch.Tensor]]:
        """A Bamba checkpoint's, under transformers' names (A = -1, D = 1, biases zero)."""
        c, m = self.config, self.config.mamba
        assert m is not None and c.family == "bamba"
        q, kv, hidden = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size
        yield "model.embed_tokens.weight", matrix(c.vocab_size, hidden)
        for i, kind in enumerate(m.layer_types):
            p = f"model.layers.{i}."
            yield p + "input_layernorm.weight", ones(hidden)
            yield p + "pre_ff_layernorm.weight", ones(hidden)
            if kind == "attention":
                yield p + "self_attn.q_proj.weight", matrix(q, hidden)
                yield p + "self_attn.k_proj.weight", matrix(kv, hidden)
                yield p + "self_attn.v_proj.weight", matrix(kv, hidden)
                yield p + "self_attn.o_proj.weight", matrix(hidden, q)
            else:
                p += "mamba."
                yield p + "in_proj.weight", matrix(m.d_inner + m.conv_dim + m.n_heads, hidden)
                yield p + "conv1d.weight", matrix(m.conv_dim, m.d_conv).view(m.conv_dim, 1, -1)
                yield p + "conv1d.bias", ones(m.conv_dim).zero_()
                yield p + "dt_bias", ones(m.n_heads).zero_()
                yield p + "A_log", ones(m.n_heads).zero_()
                yield p + "D", ones(m.n_heads)
                yield p + "norm.weight", ones(m.d_inner)
                yield p + "out_proj.weight", matrix(hidden, m.d_inner)
            p = f"model.layers.{i}.feed_forward."
            yield p + "gate_proj.weight", matrix(c.intermediate_size, hidden)
            yield p + "up_proj.weight", matrix(c.intermediate_size, hidden)
            yield p + "down_proj.weight", matrix(hidden, c.intermediate_size)
        yield "model.final_layernorm.weight", ones(hidden)
        yield "lm_head.weight", matrix(c.vocab_size, hidden)

    def _diffusion_weights(self, matrix, ones) -> Iterator[tuple[str, torch.Tensor]]:
        """A DiffusionGemma checkpoint's text weights, under transformers' names (norms,
        scales and layer scalars one)."""
        c, d, moe = self.config, self.config.diffusion, self.config.moe
        assert d is not None and moe is not None
        hidden, inner, e, k = (
            c.hidden_size,
            c.intermediate_size,
            moe.num_experts,
            moe.intermediate_size,
        )
        yield "model.decoder.embed_tokens.weight", matrix(c.vocab_size, hidden)
        for i in range(c.num_layers):
            full = c.window(i) is None
            head = d.global_head_dim if full else c.head_dim
            kv = (d.global_kv_heads if full else c.num_kv_heads) * head
            p = f"model.decoder.layers.{i}."
            for norm in LAYER_NORMS:
                yield p + norm + ".weight", ones(hidden)
            yield p + "self_attn.q_proj.weight", matrix(c.num_heads * head, hidden)
            yield p + "self_attn.k_proj.weight", matrix(kv, hidden)
            if not full:
                yield p + "self_attn.v_proj.weight", matrix(kv, hidden)
            yield p + "self_attn.o_proj.weight", matrix(hidden, c.num_heads * head)
            yield p + "self_attn.q_norm.weight", ones(head)
            yield p + "self_attn.k_norm.weight", ones(head)
            yield p + "mlp.gate_proj.weight", matrix(inner, hidden)
            yield p + "mlp.up_proj.weight", matrix(inner, hidden)
            yield p + "mlp.down_proj.weight", matrix(hidden, inner)
            yield p + "router.proj.weight", matrix(e, hidden)
            yield p + "router.scale", ones(hidden)
            yield p + "router.per_expert_scale", ones(e)
            yield p + "experts.gate_up_proj", matrix(e * 2 * k, hidden).view(e, 2 * k, hidden)
            yield p + "experts.down_proj", matrix(e * hidden, k).view(e, hidden, k)
            yield p + "layer_scalar", ones(1)
            yield f"model.encoder.language_model.layers.{i}.layer_scalar", ones(1)
        yield "model.decoder.norm.weight", ones(hidden)
        p = "model.decoder.self_conditioning."
        yield p + "pre_norm.weight", ones(hidden)
        yield p + "gate_proj.weight", matrix(inner, hidden)
        yield p + "up_proj.weight", matrix(inner, hidden)
        yield p + "down_proj.weight", matrix(hidden, inner)

    def _encoder_weights(self, matrix, ones) -> Iterator[tuple[str, torch.Tensor]]:
        """The media encoder's (tower and projector), under their Hugging Face names: the
        names the encoder modules keep. Norm weights one, biases zero."""
        with torch.device("meta"):  # its names and shapes only
            encoders = [e.build(self.config.hidden_size) for e in self.config.encoders]
        for encoder in encoders:
            for name, param in encoder.named_parameters():
                if name.endswith("bias"):
                    yield name, ones(param.shape[0]).zero_()
                elif "norm" in name and param.dim() == 1:
                    yield name, ones(param.shape[0])
                else:
                    yield name, matrix(param.shape[0], param[0].numel()).view(param.shape)


def numbered_tokenizer(vocab_size: int) -> Tokenizer:
    """A word-level tokenizer naming every id ("t0", "t1", ...): enough to decode any output."""
    vocab = {f"t{i} ": i for i in range(vocab_size)}
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token="t0 "))
    return Tokenizer(backend, SpecialTokens(eos_ids=[0]), chat_template=None, byte_level=False)


def random_checkpoint(
    shape: str, device: torch.device, seed: int = 0, tokenizer: Tokenizer | None = None
) -> Checkpoint:
    """Random weights of `shape`, with `tokenizer` (one of a smaller vocabulary will do: a real
    one gives benchmarks real text) or one naming every id."""
    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; known: {', '.join(SHAPES)}")
    config = SHAPES[shape]
    return Checkpoint(
        path=Path(f"{shape}-random"),
        config=config,
        tokenizer=tokenizer or numbered_tokenizer(config.vocab_size),
        source=RandomWeights(config, device, seed),
    )

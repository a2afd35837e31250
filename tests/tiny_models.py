"""Tiny random-weight checkpoints of each supported family, written as real HF directories."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from inflight.model.config import ModelConfig
from inflight.model.encoders.vision import VisionConfig

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "In-flight batching admits new requests into a batch that is already generating.",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "Numbers like 12345 and symbols like {}[]() appear in code.",
    "def add(a, b):\n    return a + b\n",
] * 20

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB = 320

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=2,
)


def _family(name: str):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    return {
        # Llama 3 style: RoPE scaling with all three frequency bands in use, untied head.
        "llama": (
            LlamaConfig,
            LlamaForCausalLM,
            dict(
                tie_word_embeddings=False,
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 10000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            ),
        ),
        "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=None, head_dim=16)),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=32, tie_word_embeddings=False)),
    }[name]


FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def write_tokenizer(path: Path, extra_special: tuple[str, ...] = ()) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[*SPECIAL, *extra_special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|endoftext|>",
                "eos_token": "<|im_end|>",
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )


def _save_random(
    model_cls, config, path: Path, seed: int, special: tuple[str, ...] = (), keep: str | None = None
):
    """The model of `config` with seeded random weights, its matrices (but those whose names
    hold `keep`, an encoder's) scaled up so the logits spread and greedy picks are clear-cut,
    written to `path` with a tokenizer of `special` tokens; returns it (float32)."""
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 and (keep is None or keep not in name):
                p.normal_(0.0, 0.2)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    write_tokenizer(path, special)
    return model


def make_tiny_model(family: str, path: Path, seed: int = 0, special: tuple[str, ...] = ()):
    """Write a tiny random checkpoint of `family` to `path` (its tokenizer with the `special`
    tokens too); returns the HF model (float32)."""
    config_cls, model_cls, extra = _family(family)
    return _save_random(model_cls, config_cls(**{**COMMON, **extra}), path, seed, special)


def make_lora_adapter(base: Path, path: Path, seed: int, **config):
    """A tiny random PEFT LoRA adapter on the checkpoint at `base`, written to `path`; returns
    the peft model (float32), the reference. `init_lora_weights=False`: peft's default makes the
    adapter a no-op."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **config)).eval()
    peft_model.save_pretrained(path)
    return peft_model


IMAGE_TOKEN = "<image>"
IMAGE_TOKEN_ID = len(SPECIAL)  # the tiny LLaVA tokenizer's next special token


def make_tiny_llava(path: Path, tower: str = "clip", seed: int = 0):
    """A tiny random LLaVA (a CLIP or SigLIP tower of 32x32 images in 8x8 patches, 16 image
    tokens, and a Llama decoder) written to `path` with its tokenizer (`<image>` a special
    token) and image processor; returns the HF model (float32)."""
    from transformers import (
        CLIPImageProcessor,
        LlavaConfig,
        LlavaForConditionalGeneration,
        SiglipImageProcessorPil,
    )

    vision = dict(
        model_type="clip_vision_model" if tower == "clip" else "siglip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=dict(model_type="llama", **COMMON),
        image_token_index=IMAGE_TOKEN_ID,
        vision_feature_layer=-2,
        # SigLIP has no class token: LLaVA models on it keep every patch.
        vision_feature_select_strategy="default" if tower == "clip" else "full",
        image_seq_length=16,
    )
    model = _save_random(
        LlavaForConditionalGeneration, config, path, seed, (IMAGE_TOKEN,), "vision_tower"
    )
    if tower == "clip":
        processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size=32)
    else:
        processor = SiglipImageProcessorPil(size={"height": 32, "width": 32})
    processor.save_pretrained(path)
    return model


# Qwen2-VL's special tokens, the tiny tokenizer's next special tokens (ids 3, 4, 5, 6).
QWEN_VISION_TOKENS = ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>")
QWEN_IMAGE_ID, QWEN_START_ID, QWEN_END_ID = len(SPECIAL), len(SPECIAL) + 1, len(SPECIAL) + 2


def make_tiny_qwen2_vl(path: Path, seed: int = 0, version: str = "2"):
    """A tiny random Qwen2-VL (a 2-layer tower of 4x4 patches merged 2x2, M-RoPE sections
    [2, 3, 3] on 16-wide heads, a Qwen2 decoder) written to `path` with its tokenizer and an
    image processor of small images (at most 64x64 pixels); returns the HF model (float32).
    `version` "2.5": Qwen2.5-VL (its tower attends within 16-pixel windows but in block 1)."""
    import transformers
    from transformers import Qwen2VLImageProcessorPil

    text = {
        **COMMON,
        "rope_parameters": dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3]),
        "tie_word_embeddings": True,
    }
    geometry = dict(depth=2, num_heads=4, patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
    if version == "2":
        config_cls = transformers.Qwen2VLConfig
        model_cls = transformers.Qwen2VLForConditionalGeneration
        vision = dict(geometry, embed_dim=32, hidden_size=COMMON["hidden_size"], mlp_ratio=2)
    else:
        config_cls = transformers.Qwen2_5_VLConfig
        model_cls = transformers.Qwen2_5_VLForConditionalGeneration
        vision = dict(
            geometry,
            hidden_size=32,
            intermediate_size=64,
            out_hidden_size=COMMON["hidden_size"],
            window_size=16,
            fullatt_block_indexes=[1],
        )
    config = config_cls(
        text_config=text,
        vision_config=vision,
        image_token_id=QWEN_IMAGE_ID,
        video_token_id=len(SPECIAL) + 3,
        vision_start_token_id=QWEN_START_ID,
        vision_end_token_id=QWEN_END_ID,
        tie_word_embeddings=True,
    )
    model = _save_random(model_cls, config, path, seed, QWEN_VISION_TOKENS, "visual")
    processor = Qwen2VLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=8 * 8, max_pixels=64 * 64
    )
    processor.save_pretrained(path)
    return model


AUDIO_TOKEN = "[AUDIO]"
AUDIO_TOKEN_ID = len(SPECIAL)  # the tiny Voxtral tokenizer's next special token
# A window of the tiny audio encoder is 2 x 32 mel frames: 1 s of 16 kHz audio at a hop of 250.
AUDIO_TOKENS_PER_SECOND = 8  # 32 encoder frames, 4 stacked per token
AUDIO_FEATURES = dict(feature_size=16, chunk_length=1, hop_length=250)  # its feature extractor


def make_tiny_voxtral(path: Path, seed: int = 0):
    """A tiny random Voxtral (a 2-layer Whisper-style encoder of 16 mel bins over 1 s windows,
    8 tokens a window, and a Llama decoder) written to `path` with its tokenizer (`[AUDIO]` a
    special token) and feature extractor; returns the HF model (float32)."""
    from transformers import VoxtralConfig, VoxtralForConditionalGeneration, WhisperFeatureExtractor

    config = VoxtralConfig(
        audio_config=dict(
            model_type="voxtral_encoder",
            num_mel_bins=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            hidden_size=32,
            intermediate_size=128,
            max_source_positions=32,
        ),
        text_config=dict(model_type="llama", **COMMON),
        audio_token_id=AUDIO_TOKEN_ID,
    )
    model = _save_random(
        VoxtralForConditionalGeneration, config, path, seed, (AUDIO_TOKEN,), "audio_tower"
    )
    WhisperFeatureExtractor(**AUDIO_FEATURES).save_pretrained(path)
    return model


HYBRID_BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def make_tiny_hybrid(family: str, path, seed: int = 0):
    """A tiny random Bamba or NemotronH checkpoint (Mamba chunk_size 8) written to `path` with
    a tokenizer; returns the transformers model (float32)."""
    import transformers as tf

    if family == "bamba":
        config = tf.BambaConfig(
            **HYBRID_BASE,
            num_hidden_layers=4,
            attn_layer_indices=[1, 3],
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=8,
        )
        model_cls = tf.BambaForCausalLM
    else:
        # Two groups of B and C; mamba first, then an MLP, attention, and an MLP.
        config = tf.NemotronHConfig(
            **HYBRID_BASE,
            head_dim=16,
            layers_block_type=["mamba", "mlp", "attention", "mlp"],
            ssm_state_size=16,
            mamba_num_heads=8,
            mamba_head_dim=16,
            n_groups=2,
            chunk_size=8,
        )
        model_cls = tf.NemotronHForCausalLM
    return _save_random(model_cls, config, path, seed)


def small_shape(shape: ModelConfig) -> ModelConfig:
    """The shape shrunk to a few layers of small widths, its encoder, Mamba layers, windows
    and experts too."""
    small = replace(
        shape,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        layer_windows=shape.layer_windows[:2],
    )
    if isinstance(shape.vision, VisionConfig):
        vision = replace(shape.vision, hidden_size=32, intermediate_size=64, num_layers=2)
        small = replace(small, vision=replace(vision, num_heads=4, image_size=32, patch_size=16))
    elif shape.vision is not None:
        vision = replace(shape.vision, depth=2, embed_dim=32, intermediate_size=64, num_heads=4)
        small = replace(small, vision=replace(vision, out_hidden_size=64))
    if shape.audio is not None:
        audio = dict(num_mel_bins=16, hidden_size=32, intermediate_size=128, num_layers=2)
        # 1500 positions: the 30 s windows of the default feature extractor.
        small = replace(small, audio=replace(shape.audio, **audio, num_heads=4))
    if shape.mamba is not None:
        mamba = replace(shape.mamba, layer_types=("mamba", "attention"), n_heads=4, head_dim=32)
        small = replace(small, mamba=replace(mamba, d_state=16, chunk_size=8))
    if shape.moe is not None:
        moe = dict(num_experts=8, top_k=2, intermediate_size=32, sparse_layers=(0, 1))
        small = replace(small, moe=replace(shape.moe, **moe))
    return small


# Tiny mixture-of-experts checkpoints: 8 experts, 2 a token (Qwen3-MoE with its renormalized
# weights, and without them beside a dense first layer; Qwen2-MoE with its gated shared
# expert; Mixtral).
MOE_FAMILIES = ("qwen3_moe", "qwen3_moe_dense_first", "qwen2_moe", "mixtral")


def make_tiny_moe(name: str, path: Path, seed: int = 0):
    """A tiny random mixture-of-experts checkpoint `name` (of MOE_FAMILIES) written to `path`
    with a tokenizer; returns the transformers model (float32)."""
    import transformers as tf

    experts = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    config_cls, model_cls, extra = {
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, dict(norm_topk_prob=True)),
        "qwen3_moe_dense_first": (
            tf.Qwen3MoeConfig,
            tf.Qwen3MoeForCausalLM,
            dict(norm_topk_prob=False, mlp_only_layers=[0]),
        ),
        "qwen2_moe": (
            tf.Qwen2MoeConfig,
            tf.Qwen2MoeForCausalLM,
            dict(shared_expert_intermediate_size=48),
        ),
        "mixtral": (
            tf.MixtralConfig,
            tf.MixtralForCausalLM,
            # Mixtral's default rope theta is 1e6; the GGUF tests' writer stores 1e4.
            dict(
                num_local_experts=8,
                num_experts_per_tok=2,
                intermediate_size=32,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            ),
        ),
    }[name]
    if name != "mixtral":
        extra = {**experts, **extra}
    return _save_random(model_cls, config_cls(**{**COMMON, "head_dim": 16, **extra}), path, seed)


# Tiny NemotronH checkpoints with mixture-of-experts layers: 8 relu² experts, 2 a token, a
# shared expert and a random selection bias. "grouped": the experts in 4 groups, of which each
# token's best 2 hold its experts; "latent": the experts run in a latent space of 24, and every
# MLP (the shared expert, the latent projections) has biases.
NEMOTRON_H_MOE_VARIANTS = ("grouped", "latent")


def make_tiny_nemotron_h_moe(variant: str, path: Path, seed: int = 0):
    """A tiny random NemotronH checkpoint of `variant` (of NEMOTRON_H_MOE_VARIANTS), layers
    mamba, moe, attention, moe (Mamba chunk_size 8), written to `path` with a tokenizer;
    returns the transformers model (float32)."""
    import transformers as tf

    extra = {
        "grouped": dict(n_group=4, topk_group=2),
        "latent": dict(moe_latent_size=24, mlp_bias=True),
    }[variant]
    config = tf.NemotronHConfig(
        **HYBRID_BASE,
        head_dim=16,
        layers_block_type=["mamba", "moe", "attention", "moe"],
        ssm_state_size=16,
        mamba_num_heads=8,
        mamba_head_dim=16,
        n_groups=2,
        chunk_size=8,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48,
        routed_scaling_factor=2.5,
        **extra,
    )
    model = _save_random(tf.NemotronHForCausalLM, config, path, seed)
    # transformers starts the selection bias and the biases at zero, where they would choose
    # and add nothing; written again with them random.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0.0, 0.1)
        for layer in model.model.layers:
            if layer.block_type == "moe":
                layer.mixer.gate.e_score_correction_bias.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return model


# Tiny sliding-window checkpoints, windows of SLIDING_WINDOW tokens: "mistral" slides in every
# layer; "qwen2" under `use_sliding_window` from layer `max_window_layers` (1) on, its
# config.json without `layer_types` as Qwen2 checkpoints write it; "qwen3" alternating sliding
# and full layers (`layer_types`, gpt-oss's pattern) over 4 layers.
SLIDING_KINDS = ("mistral", "qwen2", "qwen3")
SLIDING_WINDOW = 12


def make_tiny_sliding(kind: str, path: Path, seed: int = 0):
    """A tiny random sliding-window checkpoint `kind` (of SLIDING_KINDS) written to `path` with
    a tokenizer; returns the transformers model (float32)."""
    import transformers as tf

    window = dict(sliding_window=SLIDING_WINDOW)
    qwen = dict(window, use_sliding_window=True)
    config_cls, model_cls, extra = {
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM, dict(window, head_dim=16)),
        "qwen2": (
            tf.Qwen2Config,
            tf.Qwen2ForCausalLM,
            dict(qwen, max_window_layers=1, tie_word_embeddings=True),
        ),
        "qwen3": (
            tf.Qwen3Config,
            tf.Qwen3ForCausalLM,
            dict(
                qwen,
                head_dim=32,
                num_hidden_layers=4,
                layer_types=["sliding_attention", "full_attention"] * 2,
            ),
        ),
    }[kind]
    model = _save_random(model_cls, config_cls(**{**COMMON, **extra}), path, seed)
    if kind == "qwen2":
        config = json.loads((path / "config.json").read_text())
        del config["layer_types"]
        (path / "config.json").write_text(json.dumps(config))
    return model


# A tiny gpt-oss: 4 layers alternating a window of GPT_OSS_WINDOW tokens and full attention,
# YaRN rope (its config's default), 8 experts of 32 with biases, 2 a token.
GPT_OSS_WINDOW = 6
# OpenAI's harmony format's special tokens (gpt-oss's chat template writes them).
HARMONY_TOKENS = (
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
)


def make_tiny_gpt_oss(path: Path, seed: int = 0, mxfp4: bool = False):
    """A tiny random gpt-oss checkpoint written to `path` with a tokenizer that has harmony's
    special tokens; with `mxfp4`, its experts stored as OpenAI's checkpoints store them (MXFP4
    blocks and scales, rows of gate and up interleaved). Returns the transformers model
    (float32; with `mxfp4`, transformers' load of the file, its experts dequantized)."""
    import transformers as tf

    config = tf.GptOssConfig(
        **{**COMMON, "head_dim": 16, "num_hidden_layers": 4, "intermediate_size": 32},
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=GPT_OSS_WINDOW,
    )
    model = _save_random(tf.GptOssForCausalLM, config, path, seed, HARMONY_TOKENS)
    # transformers starts the sinks and biases near zero: written again with them spread, so
    # that each changes the output.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0.0, 1.0)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    if not mxfp4:
        return model
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        # transformers' layout [E, in, out]; the checkpoint's [E, out, in / 32, 16] + scales.
        blocks, scales = quantize_mxfp4(tensors.pop(name).transpose(1, 2))
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (path / "config.json").write_text(json.dumps(config))
    # Dequantized as it loads (transformers 5.25 would otherwise fetch MXFP4 kernels from the
    # hub, even on a machine that cannot run them).
    return tf.GptOssForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=tf.Mxfp4Config(dequantize=True)
    ).eval()


def quantize_mxfp4(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 blocks uint8 [*, rows, cols / 32, 16] and scales uint8 [*, rows, cols / 32] of
    `rows` [*, rows, cols]: each group of 32 values as a power of two (its largest at most 6
    times it) times the nearest FP4 value, two codes a byte, the low nibble first."""
    from inflight.model.families.gpt_oss import FP4_VALUES

    magnitudes = torch.tensor(FP4_VALUES[:8])
    groups = rows.float().reshape(*rows.shape[:-1], -1, 32)
    top = groups.abs().amax(-1).clamp(min=2.0**-126)
    exponents = torch.ceil(torch.log2(top / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponents)[..., None]
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1) + 8 * (scaled < 0)
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponents + 127).to(torch.uint8)

"""LLaVA: a CLIP or SigLIP vision tower (`encoders/vision.py`) before a decoder of the Llama
family, whose config.json nests the decoder's in `text_config`. Its configs name the decoder's
flavour as their `family`: that flavour's model (LlamaForCausalLM) runs them, its encoder
built from `ModelConfig.vision`."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from inflight.model.config import ModelConfig
from inflight.model.encoders.vision import vision_from_hf
from inflight.model.families.llama import FLAVOURS, llama_from_hf
from inflight.model.registry import Family, register

# A text_config names its flavour by model_type and may leave the rest at transformers'
# defaults (llava-1.5 writes a few fields only): those of LlamaConfig.
LLAMA_DEFAULTS = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
)


def text_config(cfg: dict[str, Any]) -> ModelConfig:
    """The decoder of a config.json laid out as LLaVA's (Voxtral's too): its `text_config`,
    read as a text model's config.json."""
    text = dict(cfg.get("text_config") or {})
    flavour = text.get("model_type", "llama")
    if flavour not in FLAVOURS:
        raise ValueError(
            f"unsupported multimodal text model {flavour!r}; supported: {', '.join(FLAVOURS)}"
        )
    text = {**LLAMA_DEFAULTS, **text}
    text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    return llama_from_hf(text, flavour)


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    return replace(text_config(cfg), vision=vision_from_hf(cfg))


register(
    Family("llava", hf_architectures=("LlavaForConditionalGeneration",), from_hf=config_from_hf)
)

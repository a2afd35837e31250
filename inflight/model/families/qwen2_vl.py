"""Qwen2-VL and Qwen2.5-VL: their image tower (`encoders/qwen2_vl.py`) before a Qwen2 decoder
that rotates image tokens by M-RoPE. Their configs' `family` is "qwen2": that flavour's model
(LlamaForCausalLM) runs them, its encoder built from `ModelConfig.vision`."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from inflight.model.config import ModelConfig
from inflight.model.encoders.qwen2_vl import QWEN2_VL_FAMILIES, qwen2_vl_vision_from_hf
from inflight.model.families.llama import llama_from_hf
from inflight.model.registry import Family, register


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """transformers 5 nests the decoder's config in text_config; older files keep it at the top
    level."""
    text = dict(cfg.get("text_config") or {k: v for k, v in cfg.items() if k != "vision_config"})
    text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    config = llama_from_hf(text, "qwen2")
    if config.rope.mrope_section is None:
        raise ValueError("a Qwen2-VL config.json needs rope mrope_section")
    return replace(config, vision=qwen2_vl_vision_from_hf(cfg))


register(Family("qwen2_vl", hf_architectures=tuple(QWEN2_VL_FAMILIES), from_hf=config_from_hf))

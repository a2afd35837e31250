"""Voxtral: a Whisper-style audio encoder (`encoders/audio.py`) before a Llama decoder, in
LLaVA's config.json layout. Its configs name the decoder's flavour as their `family`: that
flavour's model (LlamaForCausalLM) runs them, its encoder built from `ModelConfig.audio`."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from inflight.model.config import ModelConfig
from inflight.model.encoders.audio import audio_from_hf
from inflight.model.families.llava import text_config
from inflight.model.registry import Family, register


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    return replace(text_config(cfg), audio=audio_from_hf(cfg))


register(
    Family("voxtral", hf_architectures=("VoxtralForConditionalGeneration",), from_hf=config_from_hf)
)

"""Mixtral: the Mistral decoder (Llama family) with a mixture of experts in every layer, whose
router weights each token's top-k experts by their softmax over the k. llama.cpp converts it
as `llama` (its GGUF files are the Llama family's, experts and all). Registers the flavour
mixtral."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from inflight.model.config import ModelConfig, MoEConfig
from inflight.model.families.llama import LlamaForCausalLM, llama_from_hf
from inflight.model.registry import Family, register


def _from_hf(cfg: dict[str, Any]) -> ModelConfig:
    base = llama_from_hf(cfg, "mistral")
    moe = MoEConfig(
        num_experts=cfg["num_local_experts"],
        top_k=cfg["num_experts_per_tok"],
        intermediate_size=cfg["intermediate_size"],
        sparse_layers=tuple(range(cfg["num_hidden_layers"])),
    )
    return replace(base, family="mixtral", moe=moe)


register(
    Family("mixtral", LlamaForCausalLM, hf_architectures=("MixtralForCausalLM",), from_hf=_from_hf)
)

"""Qwen2-MoE and Qwen3-MoE: the Qwen2 and Qwen3 decoders (Llama family) whose sparse layers'
MLP is a mixture of experts (`layers/moe.py`), with a softmax router; Qwen2-MoE adds a shared
expert gated by a sigmoid. Registers the flavours qwen2_moe and qwen3_moe."""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

from inflight.model.config import ModelConfig, MoEConfig
from inflight.model.families.llama import LlamaForCausalLM, llama_from_hf
from inflight.model.registry import Family, register


def sparse_layers(cfg: dict[str, Any]) -> tuple[int, ...]:
    """The layers whose MLP is the mixture: every `decoder_sparse_step`-th, but the
    `mlp_only_layers`."""
    step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
    return tuple(
        i for i in range(cfg["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0
    )


def _from_hf(cfg: dict[str, Any], flavour: str) -> ModelConfig:
    base = llama_from_hf(cfg, flavour.removesuffix("_moe"))
    # transformers 5 writes the expert count as `num_local_experts`.
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    shared = cfg.get("shared_expert_intermediate_size", 0) if flavour == "qwen2_moe" else 0
    moe = MoEConfig(
        num_experts=experts,
        top_k=cfg["num_experts_per_tok"],
        intermediate_size=cfg["moe_intermediate_size"],
        sparse_layers=sparse_layers(cfg),
        renormalize=bool(cfg.get("norm_topk_prob", False)),
        shared_intermediate_size=shared,
        shared_gate=bool(shared),
    )
    return replace(base, family=flavour, moe=moe)


register(
    Family(
        "qwen2_moe",
        LlamaForCausalLM,
        hf_architectures=("Qwen2MoeForCausalLM",),
        from_hf=functools.partial(_from_hf, flavour="qwen2_moe"),
    )
)
register(
    Family(
        "qwen3_moe",
        LlamaForCausalLM,
        hf_architectures=("Qwen3MoeForCausalLM",),
        from_hf=functools.partial(_from_hf, flavour="qwen3_moe"),
    )
)

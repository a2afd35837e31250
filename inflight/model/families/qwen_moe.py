"""Qwen2-MoE and Qwen3-MoE: the Qwen2 and Qwen3 decoders (Llama family) whose sparse layers'
MLP is a mixture of experts (`layers/moe.py`), with a softmax router; Qwen2-MoE adds a shared
expert gated by a sigmoid. Registers the flavours qwen2_moe and qwen3_moe, from Hugging Face
checkpoints and llama.cpp's GGUF files (`qwen2moe`, `qwen3moe`)."""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

from inflight.model.config import ModelConfig, MoEConfig
from inflight.model.families.llama import (
    LlamaForCausalLM,
    LlamaGGUFTensors,
    gguf_moe,
    llama_from_gguf,
    llama_from_hf,
)
from inflight.model.registry import Family, GGUFMetadata, register


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


def _from_gguf(gguf: GGUFMetadata, flavour: str) -> ModelConfig:
    base = llama_from_gguf(gguf, flavour.removesuffix("_moe"))
    # llama.cpp renormalizes Qwen3-MoE's k weights, not Qwen2-MoE's.
    moe = gguf_moe(gguf, renormalize=flavour == "qwen3_moe")
    if moe is None:
        raise ValueError(f"{gguf.architecture} GGUF file {gguf.path} has no expert count")
    return replace(base, family=flavour, moe=moe)


for _flavour, _hf, _gguf in (
    ("qwen2_moe", "Qwen2MoeForCausalLM", "qwen2moe"),
    ("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3moe"),
):
    register(
        Family(
            _flavour,
            LlamaForCausalLM,
            hf_architectures=(_hf,),
            from_hf=functools.partial(_from_hf, flavour=_flavour),
            gguf_architectures=(_gguf,),
            from_gguf=functools.partial(_from_gguf, flavour=_flavour),
            gguf_tensors=LlamaGGUFTensors(permuted=False),
        )
    )

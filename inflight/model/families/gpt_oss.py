"""gpt-oss: the Llama-family decoder with biases on q, k, v and o, a learned attention sink per
head, layers alternating between a sliding window and full attention, YaRN rotary embeddings,
and a mixture of experts in every layer: a router with a bias (top-k of its logits, softmax over
the k) and experts with biases whose SwiGLU clamps its gate and up halves. Registers the flavour
gpt_oss, from Hugging Face checkpoints: transformers' float layout or OpenAI's MXFP4 experts,
which load dequantized (FP4 values times a power of two: exact in any float dtype).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch

from inflight.model.config import ModelConfig, MoEConfig
from inflight.model.families.llama import LlamaForCausalLM, llama_from_hf
from inflight.model.registry import Family, register

# MXFP4's 16 codes: sign, then two exponent bits and one mantissa bit.
FP4_VALUES = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip
# An MXFP4 tensor's two parts: "…experts.gate_up_proj_blocks" and "…_scales".
_PACKED = re.compile(r"^(.*\.experts\.(?:gate_up|down)_proj)_(blocks|scales)$")


def _from_hf(cfg: dict[str, Any]) -> ModelConfig:
    layers = cfg["num_hidden_layers"]
    kinds = cfg.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
    ]
    window = cfg.get("sliding_window")
    windows = tuple(window if kind == "sliding_attention" else None for kind in kinds)
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    # transformers' defaults for a gpt-oss config that leaves them out.
    rope.setdefault("rope_theta", cfg.get("rope_theta", 150000.0))
    if "rope_type" not in rope and "type" not in rope:
        rope.update(
            rope_type="yarn",
            factor=32.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=4096,
        )
    base = llama_from_hf({**cfg, "rope_parameters": rope, "attention_bias": True}, "llama")
    moe = MoEConfig(
        num_experts=cfg["num_local_experts"],
        top_k=cfg["num_experts_per_tok"],
        intermediate_size=cfg["intermediate_size"],
        sparse_layers=tuple(range(layers)),
        router_bias=True,
        activation="swiglu_clamped",
        expert_bias=True,
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
    )
    return replace(
        base,
        family="gpt_oss",
        attention_sinks=True,
        layer_windows=windows if window and any(windows) else (),
        moe=moe,
    )


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [*, rows, 32 * groups] of MXFP4 `blocks` uint8 [*, rows, groups, 16] (two codes a
    byte, the low nibble first) and `scales` uint8 [*, rows, groups] (E8M0: 2^(s - 127))."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype}, {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}"
        )
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [*, groups, 16, 2]
    values = table[codes].flatten(-3)  # [*, rows, 32 * groups]
    exponents = (scales.int() - 127).repeat_interleave(32, dim=-1)
    return torch.ldexp(values, exponents)


def model_layout(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """A gpt-oss checkpoint's tensors as the Llama family loads them: the router as the MoE
    block's gate, MXFP4 experts dequantized, and the experts' first matmul (rows of gate and
    up interleaved; transformers' float layout also transposed, [E, H, 2I]) split into
    `gate_proj` and `up_proj` [E, I, H], its bias alike, and `down_proj` [E, H, I]."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        name = name.replace(".mlp.router.", ".mlp.gate.")
        packed = _PACKED.match(name)
        if packed is not None:
            parts = pending.setdefault(packed[1], {})
            parts[packed[2]] = tensor
            if len(parts) == 2:
                del pending[packed[1]]
                yield from _experts(packed[1], dequantize_mxfp4(parts["blocks"], parts["scales"]))
            continue
        if name.endswith(".experts.gate_up_proj") or name.endswith(".experts.down_proj"):
            yield from _experts(name, tensor.transpose(1, 2))
        elif name.endswith(".experts.gate_up_proj_bias"):
            stem = name.removesuffix("gate_up_proj_bias")
            yield f"{stem}gate_proj.bias", tensor[:, ::2]
            yield f"{stem}up_proj.bias", tensor[:, 1::2]
        else:
            yield name, tensor
    if pending:
        stem, parts = next(iter(pending.items()))
        lacking = "scales" if "blocks" in parts else "blocks"
        raise ValueError(f"MXFP4 tensor {stem} lacks its {lacking}")


def _experts(name: str, rows: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """`gate_up_proj` [E, 2I, H] (gate and up rows interleaved) as gate_proj and up_proj, or
    `down_proj` [E, H, I] as it is."""
    if name.endswith("down_proj"):
        yield name, rows
        return
    stem = name.removesuffix("gate_up_proj")
    yield f"{stem}gate_proj", rows[:, ::2]
    yield f"{stem}up_proj", rows[:, 1::2]


class GptOssForCausalLM(LlamaForCausalLM):
    """The Llama decoder as gpt-oss's config builds it (sinks, windows, experts); it differs
    only in how its checkpoints lay out the experts."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(model_layout(weights))


register(
    Family(
        "gpt_oss",
        GptOssForCausalLM,
        hf_architectures=("GptOssForCausalLM",),
        from_hf=_from_hf,
    )
)

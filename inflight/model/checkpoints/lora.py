"""LoRA adapters in PEFT's format: a directory of `adapter_config.json` and
`adapter_model.safetensors`, checked against the base model they are meant for."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from inflight.model.config import ModelConfig
from inflight.model.layers.lora_adapters import LoRAAdapter

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# PEFT options that change what an adapted layer computes, beyond y += scale * (x A^T) B^T;
# an adapter that sets one would silently compute something else here.
_UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "a bias on lora_B (lora_bias)",
    "fan_in_fan_out": "transposed base weights (fan_in_fan_out)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
    "target_parameters": "LoRA on parameters (target_parameters)",
    "layer_replication": "replicated layers (layer_replication)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "kasa_config": "KaSA (kasa_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "arrow_config": "Arrow routing (arrow_config)",
}

_TENSOR = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
)


def target_shapes(config: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """The modules an adapter may target: name -> (block holding it, in_features, out_features)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "q_proj": ("self_attn", hidden, q),
        "k_proj": ("self_attn", hidden, kv),
        "v_proj": ("self_attn", hidden, kv),
        "o_proj": ("self_attn", q, hidden),
        "gate_proj": ("mlp", hidden, inter),
        "up_proj": ("mlp", hidden, inter),
        "down_proj": ("mlp", inter, hidden),
    }


def load_lora_adapter(path: str | Path, config: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read the PEFT LoRA adapter at `path` for a base model of `config`; a ValueError names
    whatever this engine cannot run exactly (DoRA, biases, a rank above `max_rank`, modules
    other than the attention and MLP projections, tensors of another base model)."""
    path = Path(path).expanduser()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / name).is_file():
            raise ValueError(f"LoRA adapter {str(path)!r} has no {name}")
    cfg = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
    rank, scale = _check_config(cfg, config, max_rank)
    shapes = target_shapes(config)
    factors: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as tensors:
        for key in tensors.keys():  # noqa: SIM118 (a safetensors handle is no dict)
            layer, module, factor = _parse_name(key, shapes, config.num_layers)
            tensor = tensors.get_tensor(key)
            _, in_features, out_features = shapes[module]
            want = (rank, in_features) if factor == "A" else (out_features, rank)
            if tuple(tensor.shape) != want:
                raise ValueError(
                    f"LoRA tensor {key!r} has shape {tuple(tensor.shape)}, expected {want} for "
                    "this base model (is the adapter for another base model?)"
                )
            factors.setdefault((layer, module), {})[factor] = tensor
    weights = {}
    for (layer, module), pair in sorted(factors.items()):
        if len(pair) != 2:
            raise ValueError(
                f"LoRA adapter {str(path)!r} has lora_{''.join(pair)} but not both factors for "
                f"layers.{layer}.{module}"
            )
        weights[layer, module] = (pair["A"], pair["B"])
    if not weights:
        raise ValueError(f"LoRA adapter {str(path)!r} holds no LoRA tensors")
    return LoRAAdapter(rank, scale, weights)


def _check_config(cfg: dict[str, Any], config: ModelConfig, max_rank: int) -> tuple[int, float]:
    """The adapter's rank and scale, once its config asks for nothing this engine cannot run."""
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"not a LoRA adapter: peft_type is {cfg.get('peft_type')!r}")
    for option, what in _UNSUPPORTED_OPTIONS.items():
        if cfg.get(option):
            raise ValueError(f"LoRA adapters with {what} are not supported")
    bias = cfg.get("bias", "none")
    if bias != "none":
        raise ValueError(f"LoRA adapters with bias={bias!r} are not supported, only 'none'")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise ValueError(f"LoRA adapter config needs a rank r >= 1 and lora_alpha, got {cfg!r}")
    if rank > max_rank:
        raise ValueError(f"LoRA adapter rank r={rank} is above max_lora_rank={max_rank}")
    targets = cfg.get("target_modules")
    # A regex or "all-linear" is resolved by the tensors the adapter holds; a list names modules
    # by their name or a dotted suffix of their path.
    if isinstance(targets, list):
        shapes = target_shapes(config)
        for target in targets:
            _check_target(target.rpartition(".")[2], shapes)
    return rank, alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank


def _check_target(module: str, shapes: dict[str, Any]) -> None:
    if module not in shapes:
        raise ValueError(
            f"LoRA on {module!r} is not supported: an adapter may target only {', '.join(shapes)}"
        )


def _parse_name(
    key: str, shapes: dict[str, tuple[str, int, int]], num_layers: int
) -> tuple[int, str, str]:
    """(layer index, module, "A" or "B") of a tensor named as PEFT saves a decoder's LoRA."""
    match = _TENSOR.fullmatch(key)
    if match is None:
        leaf = next((m for m in ("embed_tokens", "lm_head") if m in key), None)
        if leaf is not None:
            _check_target(leaf, shapes)
        raise ValueError(f"unexpected tensor {key!r} in a LoRA adapter")
    layer, block, module, factor = int(match[1]), match[2], match[3], match[4]
    _check_target(module, shapes)
    if shapes[module][0] != block:
        raise ValueError(f"unexpected tensor {key!r} in a LoRA adapter")
    if layer >= num_layers:
        raise ValueError(
            f"LoRA tensor {key!r} is for layer {layer}, but the base model has {num_layers} "
            "layers (is the adapter for another base model?)"
        )
    return layer, module, factor

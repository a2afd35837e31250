"""Copying a checkpoint's Hugging Face-named tensors into a model's parameters: one by one
(the media encoders, whose parameters keep those names), or into the decoders' fused
parameters (q/k/v and gate/up stacked into one matmul each), shard by shard."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn


def copy_into(dest: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    """Copy checkpoint tensor `name` into `dest` (a ValueError when the shapes differ)."""
    if dest.shape != tensor.shape:
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
            f"expected {tuple(dest.shape)}"
        )
    dest.copy_(tensor)


@torch.no_grad()
def copy_weights(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], what: str) -> None:
    """Copy each (name, tensor) into `module`'s parameter of that name; an unknown or missing
    one, or a shape that differs, is a ValueError naming it (`what` names the module)."""
    params = dict(module.named_parameters())
    loaded = set()
    for name, tensor in weights:
        if name not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in the {what}")
        copy_into(params[name], tensor, name)
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {what} tensors {missing[:5]}")


@torch.no_grad()
def load_fused(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    fused: Mapping[str, tuple[str, int]],
    sizes: Mapping[str, list[int]],
    skip: tuple[str, ...] = (),
) -> None:
    """Copy (name, tensor) pairs, named as `module`'s parameters would be unfused, into them:
    a name holding a key of `fused` ("...q_proj...") goes to that key's replacement
    ("...qkv_proj...") at shard index i of its parts (`sizes`, by the fused parameter's module
    name, or its last two: "shared_expert.gate_up_proj" before "gate_up_proj"). An unknown
    tensor, a missing one (but parameters whose names hold one of `skip`), or a shape that
    differs is a ValueError naming it."""
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        target, shard = name, None
        for part, (whole, index) in fused.items():
            if part in name:
                target, shard = name.replace(part, whole), index
                break
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in this model")
        dest, label = params[target], target
        if shard is not None:
            parts = _parts(sizes, target)
            dest = dest.narrow(0, sum(parts[:shard]), parts[shard])
            label = f"{target}[{shard}]"
        copy_into(dest, tensor, name)
        loaded.add(label)
    expected = set()
    for pname in params:
        if any(part in pname for part in skip):
            continue
        parts = _parts(sizes, pname) if "." in pname else ()
        expected.update([f"{pname}[{i}]" for i in range(len(parts))] if parts else [pname])
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def _parts(sizes: Mapping[str, list[int]], name: str) -> list[int]:
    """The part sizes of parameter `name`'s module: by its last two names, else its own."""
    path = name.split(".")[:-1]
    return sizes.get(".".join(path[-2:])) or sizes.get(path[-1], [])

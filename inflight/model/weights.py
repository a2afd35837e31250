"""Copying a checkpoint's Hugging Face-named tensors into a module whose parameters keep those
names (the media encoders)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


@torch.no_grad()
def copy_weights(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], what: str) -> None:
    """Copy each (name, tensor) into `module`'s parameter of that name; an unknown or missing
    one, or a shape that differs, is a ValueError naming it (`what` names the module)."""
    params = dict(module.named_parameters())
    loaded = set()
    for name, tensor in weights:
        if name not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in the {what}")
        param = params[name]
        if param.shape != tensor.shape:
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(param.shape)}"
            )
        param.copy_(tensor)
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {what} tensors {missing[:5]}")

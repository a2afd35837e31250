"""The registry of model families. A family is a kind of checkpoint this package reads: the
Hugging Face `architectures` entries and GGUF `general.architecture` values it answers to, how
it parses their configs into a ModelConfig, how llama.cpp's converter stored its tensors, and
the model class built for configs that name it (`ModelConfig.family`).

Each family's module in `families/` registers it when imported (`families/__init__.py` lists
them), so the lookups here find what the package holds once `inflight.model.families` is
imported: the checkpoint readers and the loader do so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np

    from inflight.model.config import ModelConfig
    from inflight.model.contract import CausalLM
    from inflight.model.layers.parallel import TensorParallel
    from inflight.model.layers.platform import Platform
    from inflight.model.layers.quantization import LinearMethods

# A model class, called as build_model calls it: (config, max_positions, platform, methods,
# max_loras, max_lora_rank, parallel).
ModelBuilder = Callable[
    ["ModelConfig", int, "Platform", "LinearMethods", int, int, "TensorParallel | None"],
    "CausalLM",
]


class GGUFMetadata(Protocol):
    """What a family's GGUF config parser reads of a file (checkpoints/gguf.py's
    GGUFCheckpoint)."""

    path: Path
    architecture: str  # general.architecture
    tensor_names: frozenset[str]

    def field(self, key: str, default: Any = None) -> Any:
        """The metadata value of `key`, or `default` where the file has none."""
        ...

    def required(self, key: str) -> Any:
        """The metadata value of `key`; a ValueError naming it where the file has none."""
        ...

    def tensor(self, name: str) -> np.ndarray:
        """Tensor `name` (GGUF's name) dequantized to float32, as stored."""
        ...


class GGUFTensors(Protocol):
    """A family's tensors in llama.cpp's GGUF files: their names, and how to undo what the
    converter did to them. `name` is always a tensor's GGUF name ("blk.0.attn_q.weight")."""

    def hf_name(self, name: str) -> str | None:
        """The Hugging Face name the model loads the tensor under; None where it is no weight
        (folded into the config); a ValueError for a tensor the family does not have."""
        ...

    def rows(self, name: str, rows: np.ndarray, config: ModelConfig) -> np.ndarray:
        """The tensor's rows (its values, or its raw blocks [N, bytes]) in the model's order:
        the converter's row permutations undone."""
        ...

    def keeps_shape(self, name: str) -> bool:
        """Whether the model holds the tensor in its stored shape (only then are its raw blocks
        handed out, and `reshape` leaves it as it is)."""
        ...

    def reshape(self, name: str, values: np.ndarray) -> np.ndarray:
        """The tensor's values (rows in the model's order) in the shape the model holds."""
        ...


@dataclass(frozen=True)
class Family:
    """A family of checkpoints; all but `name` optional. `model`: the class built for configs
    whose `family` is this name (None: a multimodal wrapper, whose configs name their decoder's
    family); `from_hf` parses the config.json of the `hf_architectures`, `from_gguf` the
    metadata of the `gguf_architectures`' files, whose tensors `gguf_tensors` names."""

    name: str
    model: ModelBuilder | None = None
    hf_architectures: tuple[str, ...] = ()
    from_hf: Callable[[dict[str, Any]], ModelConfig] | None = None
    gguf_architectures: tuple[str, ...] = ()
    from_gguf: Callable[[GGUFMetadata], ModelConfig] | None = None
    gguf_tensors: GGUFTensors | None = None

    def __post_init__(self) -> None:
        if self.hf_architectures and self.from_hf is None:
            raise ValueError(f"family {self.name!r} reads Hugging Face configs but has no parser")
        if self.gguf_architectures and (self.from_gguf is None or self.gguf_tensors is None):
            raise ValueError(
                f"family {self.name!r} reads GGUF files but lacks their parser or tensor names"
            )


_FAMILIES: dict[str, Family] = {}
_BY_HF: dict[str, Family] = {}
_BY_GGUF: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add `family`; a ValueError where its name or one of its architectures is taken."""
    taken = [family.name] if family.name in _FAMILIES else []
    taken += [a for a in family.hf_architectures if a in _BY_HF]
    taken += [a for a in family.gguf_architectures if a in _BY_GGUF]
    if taken:
        raise ValueError(f"model family {family.name!r}: {', '.join(taken)} already registered")
    _FAMILIES[family.name] = family
    _BY_HF.update(dict.fromkeys(family.hf_architectures, family))
    _BY_GGUF.update(dict.fromkeys(family.gguf_architectures, family))
    return family


def unregister(name: str) -> None:
    """Remove the family `name` and its architectures."""
    family = by_name(name)
    del _FAMILIES[name]
    for architecture in family.hf_architectures:
        del _BY_HF[architecture]
    for architecture in family.gguf_architectures:
        del _BY_GGUF[architecture]


def families() -> list[Family]:
    """The registered families, in the order they registered."""
    return list(_FAMILIES.values())


def by_name(name: str) -> Family:
    """The family `name` (a ModelConfig's `family`)."""
    family = _FAMILIES.get(name)
    if family is None:
        raise ValueError(f"unknown model family {name!r}; registered: {', '.join(_FAMILIES)}")
    return family


def model_builder(config: ModelConfig) -> ModelBuilder:
    """The model class of `config`'s family."""
    family = by_name(config.family)
    if family.model is None:
        raise ValueError(f"model family {config.family!r} builds no model of its own")
    return family.model


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """The ModelConfig of a Hugging Face `config.json` dict, parsed by the family of the first
    of its `architectures` that one registered."""
    archs = cfg.get("architectures") or []
    family = next((_BY_HF[a] for a in archs if a in _BY_HF), None)
    if family is None:
        raise ValueError(
            f"unsupported architecture {archs or cfg.get('model_type')!r}; "
            f"supported: {', '.join(_BY_HF)}"
        )
    return family.from_hf(cfg)


def gguf_family(architecture: str) -> Family:
    """The family that reads GGUF files of `general.architecture` `architecture`."""
    family = _BY_GGUF.get(architecture)
    if family is None:
        raise ValueError(
            f"unsupported GGUF architecture {architecture!r}; supported: {', '.join(_BY_GGUF)}"
        )
    return family

"""A single GGUF file: its metadata, its tensors dequantized or as stored, and its tokenizer.

What the tensors and metadata keys mean is the knowledge of the family registered for the
file's `general.architecture` (`registry.py`; each family's file in `families/`): the file is
read as its family says, its tensors named and laid out as the family's model loads them.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as dequantize_blocks

import inflight.model.families  # noqa: F401 (registers every family)
from inflight.model import registry
from inflight.model.checkpoints.gguf_tokenizer import gguf_tokenizer
from inflight.model.checkpoints.tokenizer import Tokenizer
from inflight.model.config import ModelConfig
from inflight.model.layers.quantization import StoredBlocks

QUANT_TYPES = frozenset(
    GGMLQuantizationType[name]
    for name in (
        "F32",
        "F16",
        "BF16",
        "Q8_0",
        "Q4_0",
        "Q4_1",
        "Q5_0",
        "Q5_1",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
    )
)


@functools.lru_cache(maxsize=4)
def _reader(path: str, mtime_ns: int, size: int) -> GGUFReader:
    """The gguf package's reader of a file, kept for a process that opens the same file again
    (a second LLM, a test session): parsing the metadata takes it seconds (SmolLM2's 98K
    vocabulary and merge strings, ~5 s here), and a reader is read-only (memory-mapped).
    Keyed by modification time and size, so a file rewritten in place is read anew."""
    return GGUFReader(path)


def dequantize(tensor: Any) -> np.ndarray:
    """A tensor of a GGUF file (the gguf package's ReaderTensor) as float32 values, in a copy of
    its own (the file is read-only); a ValueError for a quantization not read here."""
    if tensor.tensor_type not in QUANT_TYPES:
        raise ValueError(
            f"unsupported GGUF quantization {tensor.tensor_type.name} (tensor {tensor.name}); "
            f"supported: {', '.join(sorted(q.name for q in QUANT_TYPES))}"
        )
    values = dequantize_blocks(tensor.data, tensor.tensor_type)
    shape = [int(d) for d in reversed(tensor.shape)]
    return np.array(values, dtype=np.float32).reshape(shape)


class GGUFCheckpoint:
    """A GGUF file of a registered family (a ValueError naming the supported architectures
    otherwise)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        stat = path.stat()
        self.reader = _reader(str(path.resolve()), stat.st_mtime_ns, stat.st_size)
        self.architecture: str = self.required("general.architecture")
        self.family = registry.gguf_family(self.architecture)
        self.tensor_names = frozenset(t.name for t in self.reader.tensors)

    def field(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def required(self, key: str) -> Any:
        value = self.field(key)
        if value is None:
            raise ValueError(f"GGUF file {self.path} lacks metadata key {key!r}")
        return value

    def tensor(self, name: str) -> np.ndarray:
        return dequantize(next(t for t in self.reader.tensors if t.name == name))

    def config(self) -> ModelConfig:
        return self.family.from_gguf(self)

    def tokenizer(self) -> Tokenizer:
        return gguf_tokenizer(self)

    def stored_types(self) -> dict[str, str]:
        """The GGML type each tensor is stored in ("Q4_1", "Q8_0", "F32", ...), by Hugging Face
        name, a layer's stacked experts also by each expert's name; from the file's header,
        without reading weights."""
        types = {name: tensor.tensor_type.name for name, tensor in self._by_hf_name.items()}
        for name, (stacked, _) in self._by_expert.items():
            types[name] = types[stacked]
        return types

    def weights(self, skip: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
        """Float32 tensors by Hugging Face name, with llama.cpp's transforms undone (the q/k
        row permutation, a hybrid's Mamba2 layouts: the family's `gguf_tensors`); those named
        in `skip` (read as stored blocks instead) neither dequantized nor yielded."""
        config, tensors = self.config(), self.family.gguf_tensors
        for tensor in self.reader.tensors:
            name = self._hf_name(tensor.name)
            if name is None or name in skip or _expert_name(name, 0) in skip:
                continue
            values = tensors.rows(tensor.name, dequantize(tensor), config)
            yield name, torch.from_numpy(tensors.reshape(tensor.name, values))

    def stored_blocks(self, name: str) -> StoredBlocks:
        """The tensor of Hugging Face name `name` as the file stores it: its GGML type and raw
        rows [N, bytes] (a copy), rows in the order `weights` gives them (q/k unpermuted). Only
        for 2-D tensors whose rows are the model's rows (none the family reshapes), and for one
        expert of a layer's stacked experts (by that expert's name)."""
        stacked, expert = self._by_expert.get(name, (name, None))
        tensor = self._by_hf_name.get(stacked)
        if tensor is None:
            raise KeyError(f"GGUF file {self.path} has no tensor {name!r}")
        blocks = np.asarray(tensor.data)
        if expert is not None:
            blocks = blocks[expert]
        tensors = self.family.gguf_tensors
        if blocks.ndim != 2 or blocks.dtype != np.uint8 or not tensors.keeps_shape(tensor.name):
            raise ValueError(
                f"tensor {name!r} ({tensor.tensor_type.name}, {blocks.dtype} "
                f"{tuple(blocks.shape)}) has no raw 2-D block rows to hand out"
            )
        return StoredBlocks(
            tensor.tensor_type.name, np.array(tensors.rows(tensor.name, blocks, self._config))
        )

    @functools.cached_property
    def _config(self) -> ModelConfig:
        return self.config()

    @functools.cached_property
    def _by_hf_name(self) -> dict[str, Any]:
        return {
            name: tensor
            for tensor in self.reader.tensors
            if (name := self._hf_name(tensor.name)) is not None
        }

    @functools.cached_property
    def _by_expert(self) -> dict[str, tuple[str, int]]:
        """Each expert's part of the stacked experts ([E, rows, cols] tensors under a layer's
        `experts.`), by the name the model's experts read it under: (the stacked tensor's
        name, the expert)."""
        return {
            _expert_name(name, expert): (name, expert)
            for name, tensor in self._by_hf_name.items()
            if ".experts." in name and len(tensor.shape) == 3
            for expert in range(int(tensor.shape[2]))
        }

    def _hf_name(self, name: str) -> str | None:
        try:
            return self.family.gguf_tensors.hf_name(name)
        except KeyError:
            raise ValueError(
                f"unexpected tensor {name!r} in {self.architecture} GGUF file {self.path}"
            ) from None


def _expert_name(name: str, expert: int) -> str:
    """The name of one expert's part of stacked experts `name`: llama.cpp stacks a layer's
    experts into one tensor per part ("layers.0.mlp.experts.gate_proj.weight"); the model's
    experts are layers of their own ("layers.0.mlp.experts.3.gate_proj.weight")."""
    stem, found, part = name.rpartition(".experts.")
    return f"{stem}.experts.{expert}.{part}" if found else name

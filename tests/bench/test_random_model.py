"""Random-weight checkpoints for the GPU benchmark, exercised on the CPU with a small shape."""

from dataclasses import replace
from pathlib import Path

import torch

from inflight.bench.random_model import SHAPES, RandomWeights, numbered_tokenizer
from inflight.model.checkpoints.loader import Checkpoint
from inflight.model.config import ModelConfig, VisionConfig
from inflight.runtime.config import RuntimeConfig
from inflight.runtime.request import GenerationRequest, SamplingParams
from inflight.runtime.runtime import Runtime


def _small(shape: ModelConfig) -> ModelConfig:
    """The shape shrunk to a few layers of small widths, its encoder or Mamba layers too."""
    small = replace(
        shape,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )
    if isinstance(shape.vision, VisionConfig):
        vision = replace(shape.vision, hidden_size=32, intermediate_size=64, num_layers=2)
        small = replace(small, vision=replace(vision, num_heads=4, image_size=32, patch_size=16))
    elif shape.vision is not None:
        vision = replace(shape.vision, depth=2, embed_dim=32, intermediate_size=64, num_heads=4)
        small = replace(small, vision=replace(vision, out_hidden_size=64))
    if shape.audio is not None:
        audio = dict(num_mel_bins=16, hidden_size=32, intermediate_size=128, num_layers=2)
        # 1500 positions: the 30 s windows of the default feature extractor.
        small = replace(small, audio=replace(shape.audio, **audio, num_heads=4))
    if shape.mamba is not None:
        mamba = replace(shape.mamba, layer_types=("mamba", "attention"), n_heads=4, head_dim=32)
        small = replace(small, mamba=replace(mamba, d_state=16, chunk_size=8))
    return small


def test_a_small_random_model_loads_and_generates():
    for shape in SHAPES.values():
        small = _small(shape)
        checkpoint = Checkpoint(
            Path("small"),
            small,
            numbered_tokenizer(512),
            _source=RandomWeights(small, torch.device("cpu")),
        )
        runtime = Runtime(
            checkpoint, RuntimeConfig(max_batch_size=2, max_model_len=64, dtype="float32")
        )
        out = runtime.handle_request(
            GenerationRequest(
                [5, 6, 7], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
            )
        ).result()
        assert len(out.token_ids) == 4 and out.text.split()[0].startswith("t")

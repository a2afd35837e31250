"""Random-weight checkpoints for the GPU benchmark, exercised on the CPU with a small shape."""

from pathlib import Path

import torch

from inflight.bench.random_model import SHAPES, RandomWeights, numbered_tokenizer
from inflight.model.checkpoints.loader import Checkpoint
from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.request import GenerationRequest, SamplingParams
from inflight.runtime.runtime import Runtime

from tiny_models import small_shape


def test_a_small_random_model_loads_and_generates():
    for shape in SHAPES.values():
        small = small_shape(shape)
        checkpoint = Checkpoint(
            Path("small"),
            small,
            numbered_tokenizer(512),
            source=RandomWeights(small, torch.device("cpu")),
        )
        runtime = Runtime(
            checkpoint, DeploymentOptions(max_batch_size=2, max_model_len=64, dtype="float32")
        )
        out = runtime.handle_request(
            GenerationRequest(
                [5, 6, 7], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
            )
        ).result()
        assert len(out.token_ids) == 4 and out.text.split()[0].startswith("t")

"""Qwen2-VL and Qwen2.5-VL against transformers on tiny random checkpoints (CPU): the decoder's
logits with 0, 1 and 2 images of different sizes, where M-RoPE gives image tokens 3-D positions
and shifts the text after each image, through a prefill and 8 decode steps."""

import copy

import numpy as np
import pytest
import torch
from PIL import Image

from inflight.model.contract import MediaEmbeds
from inflight.model.encoders.base import PreparedItem
from inflight.runtime.host.media import expand, mrope_positions, mrope_shift
from inflight.runtime.inputs.preprocessing import media_inputs

from helpers import assert_tracks, float32_model
from tiny_models import QWEN_END_ID, QWEN_IMAGE_ID, QWEN_START_ID, make_tiny_qwen2_vl

SIZES = ((45, 37), (20, 64))  # (height, width) of the prompt's images


@pytest.fixture(scope="module", params=["2", "2.5"])
def qwen2_vl(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_vl")
    return path, make_tiny_qwen2_vl(path, version=request.param)


def random_image(seed: int, size) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def _prompt(images: int) -> list[int]:
    """Text around `images` images, each one placeholder between the vision start and end."""
    ids = [1, 40, 41]
    for i in range(images):
        ids += [QWEN_START_ID, QWEN_IMAGE_ID, QWEN_END_ID, 50 + i, 51 + i]
    return ids + [60, 61]


@pytest.mark.parametrize("images", [0, 1, 2])
def test_logits_with_images_match_transformers(qwen2_vl, images):
    path, hf = qwen2_vl
    checkpoint, model, backend = float32_model(path)
    hf = copy.deepcopy(hf).double()

    image_input = media_inputs(checkpoint.config, checkpoint.processor_config)["image"]
    prepared: list[PreparedItem] = [
        image_input.prepare(random_image(i, SIZES[i])) for i in range(images)
    ]
    ids, media = expand(_prompt(images), [(image_input.spec, prepared)])
    assert [m.length for m in media] == [p.tokens for p in prepared]

    extra = {}
    ours_media = None
    if images:
        # The grids differ, so the two images' text shifts differ.
        assert len({item.grid for item in media}) == images
        encoded = model.encoders["image"].encode([item.data for item in media])
        at = torch.tensor([i for i, t in enumerate(ids) if t == QWEN_IMAGE_ID])
        grid = np.concatenate([mrope_positions(media, i) for i in range(images)], axis=1)
        ours_media = MediaEmbeds(at, torch.cat(encoded), torch.from_numpy(grid))
        extra = {
            "pixel_values": torch.from_numpy(np.concatenate([p.data[0] for p in prepared])),
            "image_grid_thw": torch.tensor([p.data[1] for p in prepared]),
        }
        extra["pixel_values"] = extra["pixel_values"].double()
    delta = int(mrope_shift(media, len(ids), 1)[0])

    def theirs(seq: list[int]) -> torch.Tensor:
        tensor = torch.tensor([seq])
        types = (tensor == QWEN_IMAGE_ID).int()
        with torch.no_grad():
            return hf(tensor, mm_token_type_ids=types, **extra).logits[0]

    shift = torch.from_numpy(mrope_shift(media, 0, len(ids)))
    assert_tracks(model, backend, ids, theirs, ours_media, shift, delta)

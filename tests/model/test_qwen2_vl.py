"""Qwen2-VL and Qwen2.5-VL against transformers on tiny random checkpoints (CPU): the decoder's
logits with 0, 1 and 2 images of different sizes, where M-RoPE gives image tokens 3-D positions
and shifts the text after each image, through a prefill and 8 decode steps."""

import copy

import numpy as np
import pytest
import torch
from PIL import Image

from inflight.model.attention import select_backend
from inflight.model.checkpoints.loader import build_model, open_checkpoint
from inflight.model.llama import MediaEmbeds
from inflight.runtime.media import PreparedItem, expand, mrope_positions, mrope_shift
from inflight.runtime.preprocessing import media_inputs

from helpers import PagedSequence
from tiny_models import QWEN_END_ID, QWEN_IMAGE_ID, QWEN_START_ID, make_tiny_qwen2_vl

TOL = 1e-4
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
    checkpoint = open_checkpoint(path)
    cpu = torch.device("cpu")
    model = build_model(checkpoint, torch.float32, cpu, 512, quantization="none")
    backend = select_backend(None, cpu, torch.float32, checkpoint.config.head_dim)
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
        encoded = model.image_encoder.encode([item.data for item in media])
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

    sequence = PagedSequence(model, backend, len(ids) + 8)
    shift = torch.from_numpy(mrope_shift(media, 0, len(ids)))
    ours = sequence.extend(ids, ours_media, shift)
    seq = list(ids)
    want = theirs(seq)
    assert (ours.double() - want).abs().max().item() < TOL
    for _ in range(8):
        seq.append(int(want[-1].argmax()))
        assert int(ours[-1].argmax()) == seq[-1]
        ours = sequence.extend(seq[-1:], shift=delta)
        want = theirs(seq)
        assert (ours[-1].double() - want[-1]).abs().max().item() < TOL

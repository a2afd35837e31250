"""LLaVA-style image input against transformers on tiny random checkpoints (CPU, float32): the
image preprocessing, the image encoder, and the decoder's logits with 0, 1 and 2 images."""

import copy

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor

from inflight.model.attention import select_backend
from inflight.model.checkpoints.loader import build_model, open_checkpoint
from inflight.model.contract import MediaEmbeds
from inflight.model.encoders.image_processor import ImageProcessor

from helpers import assert_tracks
from tiny_models import IMAGE_TOKEN_ID, make_tiny_llava

TOL = 1e-4
TOWERS = ("clip", "siglip")


@pytest.fixture(scope="module")
def llava_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava")
    return {tower: (root / tower, make_tiny_llava(root / tower, tower)) for tower in TOWERS}


def random_image(seed: int, size=(45, 37)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def _ours(path):
    checkpoint = open_checkpoint(path)
    cpu = torch.device("cpu")
    model = build_model(checkpoint, torch.float32, cpu, 256, quantization="none")
    backend = select_backend(None, cpu, torch.float32, checkpoint.config.head_dim)
    return checkpoint, model, backend


@pytest.mark.parametrize("tower", TOWERS)
def test_image_preprocessing_is_the_checkpoints_processor(llava_dirs, tower):
    path, _ = llava_dirs[tower]
    checkpoint = open_checkpoint(path)
    ours = ImageProcessor.from_config(checkpoint.processor_config, checkpoint.config.vision)
    theirs = AutoImageProcessor.from_pretrained(path)
    for seed, size in ((0, (45, 37)), (1, (20, 64)), (2, (32, 32))):
        image = random_image(seed, size)
        want = theirs(image, return_tensors="np")["pixel_values"][0]
        got = ours(image)
        assert got.shape == want.shape == (3, 32, 32)
        np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("tower", TOWERS)
def test_image_encoder_matches_transformers(llava_dirs, tower):
    path, hf = llava_dirs[tower]
    _, model, _ = _ours(path)
    pixels = torch.randn(2, 3, 32, 32)
    got = model.encoders["image"](pixels)
    with torch.no_grad():
        want = torch.stack(hf.model.get_image_features(pixel_values=pixels).pooler_output)
    assert got.shape == want.shape == (2, model.config.vision.tokens_per_image, 64)
    assert (got - want).abs().max().item() < 1e-5


def _prompt(images: int) -> list[int]:
    """Text tokens around `images` runs of 16 placeholders."""
    ids = [1, 40, 41, 42]
    for i in range(images):
        ids += [IMAGE_TOKEN_ID] * 16 + [50 + i, 51 + i]
    return ids + [60, 61]


def _embeds(model, ids, pixels):
    """Our decoder's `media` for a prompt: the image encoder's output over the placeholders."""
    at = torch.tensor([i for i, t in enumerate(ids) if t == IMAGE_TOKEN_ID])
    if not len(at):
        return None
    return MediaEmbeds(at, model.encoders["image"](pixels).reshape(-1, model.config.hidden_size))


@pytest.mark.parametrize("tower", TOWERS)
@pytest.mark.parametrize("images", [0, 1, 2])
def test_logits_with_images_match_transformers(llava_dirs, tower, images):
    """Prefill with the images' embeddings in place of their placeholders, then 8 decode
    steps: the logits of every position are within 1e-4 of HF's model computed in float64,
    and greedy picks agree."""
    path, hf = llava_dirs[tower]
    _, model, backend = _ours(path)
    hf = copy.deepcopy(hf).double()
    ids = _prompt(images)
    pixels = torch.randn(images, 3, 32, 32)
    extra = {"pixel_values": pixels.double()} if images else {}

    def theirs(seq: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([seq]), **extra).logits[0]

    assert_tracks(model, backend, ids, theirs, _embeds(model, ids, pixels), tol=TOL)


def test_a_checkpoint_tensor_without_a_place_is_refused(llava_dirs, tmp_path):
    path, _ = llava_dirs["clip"]
    checkpoint = open_checkpoint(path)
    weights = list(checkpoint.weights())
    weights.append(("model.vision_tower.encoder.extra.weight", torch.zeros(1)))
    checkpoint.source = type("Source", (), {"weights": lambda self: iter(weights)})()
    with pytest.raises(ValueError, match="has no place in the image encoder"):
        build_model(checkpoint, torch.float32, torch.device("cpu"), 64, quantization="none")


def test_the_llava_hf_naming_loads_the_same_model(llava_dirs):
    """Checkpoints converted by llava-hf name the tower's tensors `vision_tower.vision_model.*`
    (and may hold its positions' index buffer): they load into the same model."""
    path, _ = llava_dirs["clip"]
    checkpoint = open_checkpoint(path)
    renamed = [
        (name.replace("vision_tower.", "vision_tower.vision_model.", 1), tensor)
        for name, tensor in checkpoint.weights()
    ]
    renamed.append(("vision_tower.vision_model.embeddings.position_ids", torch.arange(17)[None]))
    checkpoint.source = type("Source", (), {"weights": lambda self: iter(renamed)})()
    cpu = torch.device("cpu")
    theirs = build_model(checkpoint, torch.float32, cpu, 64, quantization="none")
    _, ours, _ = _ours(path)
    pixels = torch.randn(1, 3, 32, 32)
    assert torch.equal(theirs.encoders["image"](pixels), ours.encoders["image"](pixels))

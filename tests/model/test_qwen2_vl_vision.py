"""Qwen2-VL and Qwen2.5-VL image input against transformers on tiny random towers (CPU,
float32): the config, the image preprocessing and the image encoder."""

import numpy as np
import pytest
import torch
import transformers as tf
from PIL import Image

from inflight.model.encoders.qwen2_vl import (
    Qwen2VLImageEncoder,
    merged_grid,
    qwen2_vl_vision_from_hf,
)
from inflight.model.encoders.qwen2_vl_processor import Qwen2VLImageProcessor

VOCAB = 320
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3]),
)
TOKENS = dict(
    image_token_id=VOCAB - 1,
    video_token_id=VOCAB - 2,
    vision_start_token_id=VOCAB - 3,
    vision_end_token_id=VOCAB - 4,
)
GEOMETRY = dict(patch_size=4, spatial_merge_size=2, temporal_patch_size=2)


def _randomize(module: torch.nn.Module) -> None:
    """Every parameter random (transformers starts norms at 1 and biases at 0)."""
    with torch.no_grad():
        for param in module.parameters():
            param.normal_(0, 0.2)


@pytest.fixture(scope="module")
def qwen2_vl():
    torch.manual_seed(0)
    config = tf.Qwen2VLConfig(
        text_config=TEXT,
        vision_config=dict(
            depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, **GEOMETRY
        ),
        **TOKENS,
    )
    model = tf.Qwen2VLForConditionalGeneration(config).eval()
    _randomize(model.model.visual)
    return model


@pytest.fixture(scope="module")
def qwen2_5_vl():
    torch.manual_seed(1)
    config = tf.Qwen2_5_VLConfig(
        text_config=TEXT,
        # Windows of 16 pixels: 2x2 merged tokens, so a 6x5 merged grid has 9, cut at the edges.
        vision_config=dict(
            depth=3,
            hidden_size=32,
            intermediate_size=48,
            num_heads=4,
            out_hidden_size=64,
            window_size=16,
            fullatt_block_indexes=[1],
            **GEOMETRY,
        ),
        **TOKENS,
    )
    model = tf.Qwen2_5_VLForConditionalGeneration(config).eval()
    _randomize(model.model.visual)
    return model


def _ours(hf) -> Qwen2VLImageEncoder:
    encoder = Qwen2VLImageEncoder(qwen2_vl_vision_from_hf(hf.config.to_dict()))
    encoder.load_weights(
        (name.removeprefix("model."), tensor)
        for name, tensor in hf.state_dict().items()
        if name.startswith("model.visual.")
    )
    return encoder


def _patches(grid, seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((int(np.prod(grid)), 3 * 2 * 4 * 4), dtype=np.float32)


def _theirs(hf, items):
    pixels = torch.from_numpy(np.concatenate([patches for patches, _ in items]))
    grids = torch.tensor([grid for _, grid in items])
    with torch.no_grad():
        return hf.model.get_image_features(pixels, grids).pooler_output


def _assert_encoder_matches(hf, grid_sets):
    ours = _ours(hf)
    for grids in grid_sets:
        items = [(_patches(grid, seed), grid) for seed, grid in enumerate(grids)]
        got, want = ours.encode(items), _theirs(hf, items)
        assert len(got) == len(want) == len(grids)
        for grid, g, w in zip(grids, got, want, strict=True):
            assert g.shape == w.shape == (np.prod(merged_grid(grid, 2)), 64)
            assert (g - w).abs().max().item() < 1e-5


def test_config_from_transformers_and_hub_layouts(qwen2_vl, qwen2_5_vl):
    two = qwen2_vl_vision_from_hf(qwen2_vl.config.to_dict())
    assert (two.family, two.embed_dim, two.intermediate_size, two.out_hidden_size) == (
        "qwen2_vl",
        32,
        64,
        64,
    )
    assert (two.image_token_id, two.vision_start_token_id, two.window_size) == (319, 317, None)
    five = qwen2_vl_vision_from_hf(qwen2_5_vl.config.to_dict())
    assert (five.family, five.embed_dim, five.intermediate_size, five.out_hidden_size) == (
        "qwen2_5_vl",
        32,
        48,
        64,
    )
    assert (five.window_size, five.fullatt_block_indexes, five.hidden_act) == (16, (1,), "silu")
    # Qwen2-VL-2B-Instruct's config.json: decoder fields at the top level, in_chans.
    hub = qwen2_vl_vision_from_hf(
        {
            "architectures": ["Qwen2VLForConditionalGeneration"],
            "hidden_size": 1536,
            "image_token_id": 151655,
            "vision_start_token_id": 151652,
            "vision_config": {
                "depth": 32,
                "embed_dim": 1280,
                "mlp_ratio": 4,
                "num_heads": 16,
                "in_chans": 3,
                "hidden_size": 1536,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
            },
        }
    )
    assert (hub.embed_dim, hub.intermediate_size, hub.out_hidden_size) == (1280, 5120, 1536)
    assert (hub.hidden_act, hub.patch_dim, hub.image_token_id) == ("quick_gelu", 1176, 151655)
    with pytest.raises(ValueError, match="not a Qwen2-VL config"):
        qwen2_vl_vision_from_hf({"architectures": ["LlavaForConditionalGeneration"]})


def _image(seed, width, height, mode="RGB"):
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode)


PROCESSOR_CONFIGS = [
    dict(patch_size=4, merge_size=2, temporal_patch_size=2),
    # The newer size form, with a budget that shrinks 64x96 and 100x50.
    dict(size={"shortest_edge": 1024, "longest_edge": 2048}, patch_size=4, merge_size=2),
    # The older form, winning over size.
    dict(min_pixels=4096, max_pixels=8192, size={"shortest_edge": 1, "longest_edge": 2}),
]


@pytest.mark.parametrize("config", PROCESSOR_CONFIGS)
def test_preprocessing_is_transformers(qwen2_vl, config):
    vision = qwen2_vl_vision_from_hf(qwen2_vl.config.to_dict())
    ours = Qwen2VLImageProcessor.from_config(config, vision)
    theirs = tf.Qwen2VLImageProcessorPil(**{"patch_size": 4, **config})
    # 30x30 is below min_pixels (scaled up); 100x50 rounds half to even (12.5 -> 12 blocks).
    images = [
        _image(0, 64, 96),
        _image(1, 100, 50),
        _image(2, 30, 30),
        _image(3, 41, 23, "RGBA"),
        _image(4, 37, 61, "L"),
    ]
    for image in images:
        want = theirs(image, return_tensors="np")
        patches, grid = ours(image)
        assert [list(grid)] == want["image_grid_thw"].tolist()
        assert patches.shape == want["pixel_values"].shape
        np.testing.assert_allclose(patches, want["pixel_values"], atol=1e-6, rtol=0)


def test_preprocessing_defaults_are_transformers():
    """{} is Hugging Face's processor: 14-pixel patches, 56*56 to 28*28*1280 pixels."""
    vision = qwen2_vl_vision_from_hf({"model_type": "qwen2_vl", "hidden_size": 64})
    ours = Qwen2VLImageProcessor.from_config({}, vision)
    assert (ours.min_pixels, ours.max_pixels, ours.factor) == (3136, 1003520, 28)
    image = _image(5, 96, 64)
    want = tf.Qwen2VLImageProcessorPil()(image, return_tensors="np")
    patches, grid = ours(image)
    assert [list(grid)] == want["image_grid_thw"].tolist() == [[1, 4, 6]]
    np.testing.assert_allclose(patches, want["pixel_values"], atol=1e-6, rtol=0)


def test_preprocessing_refuses_what_it_cannot_take(qwen2_vl):
    vision = qwen2_vl_vision_from_hf(qwen2_vl.config.to_dict())
    ours = Qwen2VLImageProcessor.from_config({}, vision)
    with pytest.raises(ValueError, match="must be a PIL image"):
        ours(np.zeros((8, 8, 3), np.uint8))
    with pytest.raises(ValueError, match="aspect ratio"):
        ours(_image(6, 402, 2))
    with pytest.raises(ValueError, match="patch_size 14 differs"):
        Qwen2VLImageProcessor.from_config({"patch_size": 14}, vision)


def test_qwen2_vl_encoder_matches_transformers(qwen2_vl):
    """One image, then in one call two images of different grids and a two-frame clip."""
    _assert_encoder_matches(qwen2_vl, [[(1, 6, 8)], [(1, 4, 6), (1, 8, 4), (2, 4, 4)]])


def test_qwen2_5_vl_encoder_matches_transformers(qwen2_5_vl):
    """Windows cut at the right and bottom edges (a 6x5 merged grid), windows that tile a
    grid exactly, several images and frames in one call."""
    _assert_encoder_matches(qwen2_5_vl, [[(1, 12, 10)], [(1, 12, 10), (2, 8, 8), (1, 2, 14)]])


def test_encoder_output_follows_the_processor(qwen2_vl):
    """Processed images go through encode in one call as each does alone."""
    vision = qwen2_vl_vision_from_hf(qwen2_vl.config.to_dict())
    processor = Qwen2VLImageProcessor.from_config({}, vision)
    encoder = _ours(qwen2_vl)
    items = [processor(_image(7, 64, 96)), processor(_image(8, 100, 50))]
    together = encoder.encode(items)
    for item, got in zip(items, together, strict=True):
        assert torch.allclose(encoder.encode([item])[0], got, atol=1e-6)
    with pytest.raises(ValueError, match="must be"):
        encoder.encode([(items[0][0][:-1], items[0][1])])


def test_load_weights_refuses_unknown_and_missing_tensors(qwen2_vl):
    encoder = Qwen2VLImageEncoder(qwen2_vl_vision_from_hf(qwen2_vl.config.to_dict()))
    weights = {
        name.removeprefix("model."): tensor
        for name, tensor in qwen2_vl.state_dict().items()
        if name.startswith("model.visual.")
    }
    with pytest.raises(ValueError, match="'visual.blocks.9.attn.qkv.weight' has no place"):
        encoder.load_weights(
            [*weights.items(), ("visual.blocks.9.attn.qkv.weight", torch.zeros(1))]
        )
    del weights["visual.merger.mlp.2.bias"]
    with pytest.raises(ValueError, match="lacks image encoder tensors.*merger.mlp.2.bias"):
        encoder.load_weights(weights.items())
    weights["visual.merger.mlp.2.bias"] = torch.zeros(3)
    with pytest.raises(ValueError, match="has shape"):
        encoder.load_weights(weights.items())

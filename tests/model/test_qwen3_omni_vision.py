"""Qwen3-Omni's image input against transformers on tiny random towers (CPU, float32): the
config, the image preprocessing, and the image encoder with its DeepStack features."""

import numpy as np
import pytest
import torch
import transformers as tf
from PIL import Image
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeVisionEncoder,
)

from inflight.model.encoders.qwen3_omni_vision import (
    Qwen3OmniImageEncoder,
    qwen3_omni_vision_from_hf,
)

IMAGE_TOKEN = 111
# The thinker's tower of the wave-3 tiny Qwen3-Omni (omni_tiny.py).
TINY = dict(
    depth=1,
    hidden_size=32,
    out_hidden_size=64,
    intermediate_size=32,
    num_heads=4,
    patch_size=16,
    spatial_merge_size=1,
    temporal_patch_size=2,
    deepstack_visual_indexes=[0],
)
DEEP = {**TINY, "depth": 3, "spatial_merge_size": 2, "deepstack_visual_indexes": [0, 2]}
# A 4x4 position table, smaller than the grids (resampled down as well as up), and DeepStack
# blocks listed out of order (merger 0 serves block 2, yet block 0's feature comes first).
SMALL_TABLE = {**DEEP, "num_position_embeddings": 16, "deepstack_visual_indexes": [2, 0]}
# Qwen/Qwen3-Omni-30B-A3B-Instruct's preprocessor_config.json, its image part.
OMNI_PREPROCESSOR = dict(
    patch_size=16,
    temporal_patch_size=2,
    merge_size=2,
    min_pixels=3136,
    max_pixels=12845056,
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
)
TOLERANCE = 1e-5


def _hf(vision: dict, seed: int) -> Qwen3OmniMoeVisionEncoder:
    torch.manual_seed(seed)
    config = tf.Qwen3OmniMoeConfig(
        thinker_config=dict(vision_config=vision, image_token_id=IMAGE_TOKEN)
    )
    model = Qwen3OmniMoeVisionEncoder(config.thinker_config.vision_config).eval()
    # Every parameter random (transformers starts norms at 1 and biases at 0).
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
    return model


def _thinker_dict(hf: Qwen3OmniMoeVisionEncoder) -> dict:
    return {"vision_config": hf.config.to_dict(), "image_token_id": IMAGE_TOKEN}


def _ours(hf: Qwen3OmniMoeVisionEncoder) -> Qwen3OmniImageEncoder:
    config = qwen3_omni_vision_from_hf(_thinker_dict(hf))
    encoder = config.build(config.out_hidden_size)
    encoder.load_weights(("visual." + name, t) for name, t in hf.state_dict().items())
    return encoder


@pytest.fixture(scope="module", params=["tiny", "deep", "small_table"])
def towers(request):
    vision = {"tiny": TINY, "deep": DEEP, "small_table": SMALL_TABLE}[request.param]
    hf = _hf(vision, seed=len(request.param))
    return hf, _ours(hf)


def _patches(grid, seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((int(np.prod(grid)), 3 * 2 * 16 * 16), dtype=np.float32)


def _theirs(hf, items):
    pixels = torch.from_numpy(np.concatenate([np.asarray(p, np.float32) for p, _ in items]))
    grids = torch.tensor([list(grid) for _, grid in items])
    with torch.no_grad():
        out = hf(pixels, grid_thw=grids)
    counts = (grids.prod(-1) // hf.config.spatial_merge_size**2).tolist()
    merged = out.pooler_output.split(counts)
    deepstack = torch.stack(list(out.deepstack_features)).split(counts, dim=1)
    return list(zip(merged, deepstack, strict=True))


def _assert_matches(hf, ours, items) -> tuple[float, float]:
    """Our embeddings and DeepStack features against transformers': their largest differences."""
    got, want = ours.encode_deepstack(items), _theirs(hf, items)
    assert len(got) == len(want) == len(items)
    worst_merged = worst_deepstack = 0.0
    depth = len(hf.config.deepstack_visual_indexes)
    for (g, g_deep), (w, w_deep) in zip(got, want, strict=True):
        assert g.shape == w.shape and g.shape[1] == 64
        assert g_deep.shape == w_deep.shape == (depth, *g.shape)
        worst_merged = max(worst_merged, (g - w).abs().max().item())
        worst_deepstack = max(worst_deepstack, (g_deep - w_deep).abs().max().item())
    assert worst_merged <= TOLERANCE and worst_deepstack <= TOLERANCE
    return worst_merged, worst_deepstack


def _grid_sets(merge):
    """One image; two of different sizes (one a single row or a 2-patch-high strip); a
    two-frame clip with an image."""
    if merge == 1:
        return [[(1, 6, 8)], [(1, 5, 3), (1, 1, 7)], [(2, 4, 4), (1, 3, 9)]]
    return [[(1, 6, 8)], [(1, 4, 10), (1, 2, 6)], [(2, 4, 4), (1, 8, 2)]]


def test_encoder_matches_transformers(towers):
    hf, ours = towers
    diffs = []
    for grids in _grid_sets(hf.config.spatial_merge_size):
        items = [(_patches(grid, seed), grid) for seed, grid in enumerate(grids)]
        diffs.append(_assert_matches(hf, ours, items))
    merged, deepstack = (max(d) for d in zip(*diffs, strict=True))
    print(f"max |ours - transformers|: embeddings {merged:.2e}, deepstack {deepstack:.2e}")


def test_images_of_one_call_do_not_see_each_other(towers):
    _, ours = towers
    merge = ours.config.spatial_merge_size
    items = [(_patches(grid, seed), grid) for seed, grid in enumerate(_grid_sets(merge)[1])]
    together = ours.encode_deepstack(items)
    plain = ours.encode(items)
    for item, (merged, deepstack), alone in zip(items, together, plain, strict=True):
        single, single_deepstack = ours.encode_deepstack([item])[0]
        assert torch.allclose(single, merged, atol=1e-6)
        assert torch.allclose(single_deepstack, deepstack, atol=1e-6)
        assert torch.equal(alone, merged)
    assert ours.encode([]) == ours.encode_deepstack([]) == []
    with pytest.raises(ValueError, match="must be"):
        ours.encode([(items[0][0][:-1], items[0][1])])


def test_config_from_thinker_config():
    hf = _hf(SMALL_TABLE, seed=0)
    config = qwen3_omni_vision_from_hf(_thinker_dict(hf))
    assert (config.depth, config.hidden_size, config.intermediate_size, config.num_heads) == (
        3,
        32,
        32,
        4,
    )
    assert (config.out_hidden_size, config.spatial_merge_size, config.patch_dim) == (64, 2, 1536)
    assert (config.num_position_embeddings, config.position_side) == (16, 4)
    assert config.deepstack_visual_indexes == (2, 0)
    assert (config.kind, config.placeholder, config.rope_theta) == ("image", IMAGE_TOKEN, 1e4)
    # What a thinker_config leaves out is transformers' default (the 30B-A3B tower).
    default = qwen3_omni_vision_from_hf({})
    theirs = tf.Qwen3OmniMoeConfig().thinker_config
    vision = theirs.vision_config
    assert (default.depth, default.hidden_size, default.intermediate_size) == (
        vision.depth,
        vision.hidden_size,
        vision.intermediate_size,
    )
    assert (default.out_hidden_size, default.hidden_act, default.placeholder) == (
        vision.out_hidden_size,
        vision.hidden_act,
        theirs.image_token_id,
    )
    assert list(default.deepstack_visual_indexes) == list(vision.deepstack_visual_indexes)
    assert default.num_position_embeddings == vision.num_position_embeddings == 48 * 48
    with pytest.raises(ValueError, match="deepstack_visual_indexes"):
        qwen3_omni_vision_from_hf({"vision_config": {**TINY, "deepstack_visual_indexes": [1]}})
    with pytest.raises(ValueError, match="decoder 48 wide"):
        config.build(48)


def test_load_weights_refuses_unknown_and_missing_tensors():
    hf = _hf(DEEP, seed=1)
    encoder = qwen3_omni_vision_from_hf(_thinker_dict(hf)).build(64)
    weights = {"visual." + name: t for name, t in hf.state_dict().items()}
    with pytest.raises(ValueError, match="'visual.merger_list.2.ln_q.weight' has no place"):
        encoder.load_weights(
            [*weights.items(), ("visual.merger_list.2.ln_q.weight", torch.ones(1))]
        )
    # Named below thinker.visual but without the `visual.` level.
    with pytest.raises(ValueError, match="'pos_embed.weight' has no place"):
        encoder.load_weights([("pos_embed.weight", weights["visual.pos_embed.weight"])])
    del weights["visual.pos_embed.weight"]
    with pytest.raises(ValueError, match="lacks image encoder tensors.*pos_embed"):
        encoder.load_weights(weights.items())


def _image(seed, width, height, mode="RGB"):
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4}[mode]
    return Image.fromarray(rng.integers(0, 256, (height, width, channels), dtype=np.uint8), mode)


@pytest.mark.parametrize(
    "vision, processor",
    [
        (DEEP, OMNI_PREPROCESSOR),
        (DEEP, {}),  # none given: Qwen3-Omni's own
        (DEEP, {**OMNI_PREPROCESSOR, "max_pixels": 8192}),  # 100x90 shrinks
        (TINY, {}),  # the tower's geometry: 16-pixel patches, no merge
    ],
)
def test_preparer_is_transformers(vision, processor):
    hf = _hf(vision, seed=2)
    config = qwen3_omni_vision_from_hf(_thinker_dict(hf))
    prepare = config.preparer(processor)
    merge = config.spatial_merge_size
    theirs = tf.Qwen2VLImageProcessorPil(**{**OMNI_PREPROCESSOR, **processor, "merge_size": merge})
    # 30x40 is below min_pixels (scaled up); 100x90 and the RGBA one are not multiples of 32.
    images = [_image(0, 100, 90), _image(1, 30, 40), _image(2, 47, 71, "RGBA")]
    items = []
    for image in images:
        want = theirs(image, return_tensors="np")
        item = prepare(image)
        patches, grid = item.data
        assert [list(grid)] == want["image_grid_thw"].tolist()
        np.testing.assert_allclose(patches, want["pixel_values"], atol=1e-6, rtol=0)
        # As many <|image_pad|> tokens as the processor puts in the prompt, on the merged grid.
        t, h, w = grid
        assert item.grid == (t, h // merge, w // merge)
        assert item.tokens == int(want["image_grid_thw"].prod()) // merge**2
        items.append(item.data)
    _assert_matches(hf, _ours(hf), items)

"""DiffusionGemma's image input against transformers on tiny random towers (CPU, float32): the
config, Gemma-4's image preprocessing, and the vision tower with its embedder, loaded from the
checkpoint's tensor names."""

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

from inflight.model.encoders.gemma4_image_processor import patch_positions
from inflight.model.encoders.gemma4_vision import Gemma4ImageEncoder, gemma4_vision_from_hf

from diffusion_reference import config_dict

TEXT_HIDDEN = config_dict()["text_config"]["hidden_size"]
# diffusion_reference's tower: one layer, 16-pixel patches pooled 3x3.
TINY = config_dict()["vision_config"]
# Two layers, grouped-query attention with heads narrower than hidden / heads, 2x2 pooling, a
# small position table, and the clipped linears and standardization the big towers may use.
WIDE = dict(
    model_type="gemma4_vision",
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    pooling_kernel_size=2,
    position_embedding_size=1024,
    use_clipped_linears=True,
    standardize=True,
)
TOLERANCE = 1e-5
VISION_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")


def _reference(vision: dict, seed: int) -> DiffusionGemmaForBlockDiffusion:
    """transformers' model with every vision parameter and buffer random (it starts the norms
    and the position table at 1, the clip bounds at +-inf)."""
    torch.manual_seed(seed)
    config = DiffusionGemmaConfig(**{**config_dict(), "vision_config": vision})
    model = DiffusionGemmaForBlockDiffusion(config).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if not name.startswith(VISION_PREFIXES):
                continue
            if name.endswith(("input_min", "output_min")):
                tensor.fill_(-0.4)
            elif name.endswith(("input_max", "output_max")):
                tensor.fill_(0.4)
            else:
                tensor.normal_(0, 0.5)
    return model


def _weights(model: DiffusionGemmaForBlockDiffusion) -> list[tuple[str, torch.Tensor]]:
    """The vision tensors under the names save_pretrained writes (the state dict's)."""
    return [(n, t) for n, t in model.state_dict().items() if n.startswith(VISION_PREFIXES)]


def _ours(model: DiffusionGemmaForBlockDiffusion) -> Gemma4ImageEncoder:
    config = gemma4_vision_from_hf(model.config.to_dict())
    # As the loader builds it: on the meta device, then materialized empty.
    with torch.device("meta"):
        encoder = config.build(TEXT_HIDDEN)
    encoder = encoder.to_empty(device="cpu")
    encoder.load_weights(_weights(model))
    return encoder.eval()


@pytest.fixture(scope="module", params=["tiny", "wide"])
def towers(request):
    model = _reference({"tiny": TINY, "wide": WIDE}[request.param], seed=len(request.param))
    return model, _ours(model)


def _image(seed: int, width: int, height: int, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4}[mode]
    return Image.fromarray(rng.integers(0, 256, (height, width, channels), dtype=np.uint8), mode)


# Scaled up (and not a multiple of a block), a transparent one, a strip so thin that its short
# side rounds to no block at all, and a square one (kept as it is under 70 soft tokens with 3x3
# pooling, scaled down under 70 with 2x2, up under 280).
IMAGES = [
    _image(0, 100, 90),
    _image(1, 47, 71, "RGBA"),
    _image(2, 3000, 5),
    _image(3, 384, 384),
]
PROCESSORS = [{}, {"max_soft_tokens": 70}]


def _theirs_processor(config, processor: dict) -> Gemma4ImageProcessorPil:
    return Gemma4ImageProcessorPil(
        **{
            "patch_size": config.patch_size,
            "pooling_kernel_size": config.pooling_kernel_size,
            **processor,
        }
    )


@pytest.mark.parametrize("processor", PROCESSORS)
def test_encoder_and_preparer_match_transformers(towers, processor):
    model, ours = towers
    config = ours.config
    prepare = config.preparer({**processor, "pooling_kernel_size": config.pooling_kernel_size})
    want = _theirs_processor(config, processor)(IMAGES, return_tensors="np")
    items = []
    worst_pixels = 0.0
    for i, image in enumerate(IMAGES):
        item = prepare(image)
        patches, (rows, cols) = item.data
        n = rows * cols
        assert (
            item.tokens
            == want["num_soft_tokens_per_image"][i]
            == n // config.pooling_kernel_size**2
        )
        np.testing.assert_array_equal(
            want["image_position_ids"][i, :n], patch_positions(rows, cols)
        )
        assert (want["image_position_ids"][i, n:] == -1).all()
        worst_pixels = max(worst_pixels, np.abs(patches - want["pixel_values"][i, :n]).max())
        items.append(item.data)
    assert worst_pixels <= 1e-6

    got = ours.encode(items)
    with torch.no_grad():
        theirs = model.model.encoder.get_image_features(
            torch.from_numpy(want["pixel_values"]), torch.from_numpy(want["image_position_ids"])
        ).pooler_output
    assert [g.shape for g in got] == [(t, TEXT_HIDDEN) for t in want["num_soft_tokens_per_image"]]
    worst = (torch.cat(got) - theirs).abs().max().item()
    assert worst <= TOLERANCE
    print(f"max |ours - transformers|: pixels {worst_pixels:.2e}, embeddings {worst:.2e}")
    # One image alone is what it is among others: attention stays within an image.
    alone = ours.encode([items[1]])[0]
    assert torch.allclose(alone, got[1], atol=1e-6)


def test_clip_bounds_and_standardization_take_effect():
    """The wide tower's bounds and standardization change its output, so the parity test above
    checks them."""
    ours = _ours(_reference(WIDE, seed=5))
    item = ours.config.preparer({"max_soft_tokens": 70, "pooling_kernel_size": 2})(IMAGES[0]).data
    clipped = ours.encode([item])[0]
    with torch.no_grad():
        for name, buffer in ours.named_buffers():
            if name.endswith("_min"):
                buffer.fill_(-float("inf"))
            elif name.endswith("_max"):
                buffer.fill_(float("inf"))
        unclipped = ours.encode([item])[0]
        ours.vision_tower.std_bias.zero_()
        ours.vision_tower.std_scale.fill_(1.0)
        plain = ours.encode([item])[0]
    assert not torch.allclose(clipped, unclipped, atol=1e-3)
    assert not torch.allclose(unclipped, plain, atol=1e-3)


def test_config_from_hf():
    hf = _reference(WIDE, seed=0).config.to_dict()
    config = gemma4_vision_from_hf(hf)
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (2, 48, 96)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 8)
    assert (config.pooling_kernel_size, config.patch_size, config.position_embedding_size) == (
        2,
        16,
        1024,
    )
    assert (config.rope_theta, config.use_clipped_linears, config.standardize) == (100, True, True)
    assert (config.kind, config.placeholder) == ("image", hf["image_token_id"])
    assert config.bounds == ((hf["boi_token_id"],), (hf["eoi_token_id"],))
    assert gemma4_vision_from_hf({k: v for k, v in hf.items() if k != "vision_config"}) is None
    # What a vision_config leaves out is transformers' default tower.
    default = gemma4_vision_from_hf({"vision_config": {"model_type": "gemma4_vision"}})
    theirs = DiffusionGemmaConfig().vision_config
    assert (default.num_layers, default.hidden_size, default.head_dim) == (
        theirs.num_hidden_layers,
        theirs.hidden_size,
        theirs.head_dim,
    )
    assert (default.position_embedding_size, default.rope_theta) == (
        theirs.position_embedding_size,
        theirs.rope_parameters["rope_theta"],
    )
    assert default.placeholder == DiffusionGemmaConfig().image_token_id
    rope = {"rope_type": "default", "rope_theta": 100.0}
    with pytest.raises(ValueError, match="rope_type 'default'"):
        gemma4_vision_from_hf({"vision_config": {**WIDE, "rope_parameters": rope}})
    with pytest.raises(ValueError, match="multiple of num_key_value_heads 3"):
        gemma4_vision_from_hf({"vision_config": {**WIDE, "num_key_value_heads": 3}})


def test_preparer_refuses_what_transformers_refuses():
    config = gemma4_vision_from_hf({"vision_config": TINY})
    with pytest.raises(ValueError, match="max_soft_tokens must be one of"):
        config.preparer({"max_soft_tokens": 100})
    with pytest.raises(ValueError, match="pooling_kernel_size 2 differs"):
        config.preparer({"pooling_kernel_size": 2})
    # A processor_config.json's image processor part is read as well.
    nested = config.preparer({"image_processor": {"max_soft_tokens": 70}})
    assert nested(IMAGES[0]).tokens <= 70 < config.preparer({})(IMAGES[0]).tokens
    with pytest.raises(ValueError, match="multiples of 48"):
        config.preparer({"do_resize": False})(IMAGES[0])
    with pytest.raises(ValueError, match="PIL image"):
        config.preparer({})(np.zeros((48, 48, 3), np.uint8))


def test_load_weights_refuses_unknown_and_missing_tensors():
    model = _reference(TINY, seed=1)
    encoder = gemma4_vision_from_hf(model.config.to_dict()).build(TEXT_HIDDEN)
    weights = dict(_weights(model))
    table = "model.encoder.vision_tower.patch_embedder.position_embedding_table"
    extra = "model.encoder.vision_tower.encoder.layers.1.input_layernorm.weight"
    with pytest.raises(ValueError, match=f"'{extra}' has no place"):
        encoder.load_weights([*weights.items(), (extra, torch.ones(32))])
    # Without the model.encoder. level, as a Gemma-4 (not DiffusionGemma) checkpoint names it.
    with pytest.raises(ValueError, match="'vision_tower.patch_embedder.position_embedding_table'"):
        encoder.load_weights(
            [("vision_tower.patch_embedder.position_embedding_table", torch.ones(1))]
        )
    del weights[table]
    with pytest.raises(ValueError, match="lacks image encoder tensors.*position_embedding_table"):
        encoder.load_weights(weights.items())

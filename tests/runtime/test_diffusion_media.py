"""Images in a block-diffusion model's prompt (a tiny random DiffusionGemma with its Gemma-4
vision tower) against transformers' `generate()` under the same seed: the prompt expanded as
transformers' processor expands it (begin-of-image, the image's soft tokens, end-of-image), the
image's embeddings in place of its tokens, encoded in chunks, beside text requests; and, where
the model lets an image's tokens attend both ways, each image encoded in one chunk."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from inflight import LLM
from inflight.protocol.request import DiffusionParams, RequestFieldError, SamplingParams

from diffusion_reference import CANVAS, config_dict, write_tiny_checkpoint

STEPS = 4
SOFT_TOKENS = 70  # the image processor's budget: a small image, a short prompt
BEFORE, AFTER = [5, 6, 7], [8, 9, 10, 11]


def image(seed: int, height: int, width: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


IMAGES = [image(0, 100, 90), image(1, 60, 120)]


def checkpoint(path, bidirectional: bool):
    shape = config_dict()
    if bidirectional:
        shape["text_config"]["use_bidirectional_attention"] = "vision"
    reference = write_tiny_checkpoint(path, config=shape)
    (path / "preprocessor_config.json").write_text(json.dumps({"max_soft_tokens": SOFT_TOKENS}))
    return reference


def theirs(reference, pictures, seed: int, bidirectional: bool) -> tuple[list[int], list[int]]:
    """transformers' prompt ids and new tokens for BEFORE <image>... AFTER."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    config = reference.config
    processed = Gemma4ImageProcessorPil(max_soft_tokens=SOFT_TOKENS)(pictures, return_tensors="pt")
    ids = list(BEFORE)
    for n in processed["num_soft_tokens_per_image"]:
        ids += [config.boi_token_id, *[config.image_token_id] * int(n), config.eoi_token_id]
    ids += AFTER
    extra = {}
    if bidirectional:
        extra["mm_token_type_ids"] = (torch.tensor([ids]) == config.image_token_id).long()
    torch.manual_seed(seed)
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([ids]),
            pixel_values=processed["pixel_values"],
            image_position_ids=processed["image_position_ids"],
            max_new_tokens=2 * CANVAS,
            max_denoising_steps=STEPS,
            eos_token_id=None,
            **extra,
        )
    return ids, out.sequences[0, len(ids) :].tolist()


def prompt(reference, pictures) -> dict:
    placeholders = [reference.config.image_token_id] * len(pictures)
    return {
        "prompt_token_ids": BEFORE + placeholders + AFTER,
        "multi_modal_data": {"image": pictures},
    }


@pytest.mark.parametrize("bidirectional", [False, True])
def test_images_in_the_prompt_are_transformers_generate_token_for_token(tmp_path, bidirectional):
    reference = checkpoint(tmp_path, bidirectional)
    # 80 tokens a step, a canvas counted: the prompt of two images (122 tokens) is encoded
    # over two steps, the second image split between them unless its tokens attend both
    # ways (then the first step ends before it), beside a text request.
    with LLM(
        str(tmp_path), enable_in_flight_batching=True, max_model_len=256, max_num_tokens=80
    ) as llm:
        diffusion = DiffusionParams(max_denoising_steps=STEPS)
        params = SamplingParams(max_tokens=2 * CANVAS, seed=3)
        for pictures in ([IMAGES[0]], IMAGES):
            want_ids, want = theirs(reference, pictures, 3, bidirectional)
            request = llm.prepare(prompt(reference, pictures), params, diffusion=diffusion)
            assert list(request.prompt_token_ids) == want_ids
            text = {"prompt_token_ids": BEFORE + AFTER}
            outs = llm.generate([prompt(reference, pictures), text], params, diffusion=diffusion)
            assert list(outs[0].outputs[0].token_ids) == want
        # The first image, asked a second time, came from the encoder cache.
        assert llm.get_encoder_metrics()["encoder_runs"] == 2
        assert llm.get_encoder_metrics()["encoder_cache_hits"] == 1


def test_an_image_that_cannot_be_encoded_in_one_step_is_refused_where_it_must_be(tmp_path):
    reference = checkpoint(tmp_path, bidirectional=True)
    refused = pytest.raises(RequestFieldError, match="max_num_tokens")
    with LLM(str(tmp_path), max_model_len=256, max_num_tokens=32) as llm, refused as err:
        llm.prepare(prompt(reference, [IMAGES[0]]), SamplingParams(max_tokens=CANVAS))
    assert err.value.field == "multi_modal_data"

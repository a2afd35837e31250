"""Qwen2-VL (M-RoPE) and Voxtral (audio) through the runtime (tiny random checkpoints, CPU,
float32): greedy output equal to transformers' with prompts chunked across their images, rows
with and without media sharing steps as they run alone, the visual-token pruner on M-RoPE
positions, and the encoder cache for audio."""

import numpy as np
import pytest
import torch
from PIL import Image

from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.request import GenerationRequest, SamplingParams
from inflight.runtime.runtime import Runtime

from helpers import assert_no_leaks, assert_same_outputs, run_staggered, watch_media_prefills
from tiny_models import (
    AUDIO_TOKEN_ID,
    QWEN_END_ID,
    QWEN_IMAGE_ID,
    QWEN_START_ID,
    make_tiny_qwen2_vl,
    make_tiny_voxtral,
)

CONFIG = dict(max_batch_size=4, max_model_len=256, block_size=8, enable_context_reuse=False)
# Prefill chunks of 16 tokens: an image's tokens and the text after it are split across steps.
# (Rows share steps without chunking: on the CPU a prompt prefilled in other chunks than alone
# may differ in the last bits of its logprobs, media or not.)
CHUNKED = dict(CONFIG, max_num_tokens=16)


def image(seed: int, size=(45, 37)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def tone(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    wave = 0.3 * np.sin(2 * np.pi * (200 + 150 * seed) * t) + 0.05 * rng.standard_normal(t.size)
    return wave.astype(np.float32)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_vl")
    return path, make_tiny_qwen2_vl(path)


@pytest.fixture(scope="module")
def voxtral(tmp_path_factory):
    path = tmp_path_factory.mktemp("voxtral")
    return path, make_tiny_voxtral(path)


def _request(runtime, text_ids, data=None, max_tokens=12, kwargs=None, **params):
    ids, media = runtime.input_processor.expand_media(text_ids, data or {}, kwargs)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **params)
    return GenerationRequest(ids, params, media=media)


def _alone(runtime, request):
    return runtime.handle_request(request).result()


VISION = [QWEN_START_ID, QWEN_IMAGE_ID, QWEN_END_ID]
ONE_IMAGE = [1, 40, *VISION, 41, 42, 43]
TWO_IMAGES = [1, 44, *VISION, 45, *VISION, 46, 47]
TEXT = [1, 48, 49, 50, 51, 52, 53, 54]
ONE_CLIP = [1, 40, AUDIO_TOKEN_ID, 41, 42]
TWO_CLIPS = [1, 44, AUDIO_TOKEN_ID, 45, AUDIO_TOKEN_ID, 46]


def _hf_greedy(hf, prompt: list[int], n: int, inputs) -> tuple[int, ...]:
    """HF's greedy tokens, `inputs(seq)` its media arguments for the sequence so far."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([seq]), **inputs(seq)).logits[0, -1]
            seq.append(int(logits.argmax()))
    return tuple(seq[len(prompt) :])


def test_qwen2_vl_greedy_is_transformers_greedy(qwen):
    path, hf = qwen
    runtime = Runtime(path, DeploymentOptions(**CHUNKED))
    for text_ids, images in (
        (ONE_IMAGE, [image(0)]),
        (TWO_IMAGES, [image(1, (20, 64)), image(2, (64, 30))]),
    ):
        request = _request(runtime, text_ids, {"image": images}, max_tokens=16)
        assert len(request.prompt_token_ids) > 16  # prefilled in chunks
        got = _alone(runtime, request).token_ids
        pixels = torch.from_numpy(np.concatenate([m.data[0] for m in request.media]))
        grids = torch.tensor([m.data[1] for m in request.media])

        def inputs(seq, pixels=pixels, grids=grids):
            types = (torch.tensor([seq]) == QWEN_IMAGE_ID).int()
            return dict(pixel_values=pixels, image_grid_thw=grids, mm_token_type_ids=types)

        assert got == _hf_greedy(hf, list(request.prompt_token_ids), 16, inputs)
    assert_no_leaks(runtime)


def test_qwen2_vl_rows_share_steps_as_they_run_alone(qwen, monkeypatch):
    """Image, pruned-image and text requests join a running batch every other step, their
    prefills sharing steps with rows already decoding: each row's greedy tokens and logprobs
    are those of its run alone."""
    runtime = Runtime(qwen[0], DeploymentOptions(**CONFIG))
    requests = [
        _request(runtime, TEXT, logprobs=2),
        _request(runtime, ONE_IMAGE, {"image": [image(3)]}, logprobs=2),
        _request(runtime, TWO_IMAGES, {"image": [image(4), image(5, (30, 60))]}, logprobs=2),
        _request(runtime, ONE_IMAGE, {"image": [image(6)]}, kwargs={"keep_ratio": 0.5}),
        _request(runtime, TEXT[:5], logprobs=2),
    ]
    pruned = requests[3].media[0]
    assert pruned.length == round(pruned.tokens * 0.5) < pruned.tokens
    alone = [_alone(runtime, r) for r in requests]
    mixed = watch_media_prefills(runtime, monkeypatch)
    together = run_staggered(runtime, requests)
    assert any(mixed)  # an image prefill joined rows already decoding
    assert_same_outputs(together, alone)
    assert_no_leaks(runtime)


def test_voxtral_greedy_is_transformers_greedy(voxtral):
    path, hf = voxtral
    runtime = Runtime(path, DeploymentOptions(**CHUNKED))
    for text_ids, clips in ((ONE_CLIP, [tone(0.6, 0)]), (TWO_CLIPS, [tone(1.5, 1), tone(0.4, 2)])):
        request = _request(runtime, text_ids, {"audio": clips}, max_tokens=16)
        got = _alone(runtime, request).token_ids
        features = torch.from_numpy(np.concatenate([m.data for m in request.media]))
        want = _hf_greedy(
            hf,
            list(request.prompt_token_ids),
            16,
            lambda seq, features=features: {"input_features": features},
        )
        assert got == want
    assert_no_leaks(runtime)


def test_voxtral_rows_share_steps_and_a_repeated_clip_is_not_encoded_again(voxtral):
    runtime = Runtime(voxtral[0], DeploymentOptions(**CONFIG))
    metrics = runtime.encoder_cache.snapshot
    clip = tone(0.8, 3)
    requests = [
        _request(runtime, TEXT, logprobs=2),
        _request(runtime, ONE_CLIP, {"audio": [clip]}, logprobs=2),
        _request(runtime, TWO_CLIPS, {"audio": [tone(1.2, 4), (tone(0.5, 5), 16000)]}),
    ]
    alone = [_alone(runtime, r) for r in requests]
    runs = metrics()["encoder_runs"]
    together = run_staggered(runtime, requests)
    assert_same_outputs(together, alone)
    # Every clip came from the encoder cache the second time.
    assert metrics()["encoder_runs"] == runs
    # The same clip at 8 kHz is resampled to other samples: a new encoder run.
    eight = tone(0.8, 3)[::2]
    _alone(runtime, _request(runtime, ONE_CLIP, {"audio": [(eight, 8000)]}))
    assert metrics()["encoder_runs"] == runs + 1
    assert_no_leaks(runtime)


def test_qwen2_vl_reuses_a_cached_prefix_with_its_image_and_shift(qwen):
    """A prompt whose cached prefix holds an image: the text computed after it takes the
    image's M-RoPE shift from the request, and the answer is the one computed from scratch."""
    path, _ = qwen
    cached = Runtime(path, DeploymentOptions(**dict(CONFIG, enable_context_reuse=True)))
    fresh = Runtime(path, DeploymentOptions(**CONFIG))
    text = [1, 60, 61, 62, *VISION, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81]
    picture = image(11, (40, 60))
    first = _alone(cached, _request(cached, text, {"image": [picture]}))
    again = _alone(cached, _request(cached, text, {"image": [picture]}))
    want = _alone(fresh, _request(fresh, text, {"image": [picture]}))
    image_end = 4 + 1 + _request(cached, text, {"image": [picture]}).media[0].length
    assert again.cached_tokens >= image_end  # the image's tokens came from the cache
    assert first.token_ids == again.token_ids == want.token_ids
    assert_no_leaks(cached)

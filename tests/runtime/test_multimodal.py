"""Image input through the runtime (tiny random LLaVA, CPU, float32): greedy output equal to
transformers', rows with and without images sharing steps as they run alone, the encoder cache,
and the context cache keyed by image content."""

import numpy as np
import pytest
import torch
from PIL import Image

from inflight.model.encoders.vision import ImageEncoder
from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.outputs import FinishReason
from inflight.protocol.request import GenerationRequest, RequestFieldError, SamplingParams
from inflight.runtime.runtime import Runtime

from helpers import assert_no_leaks, assert_same_outputs, run_staggered, watch_media_prefills
from tiny_models import IMAGE_TOKEN_ID


def image(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (40 + seed, 36, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def runtime(tiny_llava):
    path, _ = tiny_llava
    config = DeploymentOptions(
        max_batch_size=4, max_model_len=256, block_size=8, enable_context_reuse=False
    )
    return Runtime(path, config)


def _request(runtime, text_ids, images=(), max_tokens=12, **params):
    ids, media = runtime.input_processor.expand_media(
        text_ids, {"image": list(images)} if images else {}
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **params)
    return GenerationRequest(ids, params, media=media)


def _alone(runtime, request):
    return runtime.handle_request(request).result()


ONE = [1, 40, IMAGE_TOKEN_ID, 41, 42, 43]
TWO = [1, 44, IMAGE_TOKEN_ID, 45, IMAGE_TOKEN_ID, 46, 47]
TEXT = [1, 48, 49, 50, 51, 52, 53, 54]


def test_greedy_with_images_is_transformers_greedy(runtime, tiny_llava):
    _, hf = tiny_llava
    for text_ids, images in ((ONE, [image(0)]), (TWO, [image(1), image(2)])):
        request = _request(runtime, text_ids, images, max_tokens=16)
        got = _alone(runtime, request).token_ids
        pixels = torch.from_numpy(np.stack([m.data for m in request.media]))
        seq = list(request.prompt_token_ids)
        with torch.no_grad():
            for _ in range(16):
                logits = hf(torch.tensor([seq]), pixel_values=pixels).logits[0, -1]
                seq.append(int(logits.argmax()))
        assert got == tuple(seq[len(request.prompt_token_ids) :])
    assert_no_leaks(runtime)


def test_rows_with_and_without_images_share_steps_as_they_run_alone(runtime, monkeypatch):
    """Image and text requests join a running batch every other step: each row's greedy tokens
    and logprobs are those of its run alone, and steps mixed prefill with images and decode
    rows."""
    requests = [
        _request(runtime, TEXT, logprobs=2),
        _request(runtime, ONE, [image(3)], logprobs=2),
        _request(runtime, TWO, [image(4), image(5)], logprobs=2),
        _request(runtime, TEXT[:5], logprobs=2),
    ]
    alone = [_alone(runtime, r) for r in requests]
    mixed = watch_media_prefills(runtime, monkeypatch)
    together = run_staggered(runtime, requests)
    assert any(mixed)  # an image prefill joined rows already decoding
    assert_same_outputs(together, alone)
    assert_no_leaks(runtime)


def test_a_repeated_image_is_not_encoded_again(tiny_llava):
    path, _ = tiny_llava
    config = DeploymentOptions(
        max_batch_size=2, max_model_len=256, block_size=8, enable_context_reuse=False
    )
    runtime = Runtime(path, config)
    metrics = runtime.encoder_cache.snapshot
    first = _alone(runtime, _request(runtime, ONE, [image(6)]))
    assert (metrics()["encoder_runs"], metrics()["encoder_cache_hits"]) == (1, 0)
    again = _alone(runtime, _request(runtime, ONE, [image(6)]))
    assert (metrics()["encoder_runs"], metrics()["encoder_cache_hits"]) == (1, 1)
    assert again.token_ids == first.token_ids
    other = _alone(runtime, _request(runtime, ONE, [image(7)]))
    assert metrics()["encoder_runs"] == 2
    assert other.token_ids != first.token_ids
    # One prompt holding the same image twice encodes it once.
    _alone(runtime, _request(runtime, TWO, [image(8), image(8)]))
    assert (metrics()["encoder_runs"], metrics()["encoder_cache_hits"]) == (3, 1)


def test_the_context_cache_reuses_a_prefix_only_with_the_same_image(tiny_llava):
    """Blocks of 8: 8 text tokens, an image's 16 placeholders, then text. A second request with
    another image reuses the text block before the image only, and answers as it would alone;
    with the same image it reuses the image's blocks too, and runs no encoder."""
    path, _ = tiny_llava
    cached = Runtime(
        path,
        DeploymentOptions(
            max_batch_size=2, max_model_len=256, block_size=8, enable_context_reuse=True
        ),
    )
    fresh = Runtime(
        path,
        DeploymentOptions(
            max_batch_size=2, max_model_len=256, block_size=8, enable_context_reuse=False
        ),
    )
    text = [1, 60, 61, 62, 63, 64, 65, 66, IMAGE_TOKEN_ID, 70, 71, 72, 73, 74, 75, 76, 77, 78]
    _alone(cached, _request(cached, text, [image(9)]))
    runs = cached.encoder_cache.snapshot()["encoder_runs"]
    other = _alone(cached, _request(cached, text, [image(10)]))
    assert other.cached_tokens == 8
    assert other.token_ids == _alone(fresh, _request(fresh, text, [image(10)])).token_ids
    same = _alone(cached, _request(cached, text, [image(9)]))
    assert same.cached_tokens == 32  # 8 text + 16 image + 8 text; the last token is computed
    assert cached.encoder_cache.snapshot()["encoder_runs"] == runs + 1
    assert_no_leaks(cached)


def test_bad_media_is_refused_naming_the_field(runtime, tiny_dirs):
    with pytest.raises(RequestFieldError, match="1 image placeholder") as info:
        _request(runtime, ONE, [image(0), image(1)])
    assert info.value.field == "multi_modal_data"
    with pytest.raises(RequestFieldError, match="must be a PIL image"):
        runtime.input_processor.expand_media(ONE, {"image": b"not an image"})
    with pytest.raises(RequestFieldError, match="no audio input"):
        runtime.input_processor.expand_media(ONE, {"audio": b"..."})
    # Placeholder tokens with no image for them.
    with pytest.raises(RequestFieldError, match="with no image"):
        runtime.check(GenerationRequest(ONE, SamplingParams(max_tokens=2)))
    text_only = Runtime(tiny_dirs["llama"], DeploymentOptions(max_batch_size=1, max_model_len=64))
    with pytest.raises(RequestFieldError, match="takes no image input"):
        text_only.input_processor.expand_media([1, 2, 3], {"image": image(0)})


def test_the_pruner_keeps_the_share_asked_for_by_its_rule(runtime, tiny_llava):
    """keep_ratio 0.5: each image takes 8 of its 16 tokens, those least like the image's mean
    embedding, in order; the greedy output is transformers' fed those embeddings. The
    encoder output is shared with the unpruned request (one run), and the context cache keeps
    the two apart."""
    _, hf = tiny_llava
    ids, media = runtime.input_processor.expand_media(
        ONE, {"image": image(11)}, {"keep_ratio": 0.5}
    )
    assert ids.count(IMAGE_TOKEN_ID) == 8 and media[0].length == 8
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    got = _alone(runtime, GenerationRequest(ids, params, media=media)).token_ids
    with torch.no_grad():
        pixels = torch.from_numpy(media[0].data)[None]
        (features,) = hf.model.get_image_features(pixel_values=pixels).pooler_output
        similarity = torch.nn.functional.cosine_similarity(features, features.mean(0), dim=-1)
        kept = features[similarity.argsort()[:8].sort().values]
        embeds = hf.get_input_embeddings()(torch.tensor([ids]))
        at = [i for i, t in enumerate(ids) if t == IMAGE_TOKEN_ID]
        embeds[0, at] = kept
        want = []
        for _ in range(10):
            token = int(hf(inputs_embeds=embeds).logits[0, -1].argmax())
            want.append(token)
            embeds = torch.cat([embeds, hf.get_input_embeddings()(torch.tensor([[token]]))], 1)
    assert got == tuple(want)
    with pytest.raises(RequestFieldError, match="keep_ratio must be a number in") as info:
        runtime.input_processor.expand_media(ONE, {"image": image(11)}, {"keep_ratio": 0})
    assert info.value.field == "mm_processor_kwargs"


def test_pruned_and_whole_images_share_the_encoder_but_not_the_context_cache(tiny_llava):
    path, _ = tiny_llava
    config = DeploymentOptions(
        max_batch_size=2, max_model_len=256, block_size=4, enable_context_reuse=True
    )
    cached = Runtime(path, config)
    text = [1, 60, 61, 62, IMAGE_TOKEN_ID, 70, 71, 72, 73]
    whole = _alone(cached, _request(cached, text, [image(12)]))
    ids, media = cached.input_processor.expand_media(
        text, {"image": image(12)}, {"keep_ratio": 0.25}
    )
    request = GenerationRequest(ids, SamplingParams(max_tokens=12, temperature=0), media=media)
    pruned = _alone(cached, request)
    assert pruned.cached_tokens == 4  # the text block before the image only
    assert cached.encoder_cache.snapshot()["encoder_runs"] == 1
    assert whole.prompt_tokens == pruned.prompt_tokens + 12
    assert_no_leaks(cached)


def test_an_image_that_fails_to_encode_fails_its_request_alone(runtime, monkeypatch):
    """Two image requests start their prefill in one step, and the encoder raises for one of the
    images only: that request fails in the step, naming the encoder's error; the other finishes
    in the same session with the tokens of its run alone."""
    failing = _request(runtime, ONE, [image(20)])
    other = _request(runtime, ONE, [image(21)])
    poison = failing.media[0].data
    runs: list[int] = []
    encode = ImageEncoder.encode

    def encode_or_fail(self, items):
        runs.append(len(items))
        if any(x.shape == poison.shape and np.array_equal(x, poison) for x in items):
            raise RuntimeError("the tower choked on these pixels")
        return encode(self, items)

    monkeypatch.setattr(ImageEncoder, "encode", encode_or_fail)
    session = runtime.new_session()
    refs = [session.admit(r).ref for r in (failing, other)]
    finished = {}
    while session.residents():
        finished.update(session.step().finished)
    session.finish()
    assert runs[0] == 2  # both images in the first step's one encoder run
    bad, good = finished[refs[0]], finished[refs[1]]
    assert bad.finish_reason is FinishReason.ERROR and bad.token_ids == []
    assert "could not be encoded" in bad.error
    assert "the tower choked on these pixels" in bad.error
    assert good.finish_reason is FinishReason.LENGTH
    assert tuple(good.token_ids) == _alone(runtime, other).token_ids
    assert_no_leaks(runtime)

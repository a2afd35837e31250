"""Voxtral against transformers on a tiny random checkpoint (CPU): the decoder's logits with 0, 1
and 2 audio clips (of 1 and 2 encoder windows) in place of their placeholders, through a
prefill and 8 decode steps."""

import copy

import numpy as np
import pytest
import torch

from inflight.model.contract import MediaEmbeds
from inflight.runtime.host.media import expand
from inflight.runtime.inputs.preprocessing import media_inputs

from helpers import assert_tracks, float32_model
from tiny_models import AUDIO_TOKEN_ID, AUDIO_TOKENS_PER_SECOND, make_tiny_voxtral


@pytest.fixture(scope="module")
def voxtral(tmp_path_factory):
    path = tmp_path_factory.mktemp("voxtral")
    return path, make_tiny_voxtral(path)


def tone(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    return (
        0.3 * np.sin(2 * np.pi * (200 + 150 * seed) * t) + 0.05 * rng.standard_normal(t.size)
    ).astype(np.float32)


def _prompt(clips: int) -> list[int]:
    ids = [1, 40, 41]
    for i in range(clips):
        ids += [AUDIO_TOKEN_ID, 50 + i, 51 + i]
    return ids + [60, 61]


@pytest.mark.parametrize("clips", [0, 1, 2])
def test_logits_with_audio_match_transformers(voxtral, clips):
    path, hf = voxtral
    checkpoint, model, backend = float32_model(path)
    hf = copy.deepcopy(hf).double()

    audio = media_inputs(checkpoint.config, checkpoint.processor_config)["audio"]
    # A 0.7 s clip (one window) and a 1.6 s one (two).
    prepared = [audio.prepare(tone(s, i)) for i, s in enumerate((0.7, 1.6)[:clips])]
    assert [p.tokens for p in prepared] == [AUDIO_TOKENS_PER_SECOND * w for w in (1, 2)][:clips]
    ids, media = expand(_prompt(clips), [(audio.spec, prepared)])
    extra, ours_media = {}, None
    if clips:
        encoded = model.encoders["audio"].encode([item.data for item in media])
        at = torch.tensor([i for i, t in enumerate(ids) if t == AUDIO_TOKEN_ID])
        ours_media = MediaEmbeds(at, torch.cat(encoded))
        windows = np.concatenate([p.data for p in prepared])
        extra = {"input_features": torch.from_numpy(windows).double()}

    def theirs(seq: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([seq]), **extra).logits[0]

    assert_tracks(model, backend, ids, theirs, ours_media)

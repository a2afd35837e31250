"""Qwen3-TTS's speaker encoder against the reference (`tests/speech_reference.py`) on CPU in
float32: the Slaney mel filterbank, the log-mel spectrogram, and the x-vector of a tiny random
model's encoder; plus the errors and the real model's parameter names."""

import numpy as np
import pytest
import torch
from transformers.audio_utils import mel_filter_bank

from inflight.model.speech.speaker_encoder import (
    SpeakerEncoder,
    SpeakerEncoderConfig,
    mel_filterbank,
    mel_spectrogram,
)

from speech_reference import reference, tiny_config_dict, tiny_model

RATE = 24000


def noise(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.1 * rng.standard_normal(int(seconds * RATE))).astype(np.float32)


@pytest.fixture(scope="module")
def reference_model():
    return tiny_model("base", seed=0)


@pytest.fixture(scope="module")
def ours(reference_model):
    config = SpeakerEncoderConfig.from_dict(tiny_config_dict("base")["speaker_encoder_config"])
    encoder = SpeakerEncoder(config).eval()
    state = reference_model.speaker_encoder.state_dict()
    weights = [(f"speaker_encoder.{name}", t) for name, t in state.items()]
    # Another part of the checkpoint: skipped.
    encoder.load_weights([("talker.x", torch.zeros(3)), *weights])
    return encoder


def test_filterbank_matches_transformers_slaney():
    bank = mel_filterbank(RATE, 1024, 128, 0.0, 12000.0)
    expected = mel_filter_bank(
        num_frequency_bins=513,
        num_mel_filters=128,
        min_frequency=0.0,
        max_frequency=12000.0,
        sampling_rate=RATE,
        norm="slaney",
        mel_scale="slaney",
    ).T
    assert bank.shape == (128, 513)
    np.testing.assert_allclose(bank, expected, rtol=0, atol=1e-6)


def test_mel_spectrogram_matches_reference():
    audio = torch.from_numpy(noise(1.0, seed=1))
    expected = reference().tts.mel_spectrogram(
        audio.unsqueeze(0),
        n_fft=1024,
        num_mels=128,
        sampling_rate=RATE,
        hop_size=256,
        win_size=1024,
        fmin=0,
        fmax=12000,
    )
    got = mel_spectrogram(audio)
    # Padded by 384 a side, not centred: 1 + (24000 + 768 - 1024) // 256 frames.
    assert got.shape == expected.shape == (1, 128, 93)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("seconds", [1.0, 2.3])
def test_embedding_matches_reference(ours, reference_model, seconds):
    audio = noise(seconds, seed=int(seconds * 10))
    with torch.no_grad():
        expected = reference_model.extract_speaker_embedding(audio, RATE)
    got = ours.embed(audio, RATE)
    assert got.shape == (32,)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_the_shortest_clip_embeds_and_a_shorter_one_is_refused(ours, reference_model):
    shortest = ours.config.min_samples
    audio = noise(1.0, seed=3)[:shortest]
    with torch.no_grad():
        expected = reference_model.extract_speaker_embedding(audio, RATE)
    torch.testing.assert_close(ours.embed(audio, RATE), expected, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=f"at least {shortest}"):
        ours.embed(audio[:-1], RATE)
    with pytest.raises(ValueError, match="0 samples"):
        ours.embed(np.zeros(0, np.float32), RATE)


def test_wrong_sample_rate_is_refused(ours):
    with pytest.raises(ValueError, match="16000 Hz"):
        ours.embed(noise(1.0, seed=4), 16000)


def test_a_missing_weight_is_named(reference_model):
    config = SpeakerEncoderConfig.from_dict(tiny_config_dict("base")["speaker_encoder_config"])
    weights = [
        (f"speaker_encoder.{name}", t)
        for name, t in reference_model.speaker_encoder.state_dict().items()
        if name != "asp.conv.bias"
    ]
    with pytest.raises(ValueError, match="asp.conv.bias"):
        SpeakerEncoder(config).load_weights(weights)


def test_default_config_builds_on_meta_with_the_reference_names():
    tts = reference().tts
    with torch.device("meta"):
        ours = SpeakerEncoder(SpeakerEncoderConfig())
        theirs = tts.Qwen3TTSSpeakerEncoder(tts.Qwen3TTSSpeakerEncoderConfig())
    shapes = {name: tuple(t.shape) for name, t in ours.state_dict().items()}
    assert shapes == {name: tuple(t.shape) for name, t in theirs.state_dict().items()}
    assert shapes["fc.weight"] == (1024, 3072, 1)

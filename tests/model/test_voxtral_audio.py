"""Voxtral's audio side against transformers on a tiny random checkpoint (CPU, float32): the
log-mel features (WhisperFeatureExtractor, split as VoxtralProcessor splits), the encoder and
projector, and WAV decoding."""

import io
import types
import wave

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import VoxtralProcessor, WhisperFeatureExtractor

from inflight.model.encoders.audio import AudioEncoder, audio_from_hf
from inflight.model.encoders.audio_processor import AudioProcessor, read_wav

from tiny_models import AUDIO_FEATURES, AUDIO_TOKEN_ID, COMMON, make_tiny_voxtral

TEXT_HIDDEN = COMMON["hidden_size"]
# A window of the tiny encoder is 2 * 32 = 64 mel frames: 1 s of audio at a hop of 250.
PREPROCESSOR = AUDIO_FEATURES
WINDOW = 16000


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    path = tmp_path_factory.mktemp("voxtral")
    return make_tiny_voxtral(path), path


@pytest.fixture(scope="module")
def ours(hf):
    model, path = hf
    config = audio_from_hf(model.config.to_dict())
    encoder = AudioEncoder(config, TEXT_HIDDEN)
    # The names a checkpoint holds (transformers saves the original layout).
    names = ("audio_tower.", "multi_modal_projector.")
    encoder.load_weights(
        (k, v) for k, v in load_file(path / "model.safetensors").items() if k.startswith(names)
    )
    return encoder


def _audio(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    tone = 0.3 * np.sin(2 * np.pi * (300 + 100 * seed) * t)
    return (tone + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


def _hf_windows(samples: np.ndarray) -> np.ndarray:
    """VoxtralProcessor's features: padded to whole windows, one spectrogram, then split."""
    extractor = WhisperFeatureExtractor(**PREPROCESSOR)
    kwargs = {**VoxtralProcessor.audio_kwargs, "pad_to_multiple_of": WINDOW}
    del kwargs["max_source_positions"]  # mel frames per window: 64 here
    owner = types.SimpleNamespace(feature_extractor=extractor)
    features = VoxtralProcessor._retrieve_input_features(owner, [samples], 64, **kwargs)
    return features.numpy()


def test_config_reads_voxtral_and_its_defaults(ours):
    config = ours.config
    assert config.frames_per_window == 64 and config.frames_per_token == 4
    assert config.tokens_per_window == 8
    assert config.audio_token_id == AUDIO_TOKEN_ID
    mini = audio_from_hf({"audio_token_id": 24})
    assert (mini.num_mel_bins, mini.frames_per_window, mini.tokens_per_window) == (128, 3000, 375)
    whisper = audio_from_hf(
        {"audio_config": {"d_model": 80, "encoder_ffn_dim": 320}, "audio_token_id": 1}
    )
    assert (whisper.hidden_size, whisper.intermediate_size) == (80, 320)
    with pytest.raises(ValueError, match="audio_token_id"):
        audio_from_hf({})
    with pytest.raises(ValueError, match="unsupported audio encoder"):
        audio_from_hf({"audio_config": {"model_type": "qwen2_audio_encoder"}, "audio_token_id": 1})


@pytest.mark.parametrize("seconds", [0.3, 1.0, 2.5])
def test_features_match_transformers(ours, seconds):
    processor = AudioProcessor.from_config(PREPROCESSOR, ours.config)
    samples = _audio(seconds, seed=1)
    got = processor(samples)
    want = _hf_windows(samples)
    assert got.dtype == np.float32
    assert got.shape == want.shape == (int(np.ceil(seconds)), 16, 64)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    # transformers' float32 torch STFT is what limits the agreement: its float64 numpy path
    # agrees to float32 rounding.
    padded = np.pad(samples, (0, got.shape[0] * WINDOW - samples.size))
    exact = WhisperFeatureExtractor(**PREPROCESSOR)._np_extract_fbank_features(padded[None], "cpu")
    np.testing.assert_allclose(got, exact[0].reshape(16, -1, 64).transpose(1, 0, 2), atol=1e-6)
    if seconds <= 1:  # one window: the plain feature extractor agrees too
        plain = WhisperFeatureExtractor(**PREPROCESSOR)(samples, sampling_rate=16000)
        np.testing.assert_allclose(got[0], plain["input_features"][0], atol=1e-5, rtol=0)


def test_processor_defaults_and_refusals(ours):
    mini = audio_from_hf({"audio_token_id": 24})
    default = AudioProcessor.from_config({}, mini)
    assert (default.num_mel_bins, default.n_fft, default.hop_length) == (128, 400, 160)
    assert default.window_samples == 480000 and default.frames_per_window == 3000
    with pytest.raises(ValueError, match="mel frames"):
        AudioProcessor.from_config({"chunk_length": 2, "hop_length": 250}, ours.config)
    with pytest.raises(ValueError, match="feature_size"):
        AudioProcessor.from_config({**PREPROCESSOR, "feature_size": 80}, ours.config)
    processor = AudioProcessor.from_config(PREPROCESSOR, ours.config)
    with pytest.raises(ValueError, match="empty"):
        processor(np.zeros(0, np.float32))
    with pytest.raises(ValueError, match="non-finite"):
        processor(np.array([0.0, np.nan], np.float32))
    with pytest.raises(ValueError, match="1-D"):
        processor(np.zeros((2, 100), np.float32))


def test_encoder_matches_transformers(hf, ours):
    model, _ = hf
    processor = AudioProcessor.from_config(PREPROCESSOR, ours.config)
    one, three = processor(_audio(0.7, seed=2)), processor(_audio(2.2, seed=3))
    assert (len(one), len(three)) == (1, 3)
    with torch.no_grad():
        want = [
            model.get_audio_features(input_features=torch.from_numpy(f)).pooler_output
            for f in (one, three)
        ]
    (alone,) = ours.encode([one])
    together = ours.encode([one, three])
    assert alone.shape == (8, TEXT_HIDDEN) and together[1].shape == (24, TEXT_HIDDEN)
    assert alone.dtype == torch.float32
    for got, ref in zip([alone, *together], [want[0], *want], strict=True):
        assert (got - ref).abs().max().item() < 1e-5


def test_positions_stay_float32_in_half_precision(ours):
    # As the model loader builds it: on the meta device, then placed and cast.
    with torch.device("meta"):
        encoder = AudioEncoder(ours.config, TEXT_HIDDEN)
    encoder = encoder.to_empty(device="cpu").to(torch.bfloat16)
    encoder.load_weights(ours.state_dict().items())
    positions = encoder.audio_tower.embed_positions.weight
    assert positions.dtype == torch.float32
    assert torch.equal(positions, ours.audio_tower.embed_positions.weight)
    (out,) = encoder.encode([np.zeros((1, 16, 64), np.float32)])
    assert out.dtype == torch.bfloat16 and out.shape == (8, TEXT_HIDDEN)


def test_load_weights_refuses_unknown_missing_and_misshapen(ours):
    weights = dict(ours.state_dict())
    fresh = AudioEncoder(ours.config, TEXT_HIDDEN)
    with pytest.raises(ValueError, match="'audio_tower.extra.weight' has no place"):
        fresh.load_weights([*weights.items(), ("audio_tower.extra.weight", torch.zeros(1))])
    partial = {k: v for k, v in weights.items() if k != "audio_tower.layers.1.fc2.weight"}
    with pytest.raises(ValueError, match="lacks.*audio_tower.layers.1.fc2.weight"):
        fresh.load_weights(partial.items())
    bad = {**weights, "multi_modal_projector.linear_2.weight": torch.zeros(3, 3)}
    with pytest.raises(ValueError, match="linear_2.weight' has shape"):
        fresh.load_weights(bad.items())
    with pytest.raises(ValueError, match="log-mel windows"):
        ours.encode([np.zeros((1, 16, 63), np.float32)])


def _wav(ints: np.ndarray, rate: int, width: int = 2, channels: int = 1) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as f:
        f.setnchannels(channels)
        f.setsampwidth(width)
        f.setframerate(rate)
        f.writeframes(ints.tobytes())
    return buffer.getvalue()


def test_read_wav_round_trips_16_bit_mono():
    ints = np.random.default_rng(0).integers(-32768, 32768, 1000, dtype=np.int16)
    got = read_wav(_wav(ints, 16000))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, ints / 32768.0)


def test_read_wav_decodes_8_and_24_bit():
    values = np.array([-1.0, -0.5, 0.0, 0.25, 0.5])
    u8 = (values * 128 + 128).astype(np.uint8)
    np.testing.assert_array_equal(read_wav(_wav(u8, 16000, width=1)), values)
    i24 = (values * (1 << 23)).astype("<i4").view(np.uint8).reshape(-1, 4)[:, :3]
    np.testing.assert_array_equal(read_wav(_wav(np.ascontiguousarray(i24), 16000, width=3)), values)


def test_read_wav_averages_stereo_and_resamples_8khz():
    left = np.array([1000, -2000, 3000, 0], np.int16)
    right = np.array([3000, 2000, -1000, 0], np.int16)
    stereo = np.stack([left, right], axis=1)
    np.testing.assert_allclose(
        read_wav(_wav(stereo, 16000, channels=2)), [2000 / 32768, 0, 1000 / 32768, 0]
    )
    t = np.arange(8000) / 8000
    tone = (0.5 * np.sin(2 * np.pi * 440 * t) * 32767).astype(np.int16)
    got = read_wav(_wav(tone, 8000))
    assert got.size == 16000
    want = 0.5 * np.sin(2 * np.pi * 440 * np.arange(16000) / 16000)
    # Away from the clip's edges (where the sinc meets silence) the tone is reproduced.
    assert np.abs(got[400:-400] - want[400:-400]).max() < 2e-3


def test_read_wav_refuses_garbage_and_float_wavs():
    with pytest.raises(ValueError, match="not a readable WAV"):
        read_wav(b"definitely not a wav file")
    float_wav = bytearray(_wav(np.zeros(4, np.int16), 16000))
    float_wav[20:22] = (3).to_bytes(2, "little")  # the fmt chunk's format tag
    with pytest.raises(ValueError, match="IEEE float"):
        read_wav(bytes(float_wav))

"""Qwen3-Omni's audio encoder against transformers on tiny random weights (CPU, float32): the
encoder given the same log-mel frames, the preparer's features and token count against
WhisperFeatureExtractor as Qwen3OmniMoeProcessor calls it, batching, the config parser and
weight loading."""

import types

import numpy as np
import pytest
import torch
from torch import nn
from transformers import WhisperFeatureExtractor
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
    Qwen3OmniMoeAudioEncoderConfig,
)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeAudioEncoder,
)
from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import (
    Qwen3OmniMoeProcessor,
    _get_feat_extract_output_lengths,
)

from inflight.model.encoders.qwen3_omni_audio import (
    Qwen3OmniAudioEncoder,
    qwen3_omni_audio_from_hf,
)

# The thinker's audio_config of wave3-scripts/omni_tiny.py: chunks of 100 mel frames (1 s),
# attention windows of one chunk.
TINY = dict(
    d_model=32,
    encoder_attention_heads=4,
    encoder_ffn_dim=32,
    encoder_layers=1,
    num_mel_bins=20,
    downsample_hidden_size=16,
    output_dim=64,
    n_window=50,
    n_window_infer=100,
)
TEXT_HIDDEN = 64
AUDIO_TOKEN_ID = 110
# Mel frames: shorter than a chunk (odd and even), just under and exactly one chunk, whole
# chunks, a partial last chunk, and more chunks than a window of 4 (n_window_infer 400).
FRAMES = [37, 50, 99, 100, 300, 237, 731, 1230]
# The official checkpoints' preprocessor_config.json (its audio keys), with the tiny mel bins.
PREPROCESSOR = dict(
    feature_extractor_type="WhisperFeatureExtractor",
    feature_size=20,
    hop_length=160,
    n_fft=400,
    n_samples=4800000,
    nb_max_frames=30000,
    sampling_rate=16000,
)


def _models(n_window_infer: int) -> tuple[Qwen3OmniMoeAudioEncoder, Qwen3OmniAudioEncoder]:
    audio = {**TINY, "n_window_infer": n_window_infer}
    torch.manual_seed(0)
    hf = Qwen3OmniMoeAudioEncoder(Qwen3OmniMoeAudioEncoderConfig(**audio)).eval()
    # transformers initializes biases to zero and norms to identity: random ones test more.
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * (p[0].numel() ** -0.5 if p.ndim > 1 else 0.3))
        for m in hf.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.add_(1.0)
    config = qwen3_omni_audio_from_hf({"audio_config": audio, "audio_token_id": AUDIO_TOKEN_ID})
    ours = config.build(TEXT_HIDDEN)
    ours.load_weights((f"audio_tower.{k}", v) for k, v in hf.state_dict().items())
    return hf, ours


@pytest.fixture(scope="module", params=[100, 400], ids=["window1chunk", "window4chunks"])
def models(request):
    return _models(request.param)


@pytest.fixture(scope="module")
def tiny():
    return _models(TINY["n_window_infer"])


def _mel(frames: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((TINY["num_mel_bins"], frames), np.float32)


def _hf_encode(hf: Qwen3OmniMoeAudioEncoder, clips: list[np.ndarray]) -> torch.Tensor:
    with torch.no_grad():
        return hf(
            torch.from_numpy(np.concatenate(clips, axis=1)),
            feature_lens=torch.tensor([c.shape[1] for c in clips]),
        ).last_hidden_state


def _audio(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    tone = 0.3 * np.sin(2 * np.pi * (300 + 100 * seed) * t)
    return (tone + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


def test_config_reads_the_thinker_dict_and_transformers_defaults():
    config = qwen3_omni_audio_from_hf({"audio_config": TINY, "audio_token_id": AUDIO_TOKEN_ID})
    assert config.kind == "audio" and config.placeholder == AUDIO_TOKEN_ID
    assert (config.num_mel_bins, config.hidden_size, config.num_heads) == (20, 32, 4)
    assert (config.num_layers, config.intermediate_size) == (1, 32)
    assert (config.downsample_hidden_size, config.output_dim) == (16, 64)
    assert (config.chunk_frames, config.window_tokens, config.conv_chunksize) == (100, 13, 500)
    real = qwen3_omni_audio_from_hf({})
    assert (real.num_mel_bins, real.hidden_size, real.num_layers, real.num_heads) == (
        128,
        1280,
        32,
        20,
    )
    assert (real.intermediate_size, real.downsample_hidden_size, real.output_dim) == (
        5120,
        480,
        3584,
    )
    assert (real.n_window, real.n_window_infer, real.window_tokens) == (50, 800, 104)
    assert real.audio_token_id == 151646 and real.activation == "gelu"
    alias = qwen3_omni_audio_from_hf({"audio_config": {"hidden_size": 80, "num_hidden_layers": 2}})
    assert (alias.hidden_size, alias.num_layers) == (80, 2)
    with pytest.raises(ValueError, match="unsupported audio encoder"):
        qwen3_omni_audio_from_hf({"audio_config": {"model_type": "whisper_encoder"}})
    with pytest.raises(ValueError, match="transformers counts 13"):
        qwen3_omni_audio_from_hf({"audio_config": {**TINY, "n_window": 40}})
    with pytest.raises(ValueError, match="shorter than a chunk"):
        qwen3_omni_audio_from_hf({"audio_config": {**TINY, "n_window_infer": 99}})
    with pytest.raises(ValueError, match="output_dim 64 differs"):
        config.build(32)


def test_token_count_is_transformers():
    config = qwen3_omni_audio_from_hf({"audio_config": TINY})
    frames = np.arange(1, 2500)
    want = _get_feat_extract_output_lengths(frames, TINY["n_window"])
    assert [config.audio_tokens(int(n)) for n in frames] == want.tolist()


@pytest.mark.parametrize("frames", FRAMES)
def test_encoder_matches_transformers(models, frames):
    hf, ours = models
    mel = _mel(frames, seed=frames)
    want = _hf_encode(hf, [mel])
    (got,) = ours.encode([mel])
    assert got.shape == want.shape == (ours.config.audio_tokens(frames), TEXT_HIDDEN)
    assert got.dtype == torch.float32
    # Seen: at most 6e-7 (0.0 for several lengths), on outputs of magnitude ~1.
    assert (got - want).abs().max().item() <= 1e-5


def test_clips_in_one_batch_equal_each_alone(models):
    hf, ours = models
    clips = [_mel(n, seed=n) for n in FRAMES]
    together = ours.encode(clips)
    two = ours.encode(clips[:2])
    for clip, got in zip(clips, together, strict=True):
        (alone,) = ours.encode([clip])
        # Not bit for bit: the matrix products of a larger batch round differently (seen:
        # up to 7e-7).
        torch.testing.assert_close(got, alone, atol=1e-5, rtol=0)
    for got, alone in zip(two, together[:2], strict=True):
        torch.testing.assert_close(got, alone, atol=1e-5, rtol=0)
    # transformers pads a short clip's chunk to its batch's longest, which changes it; ours
    # is the clip alone, as the processor and the thinker give a prompt of one clip.
    beside = _hf_encode(hf, [clips[0], clips[5]])[: len(together[0])]
    assert (beside - _hf_encode(hf, [clips[0]])).abs().max().item() > 1e-4
    assert ours.encode([]) == []


@pytest.mark.parametrize("seconds", [0.37, 1.0, 2.37, 7.31])
def test_preparer_matches_the_processor(tiny, seconds):
    hf, ours = tiny
    samples = _audio(seconds, seed=1)
    samples = samples[: samples.size - 77]  # not a whole number of hops
    prepared = ours.config.preparer(PREPROCESSOR)(samples)
    extractor = WhisperFeatureExtractor(**PREPROCESSOR)
    kwargs = {**Qwen3OmniMoeProcessor.audio_kwargs, "return_tensors": "np"}
    features = extractor(samples, **kwargs)
    want, mask = features["input_features"][0], features["attention_mask"]
    frames = samples.size // 160
    assert prepared.data.dtype == np.float32
    assert prepared.data.shape == want.shape == (20, frames) and mask.sum() == frames
    np.testing.assert_allclose(prepared.data, want, atol=1e-5, rtol=0)
    # transformers' float32 torch STFT limits the agreement; its float64 numpy path agrees to
    # float32 rounding.
    exact = extractor._np_extract_fbank_features(samples[None], "cpu")[0]
    np.testing.assert_allclose(prepared.data, exact, atol=1e-6, rtol=0)
    # What the processor puts in the prompt, and what the encoder yields.
    owner = types.SimpleNamespace(feature_extractor=extractor, n_window=50)
    assert prepared.tokens == _get_feat_extract_output_lengths(mask.sum(-1), 50)[0]
    assert prepared.tokens == Qwen3OmniMoeProcessor._get_num_audio_tokens(owner, samples.size)
    (got,) = ours.encode([prepared.data])
    want_out = _hf_encode(hf, [prepared.data])
    assert got.shape[0] == want_out.shape[0] == prepared.tokens
    assert (got - want_out).abs().max().item() <= 1e-5


def test_preparer_keys_defaults_and_refusals():
    config = qwen3_omni_audio_from_hf({"audio_config": TINY})
    prepare = config.preparer(PREPROCESSOR)
    clip = _audio(0.5, seed=2)
    a, b = prepare(clip), prepare((clip, 16000))
    assert a.key == b.key and a.grid is None
    assert prepare(clip[:-160]).key != a.key
    # 8 kHz is resampled: 4000 samples become 8000, 50 frames.
    assert prepare((clip[::2], 8000)).data.shape == (20, 50)
    real = qwen3_omni_audio_from_hf({}).preparer({**PREPROCESSOR, "feature_size": 128})
    item = real(_audio(1.0, seed=3))
    assert item.data.shape == (128, 100) and item.tokens == 13
    assert qwen3_omni_audio_from_hf({}).preparer({})(clip).data.shape == (128, 50)
    with pytest.raises(ValueError, match="too short"):
        prepare(clip[:200])
    with pytest.raises(ValueError, match="non-finite"):
        prepare(np.full(1000, np.nan, np.float32))
    with pytest.raises(ValueError, match="feature_size"):
        config.preparer({"feature_size": 128})
    with pytest.raises(ValueError, match="sampling_rate"):
        config.preparer({"sampling_rate": 24000})


def test_half_precision_built_on_meta(tiny):
    hf, ours = tiny
    # As the model loader builds it: on the meta device, then placed, cast and loaded.
    with torch.device("meta"):
        encoder = ours.config.build(TEXT_HIDDEN)
    encoder = encoder.to_empty(device="cpu").to(torch.bfloat16)
    encoder.load_weights(ours.state_dict().items())
    mel = _mel(237)
    (got,) = encoder.encode([mel])
    assert got.dtype == torch.bfloat16 and got.shape == (31, TEXT_HIDDEN)
    (full,) = ours.encode([mel])
    assert (got.float() - full).abs().max().item() < 0.1


def test_load_weights_and_encode_refuse_what_does_not_fit(tiny):
    hf, ours = tiny
    weights = {f"audio_tower.{k}": v for k, v in hf.state_dict().items()}
    fresh = ours.config.build(TEXT_HIDDEN)
    with pytest.raises(ValueError, match="'conv2d1.weight' has no place"):
        fresh.load_weights([("conv2d1.weight", weights["audio_tower.conv2d1.weight"])])
    with pytest.raises(ValueError, match="'thinker.audio_tower.ln_post.bias' has no place"):
        fresh.load_weights([("thinker.audio_tower.ln_post.bias", torch.zeros(32))])
    partial = {k: v for k, v in weights.items() if k != "audio_tower.layers.0.fc2.weight"}
    with pytest.raises(ValueError, match="lacks.*audio_tower.layers.0.fc2.weight"):
        fresh.load_weights(partial.items())
    bad = {**weights, "audio_tower.proj2.weight": torch.zeros(3, 3)}
    with pytest.raises(ValueError, match="proj2.weight' has shape"):
        fresh.load_weights(bad.items())
    with pytest.raises(ValueError, match=r"log-mel frames must be \[20, frames\]"):
        ours.encode([np.zeros((128, 100), np.float32)])
    with pytest.raises(ValueError, match="log-mel frames"):
        ours.encode([np.zeros((20, 0), np.float32)])

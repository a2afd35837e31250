"""The codec decoder as Qwen3-Omni's Code2Wav, against transformers' `Qwen3OmniMoeCode2Wav` on a
tiny random checkpoint (CPU, float32): whole decodes, streams of uneven pushes, windows with
left context as the reference's `chunked_decode` makes them, config parsing, weight loading,
and the real model's shape."""

import dataclasses
import itertools

import pytest
import torch
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
    Qwen3OmniMoeCode2WavConfig,
)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

from inflight.model.speech.codec_decoder import CodecDecoder, CodecDecoderConfig

CODEBOOK, GROUPS = 64, 4
# The wave3 probe's tiny bundle's `code2wav_config` (omni_tiny.py).
PROBE = dict(
    codebook_size=CODEBOOK,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=64,
    num_hidden_layers=1,
    num_quantizers=GROUPS,
    decoder_dim=32,
    upsample_rates=[8, 5, 4, 3],
    upsampling_ratios=[2, 2],
    sliding_window=72,
)
TINY = {**PROBE, "num_hidden_layers": 2}  # a second layer: the attention state is per layer
TOL = 1e-6


def _reference(seed: int) -> Qwen3OmniMoeCode2Wav:
    """A tiny random Code2Wav, loud enough to compare: its init gives samples of ~1e-8, so its
    matrices are scaled x5 (as the wave3 probe does); its layer scales (0.01) and ConvNeXt
    gammas (1e-6) would all but mute the transformer and the ConvNeXt blocks, and its zero
    biases would hide one added twice, so those are set to 1 and to random values."""
    torch.manual_seed(seed)
    ref = Qwen3OmniMoeCode2Wav(Qwen3OmniMoeCode2WavConfig(**TINY)).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() > 1:
                p.mul_(5)
            elif name.endswith(("layer_scale.scale", "gamma")):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape))
    return ref


def _checkpoint(ref: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The reference's tensors named as a Qwen3-Omni checkpoint names them, with a thinker
    tensor that the decoder must skip."""
    weights = [(f"code2wav.{k}", v) for k, v in ref.state_dict().items()]
    return [("thinker.lm_head.weight", torch.zeros(3)), *weights]


def _ours(ref: torch.nn.Module, **changes) -> CodecDecoder:
    config = dataclasses.replace(CodecDecoderConfig.from_code2wav(TINY), **changes)
    model = CodecDecoder(config).eval()
    model.load_weights(_checkpoint(ref))
    return model


def _codes(frames: int, seed: int, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CODEBOOK, (batch, GROUPS, frames), generator=g)


@pytest.fixture(scope="module")
def pair():
    ref = _reference(0)
    return ref, _ours(ref)


@pytest.mark.parametrize("frames", [1, 10, 90])
def test_matches_the_reference(pair, frames):
    """90 frames reach past the sliding window (72)."""
    ref, ours = pair
    codes = _codes(frames, seed=frames, batch=2)
    with torch.no_grad():
        expected = ref(codes)[:, 0]
        got = ours(codes)
    assert got.shape == expected.shape == (2, frames * 1920 - 555)
    assert expected.abs().max() > 0.1  # loud enough for the comparison to mean something
    assert expected.abs().max() < 1  # and not clamped, which would hide differences
    # Measured: 0 (the same operations in the same order).
    assert (got - expected).abs().max() <= TOL


def test_pending_samples_is_what_a_decode_holds_back(pair):
    _, ours = pair
    assert ours.samples_per_frame == 1920
    assert ours.pending_samples == 555
    codes = _codes(10, seed=1)
    with torch.no_grad():
        whole, prefix = ours(codes)[0], ours(codes[..., :8])[0]
    assert whole.shape[0] == 10 * ours.samples_per_frame - ours.pending_samples
    assert (prefix - whole[: prefix.shape[0]]).abs().max() <= TOL
    # Other rates hold back what their blocks trim, upsampled by the blocks after them.
    config = dataclasses.replace(ours.config, upsample_rates=(2, 3), decoder_dim=8)
    assert config.pending_samples == 2 * 3 + 3
    tts = CodecDecoderConfig.from_dict({})
    assert tts.samples_per_frame == 1920 and tts.pending_samples == 0


def test_a_sliding_window_one_frame_wide_shows(pair):
    ref, ours = pair
    codes = _codes(90, seed=3)
    with torch.no_grad():
        expected = ref(codes)[:, 0]
        wrong = _ours(ref, sliding_window=73)(codes)
    # Measured: 3.2e-2.
    assert (wrong - expected).abs().max() > 1e-3


def _spans(start: int, frames: int, sizes: list[int]) -> list[tuple[int, int]]:
    """Frames start..frames cut into pushes of `sizes` (cycled; the last one cut short)."""
    spans = []
    for size in itertools.cycle(sizes):
        if start >= frames:
            return spans
        spans.append((start, min(start + size, frames)))
        start += size
    raise AssertionError("unreachable")


UNEVEN = [1, 3, 7, 2, 5, 1, 8, 4, 6]


def test_pushes_return_only_final_samples(pair):
    """After each push, the samples so far are the one-shot decode of the frames so far
    (n * 1920 - 555 of them: a prefix of the whole decode, which is prefix-stable)."""
    _, ours = pair
    codes = _codes(90, seed=4)[0]
    with torch.no_grad():
        whole = ours(codes[None])[0]
    stream, got, worst = ours.stream(), [], 0.0
    for start, end in _spans(0, 90, UNEVEN):
        got.append(stream.push(codes[:, start:end]))
        so_far = torch.cat(got)
        assert so_far.shape[0] == end * ours.samples_per_frame - ours.pending_samples
        worst = max(worst, (so_far - whole[: so_far.shape[0]]).abs().max().item())
    # Measured: 5.7e-7 (samples peak near 0.4).
    assert worst <= TOL


def _streamed(model: CodecDecoder, codes: torch.Tensor, context: int) -> torch.Tensor:
    """Frames [groups, n] streamed after their first `context` in uneven pushes."""
    stream = model.stream(codes[:, :context])
    spans = _spans(context, codes.shape[1], UNEVEN)
    return torch.cat([stream.push(codes[:, a:b]) for a, b in spans])


def test_windows_match_chunked_decode(pair):
    """Windows of 75 frames (past the sliding window) after 25 of context, each streamed and
    each decoded whole, against the reference's `chunked_decode`: it loses the 555 samples
    that each window but the last holds back."""
    ref, ours = pair
    frames, chunk, context = 160, 75, 25
    codes = _codes(frames, seed=5)
    with torch.no_grad():
        expected = ref.chunked_decode(codes, chunk_size=chunk, left_context_size=context)[0, 0]
    windows, streams, worst = [], [], 0.0
    for start in range(0, frames, chunk):
        ctx = min(context, start)
        window = codes[0, :, start - ctx : start + chunk]
        windows.append(ours.decode_window(window, ctx))
        streams.append(_streamed(ours, window, ctx))
        worst = max(worst, (streams[-1] - windows[-1]).abs().max().item())
    lost = len(windows) * ours.pending_samples
    assert expected.shape[0] == frames * ours.samples_per_frame - lost
    # Measured: 0 for the whole windows, 4.6e-7 for the streamed ones (samples peak near 0.4).
    assert (torch.cat(windows) - expected).abs().max() <= TOL
    assert torch.cat(streams).shape == expected.shape
    assert worst <= TOL


def test_a_stream_on_context_drops_the_context_samples(pair):
    """A stream started on context frames returns the window's decode from the end of the
    context's samples on: the samples held back at the context's end come with the first push,
    and are dropped from it."""
    _, ours = pair
    codes = _codes(30, seed=6)[0]
    with torch.no_grad():
        whole = ours(codes[None])[0]
    stream = ours.stream(codes[:, :10])
    first = stream.push(codes[:, 10:11])
    assert first.shape[0] == ours.samples_per_frame - ours.pending_samples
    rest = stream.push(codes[:, 11:30])
    assert rest.shape[0] == 19 * ours.samples_per_frame
    got = torch.cat((first, rest))
    assert (got - whole[10 * ours.samples_per_frame :]).abs().max() <= TOL


def test_config_from_code2wav_dict():
    # As a config.json holds it: keys the decoder ignores (an init scale, the model type, a
    # field of the speech tokenizer's) and nulls beside the probe's.
    extra = {"layer_scale_initial_scale": 0.01, "model_type": "", "latent_dim": 7}
    config = CodecDecoderConfig.from_code2wav({**PROBE, **extra, "rope_parameters": None})
    assert config.kind == "code2wav"
    assert (config.hidden_size, config.latent_dim, config.head_dim) == (32, 32, 8)
    assert config.upsample_rates == (8, 5, 4, 3) and config.upsampling_ratios == (2, 2)
    assert (config.codebook_size, config.num_quantizers, config.num_hidden_layers) == (64, 4, 1)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 4)
    assert (config.intermediate_size, config.decoder_dim, config.sliding_window) == (64, 32, 72)
    assert config.samples_per_frame == 1920 and config.pending_samples == 555
    # Missing keys take Qwen3OmniMoeCode2WavConfig's defaults.
    default, hf = CodecDecoderConfig.from_code2wav({}), Qwen3OmniMoeCode2WavConfig()
    for f in dataclasses.fields(default):
        if hasattr(hf, f.name):
            value = getattr(hf, f.name)
            assert getattr(default, f.name) == (tuple(value) if isinstance(value, list) else value)
    assert default.rope_theta == hf.rope_parameters["rope_theta"]
    assert default.head_dim == hf.hidden_size // hf.num_attention_heads
    assert default.latent_dim == default.hidden_size
    assert CodecDecoderConfig.from_code2wav({"head_dim": 16}).head_dim == 16
    with pytest.raises(ValueError, match="rope"):
        CodecDecoderConfig.from_code2wav({"rope_parameters": {"rope_type": "yarn"}})


def test_load_weights_names_a_wrong_tensor(pair):
    ref, _ = pair
    model = CodecDecoder(CodecDecoderConfig.from_code2wav(TINY))
    weights = _checkpoint(ref)
    with pytest.raises(ValueError, match="code_embedding.weight"):
        model.load_weights([(k, v) for k, v in weights if k != "code2wav.code_embedding.weight"])
    # The names are the decoder's own (the prefix stripped), as for the speech tokenizer.
    with pytest.raises(ValueError, match=r"'upsample\.0\.0\.conv\.bias' has shape \(31,\)"):
        model.load_weights(
            [(k, v[:-1] if k == "code2wav.upsample.0.0.conv.bias" else v) for k, v in weights]
        )
    with pytest.raises(ValueError, match="pre_transformer.input_proj.weight"):
        model.load_weights(
            [*weights, ("code2wav.pre_transformer.input_proj.weight", weights[1][1])]
        )


def test_the_real_config_builds_on_meta_with_the_reference_names():
    config = CodecDecoderConfig.from_code2wav({})
    with torch.device("meta"):
        ours = CodecDecoder(config)
        ref = Qwen3OmniMoeCode2Wav(Qwen3OmniMoeCode2WavConfig())
    assert all(p.is_meta for p in ours.parameters())
    shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert shapes == {k: tuple(v.shape) for k, v in ref.state_dict().items()}

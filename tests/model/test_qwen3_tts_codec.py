"""The Qwen3-TTS 12 Hz codec decoder against the reference `Qwen3TTSTokenizerV2Decoder` on a
tiny random checkpoint (CPU, float32): whole decodes, prefixes, windows with left context as
the reference's `chunked_decode` makes them, weight loading, and the real model's shape."""

import dataclasses

import pytest
import torch

from inflight.model.speech.codec_decoder import CodecDecoder, CodecDecoderConfig

from speech_reference import CODEBOOK, GROUPS, reference, tiny_decoder, tiny_decoder_config_dict

TOL = 1e-5


def _checkpoint(ref: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The reference's tensors named as a speech tokenizer checkpoint names them, with an
    encoder tensor that the decoder must skip."""
    weights = [(f"decoder.{k}", v) for k, v in ref.state_dict().items()]
    return [("encoder.x", torch.zeros(3)), *weights]


def _ours(ref: torch.nn.Module, **changes) -> CodecDecoder:
    config = CodecDecoderConfig.from_dict(tiny_decoder_config_dict())
    config = dataclasses.replace(config, **changes)
    model = CodecDecoder(config).eval()
    model.load_weights(_checkpoint(ref))
    return model


def _codes(frames: int, seed: int, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CODEBOOK, (batch, GROUPS, frames), generator=g)


@pytest.fixture(scope="module")
def pair():
    ref = tiny_decoder(0)
    return ref, _ours(ref)


@pytest.mark.parametrize("frames", [10, 37])
def test_matches_the_reference(pair, frames):
    ref, ours = pair
    codes = _codes(frames, seed=frames, batch=2)
    with torch.no_grad():
        expected = ref(codes)[:, 0]
        got = ours(codes)
    assert got.shape == (2, frames * ours.samples_per_frame)
    assert expected.abs().max() > 1e-3  # loud enough for the comparison to mean something
    assert (got - expected).abs().max() <= TOL


def test_a_prefix_decodes_to_a_prefix(pair):
    _, ours = pair
    codes = _codes(10, seed=1)
    with torch.no_grad():
        short, long = ours(codes[..., :8]), ours(codes)
    assert (short - long[:, : 8 * ours.samples_per_frame]).abs().max() <= TOL


def test_windows_match_chunked_decode(pair):
    ref, ours = pair
    codes = _codes(30, seed=2)
    chunk, context = 12, 5
    with torch.no_grad():
        expected = ref.chunked_decode(codes, chunk_size=chunk, left_context_size=context)[0, 0]
    pieces = []
    for start in range(0, 30, chunk):
        ctx = min(context, start)
        pieces.append(ours.decode_window(codes[0, :, start - ctx : start + chunk], ctx))
    got = torch.cat(pieces)
    assert got.shape == expected.shape == (30 * ours.samples_per_frame,)
    assert (got - expected).abs().max() <= TOL


def test_sliding_window_matches_the_reference():
    """Beyond the window (72 frames), with the transformer's layer scales raised so that its
    attention moves the samples well past the tolerance: an off-by-one window would show."""
    ref = tiny_decoder(1)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "layer_scale" in name:
                p.fill_(1.0)
    codes = _codes(90, seed=3)
    with torch.no_grad():
        expected = ref(codes)[:, 0]
        got = _ours(ref)(codes)
        off_by_one = _ours(ref, sliding_window=73)(codes)
    assert (got - expected).abs().max() <= TOL
    assert (off_by_one - expected).abs().max() > 100 * TOL


def test_a_missing_weight_is_named(pair):
    ref, _ = pair
    weights = [(k, v) for k, v in _checkpoint(ref) if k != "decoder.pre_conv.conv.weight"]
    model = CodecDecoder(CodecDecoderConfig.from_dict(tiny_decoder_config_dict()))
    with pytest.raises(ValueError, match="pre_conv.conv.weight"):
        model.load_weights(weights)


def test_from_weights_builds_and_loads(pair):
    ref, ours = pair
    config = CodecDecoderConfig.from_dict(tiny_decoder_config_dict())
    built = CodecDecoder.from_weights(config, _checkpoint(ref))
    codes = _codes(6, seed=4)
    with torch.no_grad():
        assert torch.equal(built(codes), ours(codes))


def test_the_real_config_builds_on_meta_with_the_reference_names():
    config = CodecDecoderConfig.from_dict({})
    assert config.samples_per_frame == 1920
    assert config.num_quantizers == 16
    codec = reference().codec
    with torch.device("meta"):
        ours = CodecDecoder(config)
        # The reference config class has no default codebook_dim (it would raise).
        ref = codec.Qwen3TTSTokenizerV2Decoder(
            codec.Qwen3TTSTokenizerV2DecoderConfig(codebook_dim=config.codebook_dim)
        )
    assert all(p.is_meta for p in ours.parameters())
    shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert shapes == {k: tuple(v.shape) for k, v in ref.state_dict().items()}

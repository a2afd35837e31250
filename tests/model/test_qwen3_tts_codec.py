"""The Qwen3-TTS 12 Hz codec decoder against the reference `Qwen3TTSTokenizerV2Decoder` on a
tiny random checkpoint (CPU, float32): whole decodes, prefixes, windows with left context as
the reference's `chunked_decode` makes them, streamed windows against whole ones, weight
loading, and the real model's shape."""

import dataclasses
import itertools

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


def _loud(seed: int) -> torch.nn.Module:
    """A tiny reference decoder with its transformer's layer scales raised, so that attention
    moves the samples well past the tolerance (a wrong window or position would show), and
    random biases (its init leaves them at zero, where a bias added twice would not show)."""
    ref = tiny_decoder(seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "layer_scale" in name:
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return ref


@pytest.fixture(scope="module")
def pair():
    ref = tiny_decoder(0)
    return ref, _ours(ref)


@pytest.fixture(scope="module")
def loud():
    ref = _loud(1)
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
    ref = _loud(1)
    codes = _codes(90, seed=3)
    with torch.no_grad():
        expected = ref(codes)[:, 0]
        got = _ours(ref)(codes)
        off_by_one = _ours(ref, sliding_window=73)(codes)
    assert (got - expected).abs().max() <= TOL
    assert (off_by_one - expected).abs().max() > 100 * TOL


def _spans(frames: int, context: int, sizes: list[int]) -> list[tuple[int, int]]:
    """The frames after `context` cut into pushes of `sizes` (cycled; the last one cut short)."""
    spans, start = [], context
    for size in itertools.cycle(sizes):
        if start >= frames:
            return spans
        spans.append((start, min(start + size, frames)))
        start += size
    raise AssertionError("unreachable")


def _streamed(
    model: CodecDecoder, codes: torch.Tensor, context: int, sizes: list[int]
) -> tuple[torch.Tensor, dict]:
    """Frames [groups, n] streamed after their first `context` in pushes of `sizes`: the
    samples and the stream's final state."""
    stream = model.stream(codes[:, :context])
    pieces = [stream.push(codes[:, a:b]) for a, b in _spans(codes.shape[1], context, sizes)]
    return torch.cat(pieces), stream.state


def _mixed_sizes(seed: int) -> list[int]:
    return torch.randint(1, 9, (16,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("context", [0, 5, 25])
@pytest.mark.parametrize("sizes", [[1], [3], "mixed"])
def test_a_stream_matches_decode_window(loud, context, sizes):
    _, ours = loud
    codes = _codes(40, seed=context)[0]
    expected = ours.decode_window(codes, context)
    got, _ = _streamed(ours, codes, context, _mixed_sizes(context) if sizes == "mixed" else sizes)
    assert got.shape == expected.shape == ((40 - context) * ours.samples_per_frame,)
    assert expected.abs().max() > 1e-2
    # Measured: up to 2.4e-7 (samples peak near 0.4).
    assert (got - expected).abs().max() <= TOL


def test_a_stream_beyond_the_sliding_window(loud):
    """90 frames, past the 72-frame window: the kept keys, the mask and the rope positions
    matter, and a stream with a window one frame too wide decodes far off."""
    ref, ours = loud
    codes = _codes(90, seed=3)[0]
    sizes = [1, 4, 7, 2]
    for context in (0, 25):
        expected = ours.decode_window(codes, context)
        got, state = _streamed(ours, codes, context, sizes)
        assert (got - expected).abs().max() <= TOL
        # Each attention keeps the window's earlier keys: the next query itself is the last.
        window = ours.config.sliding_window
        for layer in ours.pre_transformer.layers:
            keys, values = state[layer.self_attn]
            assert keys.shape[2] == values.shape[2] == window - 1
        wrong, _ = _streamed(_ours(ref, sliding_window=window + 1), codes, context, sizes)
        assert (wrong - expected).abs().max() > 100 * TOL


def test_interleaved_streams_keep_their_own_state(loud):
    _, ours = loud
    a, b = _codes(30, seed=10)[0], _codes(34, seed=11)[0]
    alone_a, _ = _streamed(ours, a, 5, [3])
    alone_b, _ = _streamed(ours, b, 0, [2, 5])
    stream_a, stream_b = ours.stream(a[:, :5]), ours.stream(b[:, :0])
    got_a, got_b = [], []
    pushes = itertools.zip_longest(_spans(30, 5, [3]), _spans(34, 0, [2, 5]))
    for i, (span_a, span_b) in enumerate(pushes):
        if span_a:
            got_a.append(stream_a.push(a[:, span_a[0] : span_a[1]]))
        if span_b:
            got_b.append(stream_b.push(b[:, span_b[0] : span_b[1]]))
        if i == 3:  # an empty push: no samples, and nothing changes
            assert stream_a.push(a[:, :0]).shape == (0,)
    assert torch.equal(torch.cat(got_a), alone_a)
    assert torch.equal(torch.cat(got_b), alone_b)


def test_a_bf16_stream_matches_decode_window(loud):
    ref, _ = loud
    ours = _ours(ref).to(torch.bfloat16)
    codes = _codes(40, seed=12)[0]
    expected = ours.decode_window(codes, 5)
    got, _ = _streamed(ours, codes, 5, [1, 4, 7, 2])
    assert got.dtype == expected.dtype == torch.bfloat16
    assert expected.abs().max() > 0.1
    # Measured: 5.9e-3 here, 1.1e-2 at worst (90 frames pushed one at a time), on samples
    # peaking at 0.4: the size of bf16's own error against float32 (5.4e-3 to 7.3e-3).
    assert (got.float() - expected.float()).abs().max() <= 3e-2


def test_a_missing_weight_is_named(pair):
    ref, _ = pair
    weights = [(k, v) for k, v in _checkpoint(ref) if k != "decoder.pre_conv.conv.weight"]
    model = CodecDecoder(CodecDecoderConfig.from_dict(tiny_decoder_config_dict()))
    with pytest.raises(ValueError, match="pre_conv.conv.weight"):
        model.load_weights(weights)


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

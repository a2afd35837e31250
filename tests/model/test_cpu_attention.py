"""The CPU attention backend's native kernel against the torch reference backend, and the bits of
a token whatever its chunk; with attention windows too."""

import pytest
import torch

from inflight.model.attention import TorchAttentionBackend
from inflight.model.attention.cpu import CpuAttentionBackend
from inflight.model.kernels.cpu.attention import paged_attention
from inflight.runtime.device.batch_builder import RowInput, build_ragged_batch
from inflight.runtime.runtime import DeploymentOptions, Runtime

from helpers import scattered_step, windowed_steps

pytestmark = pytest.mark.usefixtures("two_threads")  # their work split, as on two cores


def _step(shapes, heads, kv_heads, dim, block_size=16, num_blocks=160, seed=0):
    """A ragged step over scattered blocks: (query length, past length) per row."""
    torch.manual_seed(seed)
    meta = scattered_step(shapes, block_size, num_blocks, seed)
    tokens = sum(q for q, _ in shapes)
    # q comes as a strided view, as the model's split of the fused qkv projection gives it.
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k, v = (torch.randn(tokens, kv_heads, dim) for _ in range(2))
    cache = tuple(torch.randn(kv_heads, num_blocks * block_size, dim) for _ in range(2))
    return q, k, v, cache, meta


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 32), (8, 1, 128)])
def test_decode_and_prefill_rows_match_the_reference(heads, kv_heads, dim):
    shapes = [(1, 0), (1, 15), (1, 16), (1, 63), (1, 200), (1, 700), (37, 0), (20, 45), (1, 3)]
    shapes += [(70, 130), (3, 500)]
    q, k, v, cache, meta = _step(shapes, heads, kv_heads, dim)
    scale = dim**-0.5
    expected_cache = tuple(c.clone() for c in cache)
    expected = TorchAttentionBackend().forward(q, k, v, expected_cache, meta, scale)
    got = CpuAttentionBackend().forward(q, k, v, cache, meta, scale)
    assert meta.num_decodes == 6
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(cache, expected_cache, strict=True))


@pytest.mark.parametrize("window", [1, 7, 40, 300])
def test_windowed_rows_match_the_reference_and_read_no_block_before_their_window(window):
    """Each query over the last `window` keys up to its own: decode rows and prefill chunks
    (some whose first query's window starts inside their chunk, some wider than their keys)
    as the reference computes them. The table entries before each row's window name a block of
    NaN (as a block given back and reused holds anything): no kernel reads it."""
    torch.manual_seed(2)
    heads, kv_heads, dim, size = 8, 2, 32, 16
    shapes = [(1, 0), (1, 15), (1, 64), (1, 700), (37, 0), (20, 45), (70, 130), (3, 500)]
    meta, poisoned = windowed_steps(shapes, size, 160, window)
    tokens = sum(q for q, _ in shapes)
    q = torch.randn(tokens, heads, dim)
    k, v = torch.randn(tokens, kv_heads, dim), torch.randn(tokens, kv_heads, dim)
    cache = tuple(torch.randn(kv_heads, 160 * size, dim) for _ in range(2))
    want = TorchAttentionBackend().forward(q, k, v, cache, meta, 0.2, window)
    for c in cache:
        c[:, :size] = float("nan")
    got = CpuAttentionBackend().forward(q, k, v, cache, poisoned, 0.2, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 40])
def test_sinks_match_the_reference_and_weigh_no_value(window):
    """A logit per query head (gpt-oss's sinks) joins each of the head's softmaxes as one more
    score: the kernel matches the reference's explicit extra column, in decode rows and
    prefill chunks; the keys' weights then sum to less than one (values of ones attend to
    less than one); a sink of -inf is no sink, bit for bit."""
    shapes = [(1, 0), (1, 15), (1, 700), (37, 0), (20, 45), (70, 130)]
    q, k, v, cache, meta = _step(shapes, 8, 2, 32, seed=4)
    sinks = torch.randn(8) * 2
    backend = CpuAttentionBackend()

    def attend(backend, sinks, values=None):
        caches = tuple(c.clone() for c in cache)
        return backend.forward(
            q, k, v if values is None else values, caches, meta, 0.2, window, sinks
        )

    want = attend(TorchAttentionBackend(), sinks)
    got = attend(backend, sinks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plain = attend(backend, None)
    assert (got - plain).abs().max() > 1e-2
    assert torch.equal(attend(backend, torch.full((8,), float("-inf"))), plain)
    ones = torch.ones_like(cache[1])
    cache_ones = (cache[0].clone(), ones)
    total = backend.forward(q, k, torch.ones_like(v), cache_ones, meta, 0.2, window, sinks)
    assert total.max() < 1 and total.min() > 0


# A sequence's tokens as the rows of one step, each row a span [start, end) of them, decode rows
# first: the whole prompt; a tail after a prefix already in the cache, as a context-cache hit
# leaves it (1 or 3 tokens: a chat's last block); chunks beside decode rows; one decode row per
# token (as speculative verification and CUDA graph unfolding pack them).
SPLITS = {
    "whole": [(0, 70)],
    "cached prefix, 1 new": [(69, 70)],
    "cached prefix, 3 new": [(67, 70)],
    "cached prefix, 17 new": [(53, 70)],
    "mixed": [(66, 67), (67, 68), (68, 69), (69, 70), (0, 31), (31, 66)],
    "token by token": [(t, t + 1) for t in range(70)],
}


@pytest.mark.parametrize("window", [None, 9, 40])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 32), (8, 1, 128)])
def test_a_token_gets_the_same_bits_however_its_prompt_is_split(heads, kv_heads, dim, window):
    """Each token's attention, bit for bit, in every split of its prompt, and beside a row long
    enough to shrink the kernel's tiles (without a window); with a window too, its keys then
    starting anywhere in a tile. Prefill chunks used to go through torch's fused
    attention, whose blocking and masking follow the chunk's shape: a cache hit's first token
    came out a few ulps away from the whole prompt's, and the quantized kernels' per-token int8
    activations made other tokens of it."""
    torch.manual_seed(0)
    n, block_size = 70, 16
    table = [11, 3, 8, 0, 5]  # scattered blocks
    q = torch.randn(n, heads, dim)
    k, v = torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)
    cache = tuple(torch.zeros(kv_heads, 200 * block_size, dim) for _ in range(2))
    backend = CpuAttentionBackend()

    def attend(spans, long_row=False):
        rows = [RowInput([0] * (end - start), start, table, True) for start, end in spans]
        tokens = torch.cat([torch.arange(start, end) for start, end in spans])
        if long_row:  # 3000 tokens of other keys: max_seq_len and so the tiles change
            rows.append(RowInput([0], 2999, list(range(10, 198)), True))
            tokens = torch.cat([tokens, tokens[-1:]])
        meta = build_ragged_batch(rows, block_size, torch.device("cpu")).forward.attention
        out = backend.forward(q[tokens], k[tokens], v[tokens], cache, meta, dim**-0.5, window)
        return out[: len(tokens) - long_row], tokens[: len(tokens) - long_row]

    whole, _ = attend(SPLITS["whole"])
    for name, spans in SPLITS.items():
        for long_row in (False, True):
            out, tokens = attend(spans, long_row)
            assert torch.equal(out, whole[tokens]), (name, long_row)


@pytest.mark.parametrize("window", [None, 50])
def test_a_row_gets_the_same_bits_alone_or_batched(window):
    shapes = [(1, 40), (1, 300), (1, 7), (1, 129)]
    q, k, v, cache, meta = _step(shapes, 9, 3, 64, seed=1)
    backend = CpuAttentionBackend()
    batched = backend.forward(q, k, v, tuple(c.clone() for c in cache), meta, 0.125, window)
    for i, (qlen, past) in enumerate(shapes):
        block_size = meta.block_size
        table = meta.block_tables[i, : -(-(qlen + past) // block_size)].tolist()
        alone = build_ragged_batch(
            [RowInput([0], past, table, True)], block_size, torch.device("cpu")
        ).forward.attention
        one = backend.forward(
            q[i : i + 1],
            k[i : i + 1],
            v[i : i + 1],
            tuple(c.clone() for c in cache),
            alone,
            0.125,
            window,
        )
        assert torch.equal(one[0], batched[i])


def test_runtime_picks_it_for_float32_on_the_cpu(tiny_dirs):
    runtime = Runtime(tiny_dirs["llama"], DeploymentOptions(device="cpu", max_model_len=64))
    assert isinstance(runtime.executor.runner.caches.backend, CpuAttentionBackend)
    with pytest.raises(ValueError, match="float32 on the CPU"):
        Runtime(
            tiny_dirs["llama"],
            DeploymentOptions(device="cpu", dtype="bfloat16", attention_backend="cpu"),
        )
    reference = Runtime(
        tiny_dirs["llama"],
        DeploymentOptions(device="cpu", max_model_len=64, attention_backend="torch"),
    )
    assert type(reference.executor.runner.caches.backend) is TorchAttentionBackend


def test_kernel_rejects_a_head_dim_it_cannot_vectorize():
    q, k, v, cache, meta = _step([(1, 20), (1, 5)], 4, 2, 12)
    with pytest.raises(ValueError, match="head_dim multiple of 8, got 12"):
        paged_attention(CpuAttentionBackend().library, q, cache, meta, 0.3, torch.empty(q.shape))

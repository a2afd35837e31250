"""The CPU attention backend's native decode kernel against the torch reference backend."""

import pytest
import torch

from inflight.model.attention import TorchAttentionBackend
from inflight.model.attention.cpu import CpuAttentionBackend
from inflight.model.kernels.cpu.attention import decode_attention
from inflight.runtime.device.batch_builder import RowInput, build_ragged_batch
from inflight.runtime.runtime import DeploymentOptions, Runtime

from helpers import scattered_step


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
def test_decode_rows_match_the_reference(heads, kv_heads, dim):
    shapes = [(1, 0), (1, 15), (1, 16), (1, 63), (1, 200), (1, 700), (37, 0), (20, 45), (1, 3)]
    q, k, v, cache, meta = _step(shapes, heads, kv_heads, dim)
    scale = dim**-0.5
    expected_cache = tuple(c.clone() for c in cache)
    expected = TorchAttentionBackend().forward(q, k, v, expected_cache, meta, scale)
    got = CpuAttentionBackend().forward(q, k, v, cache, meta, scale)
    assert meta.num_decodes == 6
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(cache, expected_cache, strict=True))


def test_a_row_gets_the_same_bits_alone_or_batched():
    shapes = [(1, 40), (1, 300), (1, 7), (1, 129)]
    q, k, v, cache, meta = _step(shapes, 9, 3, 64, seed=1)
    backend = CpuAttentionBackend()
    batched = backend.forward(q, k, v, tuple(c.clone() for c in cache), meta, 0.125)
    for i, (qlen, past) in enumerate(shapes):
        block_size = meta.block_size
        table = meta.block_tables[i, : -(-(qlen + past) // block_size)].tolist()
        alone = build_ragged_batch(
            [RowInput([0], past, table, True)], block_size, torch.device("cpu")
        ).forward.attention
        one = backend.forward(
            q[i : i + 1], k[i : i + 1], v[i : i + 1], tuple(c.clone() for c in cache), alone, 0.125
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
        decode_attention(CpuAttentionBackend().library, q, cache, meta, 0.3, torch.empty(q.shape))

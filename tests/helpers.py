"""Assertions and set-ups shared by the tests."""

import contextlib
from collections.abc import Iterator

import torch

from inflight.model.attention import AttentionMetadata, TorchAttentionBackend


def assert_no_leaks(runtime) -> None:
    """Every KV block and resident slot is free again (DESIGN invariant 11)."""
    assert runtime.blocks.num_free == runtime.blocks.num_blocks, "KV blocks leaked"
    assert runtime.slots.num_free == runtime.slots.capacity, "resident slots leaked"


def prefill_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one sequence prefilled from an empty cache."""
    cfg, backend, tokens, block_size = model.config, TorchAttentionBackend(), len(ids), 16
    blocks = -(-tokens // block_size)
    shape = backend.kv_cache_shape(blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, tokens], dtype=torch.int32),
        seq_lens=torch.tensor([tokens], dtype=torch.int32),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        slot_mapping=torch.arange(tokens),
        num_decodes=0,
        block_size=block_size,
        max_query_len=tokens,
        max_seq_len=tokens,
        query_lens_host=[tokens],
        seq_lens_host=[tokens],
        contiguous_kv_host=[0],
    )
    backend.plan(meta)
    with torch.no_grad():
        hidden = model(torch.tensor(ids), torch.arange(tokens), caches, meta, backend)
        return model.compute_logits(hidden)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's (and so the native kernels') thread count set to n inside the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)

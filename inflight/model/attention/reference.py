"""The reference attention backend: plain torch ops, runs anywhere; the test oracle."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inflight.model.metadata import AttentionMetadata, KVCache


class TorchAttentionBackend:
    """The reference backend: plain torch ops, runs anywhere, used on CPU and as the test oracle.

    The cache is head-major, [num_kv_heads, num_blocks * block_size, head_dim], so that a
    sequence whose blocks form one contiguous run is, for every head, one contiguous stretch of
    memory, read in place; a sequence with scattered blocks is gathered first. Each sequence
    attends on its own, so its result never depends on what else shares the step. A layer with
    a window reads only the keys its queries see, so that blocks before them may have been
    given back.
    """

    takes_qkv = False

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return (num_kv_heads, num_blocks * block_size, head_dim)

    def plan(self, meta: AttentionMetadata) -> None:
        """Nothing to derive: every sequence is attended on its own."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.store(k, v, kv_cache, meta)
        out = torch.empty_like(q)
        self.attend_rows(q, kv_cache, meta, scale, out, 0, window, sinks)
        return out

    @staticmethod
    def store(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> None:
        k_cache, v_cache = kv_cache
        k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))

    @staticmethod
    def attend_rows(
        q: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
        first_row: int,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """Attend the rows from `first_row` on, one sequence at a time, into `out`; with a
        `window`, a query at position p over keys p - window + 1 .. p; with `sinks` [Hq], each
        head's logit joins its softmaxes as one more score."""
        k_cache, v_cache = kv_cache
        start = sum(meta.query_lens_host[:first_row])
        for row in range(first_row, len(meta.query_lens_host)):
            qlen, seq_len = meta.query_lens_host[row], meta.seq_lens_host[row]
            past = seq_len - qlen
            # The first key the row's first query sees.
            lo = 0 if window is None else max(0, past - window + 1)
            first = meta.contiguous_kv_host[row]
            if first is not None:
                keys = k_cache[:, first + lo : first + seq_len]
                values = v_cache[:, first + lo : first + seq_len]
            else:
                slots = _slots(meta, row, lo, seq_len)
                keys, values = k_cache[:, slots], v_cache[:, slots]
            out[start : start + qlen] = _attend(
                q[start : start + qlen], keys, values, past - lo, scale, window, sinks
            )
            start += qlen


def _slots(meta: AttentionMetadata, row: int, lo: int, seq_len: int) -> torch.Tensor:
    """The KV slots of a sequence's tokens lo .. seq_len - 1, from its block table."""
    block_size = meta.block_size
    first = lo // block_size
    blocks = meta.block_tables[row, first : -(-seq_len // block_size)].to(torch.int64)
    offsets = torch.arange(block_size, device=blocks.device)
    slots = (blocks[:, None] * block_size + offsets).flatten()
    return slots[lo - first * block_size : seq_len - first * block_size]


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    past: int,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of q [Q, Hq, D] over keys/values [Hkv, past + Q, D]; with a `window`,
    each query over the last `window` keys up to its own; with `sinks`, as `_attend_sinks`."""
    qlen, seq_len = q.shape[0], keys.shape[1]
    if sinks is not None:
        visible = _visible(qlen, seq_len, past, window, q.device)
        return _attend_sinks(q, keys, values, visible, scale, sinks)
    if qlen == 1 and (window is None or seq_len <= window):
        mask, causal = None, False  # one query sees every key
    elif past == 0 and window is None:
        mask, causal = None, True
    else:
        mask, causal = _visible(qlen, seq_len, past, window, q.device), False
    # 4-D [1, heads, tokens, dim]: the fused CPU kernel takes nothing else.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        keys.unsqueeze(0),
        values.unsqueeze(0),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def _visible(
    qlen: int, seq_len: int, past: int, window: int | None, device: torch.device
) -> torch.Tensor:
    """[Q, S]: whether query i (at position past + i) sees key j: j <= past + i, and with a
    `window`, j > past + i - window."""
    rows = torch.arange(qlen, device=device)[:, None] + past
    keys_at = torch.arange(seq_len, device=device)[None, :]
    visible = keys_at <= rows
    if window is not None:
        visible &= keys_at > rows - window
    return visible


def _attend_sinks(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """Attention of q [Q, Hq, D] over the keys `visible` [Q, S] marks, where each head's sink
    logit joins the softmax as one more score that weights no value, so the weights of the
    keys sum to less than one (gpt-oss). torch's fused attention has no such term."""
    group = q.shape[1] // keys.shape[0]
    keys = keys.repeat_interleave(group, dim=0)
    values = values.repeat_interleave(group, dim=0)
    scores = torch.matmul(q.transpose(0, 1), keys.transpose(1, 2)) * scale  # [Hq, Q, S]
    scores = scores.masked_fill(~visible, float("-inf"))
    sink = sinks.to(scores.dtype)[:, None, None].expand(-1, scores.shape[1], 1)
    weights = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
    return torch.matmul(weights, values).transpose(0, 1)

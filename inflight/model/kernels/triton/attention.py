"""Triton paged-attention kernels over the KV cache layout of `attention/triton.py`.

Cache layout: [num_blocks, block_size, num_kv_heads, head_dim] per layer (a block holds every
head's keys for `block_size` consecutive positions). Two kernels:

- decode: one program per (decode row, KV head) walks the row's blocks with an online softmax,
  for all the query heads that share that KV head at once; with few rows, each row's keys are
  split into parts walked side by side (flash decoding) and a small kernel merges the parts;
  a float8 cache's keys and values are read in two halves of the head (`_attend_keys_halves`);
- prefill: one program per (BLOCK_M queries of a prefill chunk, query head) attends over the
  chunk's past (read through the block table) and, causally, over the chunk itself. Which
  program serves which queries is planned on the host once per step (`plan.py`).

A layer with attention sinks (gpt-oss: a logit per query head, `HAS_SINKS`) counts each head's
sink as one more score of its softmax that weights no value: it joins the running max and sum
once, where a program (or the merge of a row's parts) normalizes.

A layer with an attention window W (`WINDOW`, a compile-time constant: 0 for full attention,
which then compiles as before) has a query at position p see keys p - W + 1 .. p: the kernels
walk only the blocks holding those, so blocks before them are never read.

The block tables' row stride (the step's longest table) is not specialized on: Triton compiles a
kernel per case of an integer argument (1, a multiple of 16, other), and each new case met while
serving would stall its step for the half second a compile takes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inflight.model.kernels.cuda import fp8_decode
from inflight.model.kernels.triton.plan import (
    PrefillPlan,
    StepPlan,
    decode_splits,
    multiprocessors,
)
from inflight.model.metadata import AttentionMetadata

# Keys per decode iteration: 128 for whole rows (on an H200, 256 rows of ~840 keys at 79 % of
# HBM bandwidth, against 71-74 % with 64); 64 where a row's keys are split in more than 2 parts,
# which are short (16 rows split in 16: 37 us against 92 with 128). bench/decode_attention.py.
DECODE_BLOCK_N = 128
SPLIT_BLOCK_N = 64
PREFILL_BLOCK_N = 64
MAX_GRID_ROWS = 65_535  # CUDA's limit on a grid's y and z axes


@triton.jit
def _attend_keys(
    q, q_pos, K, V, block_table, kv_head, start, end, m_i, l_i, acc, scale,
    stride_kb, stride_ks, stride_kh,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """One online-softmax update over keys [start, start + BLOCK_N) (those below `end`), read
    through the sequence's block table; with CAUSAL, query i sees keys up to q_pos[i], and with
    a WINDOW too, only those above q_pos[i] - WINDOW (without CAUSAL, q_pos is not read).
    Without MASKED the caller knows every query sees every key of the tile (below `end` too):
    nothing is masked, the same scores as masking none."""
    d = tl.arange(0, HEAD_DIM)
    tok = start + tl.arange(0, BLOCK_N)
    if MASKED:
        valid = tok < end
        block = tl.load(block_table + tok // BLOCK_SIZE, mask=valid, other=0)
    else:
        block = tl.load(block_table + tok // BLOCK_SIZE)
    offs = block.to(tl.int64) * stride_kb + (tok % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
    # A float8 cache is read up to q's dtype (a no-op for a cache in q's).
    if MASKED:
        k = tl.load(K + offs[:, None] + d[None, :], mask=valid[:, None], other=0.0).to(q.dtype)
    else:
        k = tl.load(K + offs[:, None] + d[None, :]).to(q.dtype)
    s = tl.dot(q, tl.trans(k)) * scale
    if MASKED:
        if CAUSAL:
            seen = (tok[None, :] <= q_pos[:, None]) & valid[None, :]
            if WINDOW > 0:
                seen &= tok[None, :] > q_pos[:, None] - WINDOW
            s = tl.where(seen, s, float("-inf"))
        else:
            s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(V + offs[:, None] + d[None, :], mask=valid[:, None], other=0.0).to(q.dtype)
    else:
        v = tl.load(V + offs[:, None] + d[None, :]).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _attend_keys_halves(
    q_lo, q_hi, K, V, block_table, kv_head, start, end, m_i, l_i, acc_lo, acc_hi, scale,
    stride_kb, stride_ks, stride_kh,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """`_attend_keys` for decode rows, each key and value read and widened in two halves of the
    head's dimensions, each just before its dot: a float8 cache's keys widened whole held 220
    registers a thread (12.5 % occupancy on an H200); a copy of this loop ran 14 % faster there.
    The dots sum the halves in the order the whole dot does (there: the same bits)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    d_lo = tl.arange(0, HALF)
    d_hi = HALF + d_lo
    tok = start + tl.arange(0, BLOCK_N)
    valid = tok < end
    block = tl.load(block_table + tok // BLOCK_SIZE, mask=valid, other=0)
    offs = block.to(tl.int64) * stride_kb + (tok % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
    k = tl.load(K + offs[:, None] + d_lo[None, :], mask=valid[:, None], other=0.0)
    s = tl.dot(q_lo, tl.trans(k.to(q_lo.dtype)))
    k = tl.load(K + offs[:, None] + d_hi[None, :], mask=valid[:, None], other=0.0)
    s = tl.dot(q_hi, tl.trans(k.to(q_hi.dtype)), s) * scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(q_lo.dtype)
    v = tl.load(V + offs[:, None] + d_lo[None, :], mask=valid[:, None], other=0.0)
    acc_lo = acc_lo * alpha[:, None] + tl.dot(p, v.to(q_lo.dtype))
    v = tl.load(V + offs[:, None] + d_hi[None, :], mask=valid[:, None], other=0.0)
    acc_hi = acc_hi * alpha[:, None] + tl.dot(p, v.to(q_hi.dtype))
    return m_new, l_i, acc_lo, acc_hi


@triton.jit
def _finish_decode(
    m_i, l_i, acc, d, Out, PARTS, SINKS, row, heads, g, split, stride_ot, stride_oh,
    HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):  # fmt: skip
    """Store a decode program's output for the dimensions `d`: normalized where the row's keys
    are in one part, else unnormalized into its part (the running max and sum go beside it)."""
    if SPLITS == 1:
        # Padding heads past the group read the sink of a real head (of the next KV head's, or
        # the last): never stored.
        out = _normalize(m_i, l_i, acc, SINKS, tl.minimum(heads, HEADS - 1), HAS_SINKS)
        tl.store(
            Out + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
            out.to(Out.dtype.element_ty),
            mask=(g < GROUP)[:, None],
        )
    else:
        at = (row * HEADS + heads) * SPLITS + split
        tl.store(PARTS + at[:, None] * HEAD_DIM + d[None, :], acc, mask=(g < GROUP)[:, None])


@triton.jit
def _normalize(m_i, l_i, acc, SINKS, heads, HAS_SINKS: tl.constexpr):
    """acc / l_i: the attention output of an online softmax's running state, with `heads`'
    sinks as one more score each."""
    if HAS_SINKS:
        sink = tl.load(SINKS + heads).to(tl.float32)
        m = tl.maximum(m_i, sink)
        alpha = tl.exp(m_i - m)
        return acc * alpha[:, None] / (l_i * alpha + tl.exp(sink - m))[:, None]
    return acc / l_i[:, None]


@triton.jit(do_not_specialize=["stride_bt"])
def _decode_kernel(
    Q, K, V, Out, PARTS, STATS, block_tables, seq_lens, scale, SINKS,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ot, stride_oh,
    HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
    WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, ORDER, ORDERED: tl.constexpr,
    HALVES: tl.constexpr,
):  # fmt: skip
    # A row's KV heads are neighbours in the launch order, so the programs reading a block's
    # tokens of every head run together (on an H200 4-9 % faster than rows first over blocks
    # scattered through the cache; bench/RESULTS.md).
    kv_head = tl.program_id(0)
    row = tl.program_id(1)
    if ORDERED:  # programs take the rows longest first: the last wave is of short ones
        row = tl.load(ORDER + row)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + row)
    lo = 0  # the first key the row's query sees
    if WINDOW > 0:
        lo = tl.maximum(seq_len - WINDOW, 0)
    g = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + g
    # This program's part of the keys: whole BLOCK_N tiles, the last parts possibly empty.
    part = tl.cdiv(tl.cdiv(seq_len - lo, SPLITS), BLOCK_N) * BLOCK_N
    first = lo + split * part
    end = tl.minimum(seq_len, first + part)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    table = block_tables + row * stride_bt
    q_at = Q + row * stride_qt + heads[:, None] * stride_qh
    if HALVES:
        HALF: tl.constexpr = HEAD_DIM // 2
        d_lo = tl.arange(0, HALF)
        d_hi = HALF + d_lo
        q_lo = tl.load(q_at + d_lo[None, :], mask=(g < GROUP)[:, None], other=0.0)
        q_hi = tl.load(q_at + d_hi[None, :], mask=(g < GROUP)[:, None], other=0.0)
        if K.dtype.element_ty == tl.float8e4nv:  # as q below
            q_lo = q_lo.to(tl.float16)
            q_hi = q_hi.to(tl.float16)
        acc_lo = tl.zeros([GROUP_PAD, HALF], tl.float32)
        acc_hi = tl.zeros([GROUP_PAD, HALF], tl.float32)
        for start in range(first, end, BLOCK_N):
            m_i, l_i, acc_lo, acc_hi = _attend_keys_halves(
                q_lo, q_hi, K, V, table, kv_head, start, end, m_i, l_i, acc_lo, acc_hi, scale,
                stride_kb, stride_ks, stride_kh,
                HEAD_DIM=HEAD_DIM, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=BLOCK_N,
            )  # fmt: skip
        _finish_decode(
            m_i, l_i, acc_lo, d_lo, Out, PARTS, SINKS, row, heads, g, split, stride_ot, stride_oh,
            HEADS=HEADS, GROUP=GROUP, HEAD_DIM=HEAD_DIM, SPLITS=SPLITS, HAS_SINKS=HAS_SINKS,
        )  # fmt: skip
        _finish_decode(
            m_i, l_i, acc_hi, d_hi, Out, PARTS, SINKS, row, heads, g, split, stride_ot, stride_oh,
            HEADS=HEADS, GROUP=GROUP, HEAD_DIM=HEAD_DIM, SPLITS=SPLITS, HAS_SINKS=HAS_SINKS,
        )  # fmt: skip
    else:
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_at + d[None, :], mask=(g < GROUP)[:, None], other=0.0)
        if K.dtype.element_ty == tl.float8e4nv:
            # float8 widens to float16 in one instruction (to bfloat16 in several): the dots
            # run in float16, which holds q's bfloat16 values and the probabilities more finely.
            q = q.to(tl.float16)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for start in range(first, end, BLOCK_N):
            m_i, l_i, acc = _attend_keys(
                q, seq_len, K, V, table, kv_head, start, end,
                m_i, l_i, acc, scale, stride_kb, stride_ks, stride_kh,
                CAUSAL=False, WINDOW=0, HEAD_DIM=HEAD_DIM, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=BLOCK_N,
                MASKED=True,
            )  # fmt: skip
        _finish_decode(
            m_i, l_i, acc, d, Out, PARTS, SINKS, row, heads, g, split, stride_ot, stride_oh,
            HEADS=HEADS, GROUP=GROUP, HEAD_DIM=HEAD_DIM, SPLITS=SPLITS, HAS_SINKS=HAS_SINKS,
        )  # fmt: skip
    if SPLITS > 1:
        # The part's running max and sum, by which `_merge_kernel` weighs it.
        at = (row * HEADS + heads) * SPLITS + split
        tl.store(STATS + at * 2, m_i, mask=g < GROUP)
        tl.store(STATS + at * 2 + 1, l_i, mask=g < GROUP)


@triton.jit
def _merge_kernel(
    PARTS, STATS, Out, SINKS, stride_ot, stride_oh,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, HEAD_DIM)
    at = (row * HEADS + head) * SPLITS + s
    m = tl.load(STATS + at * 2)
    l = tl.load(STATS + at * 2 + 1)  # noqa: E741
    top = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(SINKS + head).to(tl.float32)
        top = tl.maximum(top, sink)
    weight = tl.exp(m - top)  # an empty part (max -inf) weighs 0
    acc = tl.load(PARTS + at[:, None] * HEAD_DIM + d[None, :])
    total = tl.sum(l * weight, 0)
    if HAS_SINKS:
        total += tl.exp(sink - top)
    out = tl.sum(acc * weight[:, None], 0) / total
    tl.store(Out + row * stride_ot + head * stride_oh + d, out.to(Out.dtype.element_ty))


@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    Q, K, V, Out, block_tables, query_start, seq_lens, query_lens, prog_rows, prog_starts, scale,
    SINKS,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
):  # fmt: skip
    prog = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    row = tl.load(prog_rows + prog)
    q_start = tl.load(prog_starts + prog)  # first query of this program, within the chunk
    q_len = tl.load(query_lens + row)
    seq_len = tl.load(seq_lens + row)
    past = seq_len - q_len
    first = tl.load(query_start + row)
    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    q_idx = q_start + m
    q_valid = q_idx < q_len
    q = tl.load(
        Q + (first + q_idx)[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=q_valid[:, None],
        other=0.0,
    )
    # Absolute positions: query i sees keys 0..q_pos[i]. Padding queries past the chunk take
    # its last query's (their rows are never stored): with a window, one of their own could
    # see no key of the first BLOCK_N, whose update would then be exp(-inf - -inf), NaN.
    q_pos = past + tl.minimum(q_idx, q_len - 1)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    end = tl.minimum(seq_len, past + q_start + BLOCK_M)
    # From the first key of the program's first query: with BLOCK_M <= BLOCK_N, the first
    # BLOCK_N keys hold some that each query sees (its running max is finite from there on).
    table = block_tables + row * stride_bt
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(past + q_start - WINDOW + 1, 0)
    else:
        # Keys up to past + q_start are seen by every query of the program: the whole tiles of
        # them go without masks (most of a long prompt's), the rest with.
        whole = (past + q_start + 1) // BLOCK_N * BLOCK_N
        for start in range(0, whole, BLOCK_N):
            m_i, l_i, acc = _attend_keys(
                q, q_pos, K, V, table, kv_head, start, end,
                m_i, l_i, acc, scale, stride_kb, stride_ks, stride_kh,
                CAUSAL=True, WINDOW=WINDOW, HEAD_DIM=HEAD_DIM, BLOCK_SIZE=BLOCK_SIZE,
                BLOCK_N=BLOCK_N, MASKED=False,
            )  # fmt: skip
        lo = whole
    for start in range(lo, end, BLOCK_N):
        m_i, l_i, acc = _attend_keys(
            q, q_pos, K, V, table, kv_head, start, end,
            m_i, l_i, acc, scale, stride_kb, stride_ks, stride_kh,
            CAUSAL=True, WINDOW=WINDOW, HEAD_DIM=HEAD_DIM, BLOCK_SIZE=BLOCK_SIZE,
            BLOCK_N=BLOCK_N, MASKED=True,
        )  # fmt: skip
    out = _normalize(m_i, l_i, acc, SINKS, head + tl.zeros([BLOCK_M], tl.int32), HAS_SINKS)
    tl.store(
        Out + (first + q_idx)[:, None] * stride_ot + head * stride_oh + d[None, :],
        out.to(Out.dtype.element_ty),
        mask=q_valid[:, None],
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    splits: int | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attend q [T, Hq, D] over the caches [blocks, block_size, Hkv, D]: the decode rows with
    the decode kernel (their keys in `splits` parts, by default as `decode_splits` chooses for
    this device), the prefill chunks with the programs planned in `meta.plan`; with a `window`,
    a query at position p over keys p - window + 1 .. p; with `sinks` [Hq], each head's logit
    joins its softmaxes as one more score."""
    out = torch.empty_like(q)
    step: StepPlan | None = meta.plan
    if meta.num_decodes:
        decode_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, out, meta.num_decodes, scale,
            splits=splits, window=window, sinks=sinks,
            order=None if step is None else step.decode_order,
        )  # fmt: skip
    if step is not None and step.prefill is not None:
        prefill_attention(q, k_cache, v_cache, meta, step.prefill, out, scale, window, sinks)
    return out


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    plan: PrefillPlan,
    out: torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    block_n: int = PREFILL_BLOCK_N,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> None:
    """Write into `out` the causal attention of the prefill chunks' queries, by the programs
    `plan` lays out (`plan.block_m` queries each). The default launch settings are those the
    backend serves with (bench/prefill_attention.py sweeps them; `num_stages` None: Triton's
    default)."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if window and plan.block_m > block_n:
        # A program's first keys must hold some that each of its queries sees (`_prefill_kernel`).
        raise ValueError(
            f"a windowed prefill takes block_m <= block_n, not {plan.block_m} > {block_n}"
        )
    stages = {} if num_stages is None else {"num_stages": num_stages}
    _prefill_kernel[(plan.programs, q.shape[1])](
        q, k_cache, v_cache, out, meta.block_tables, meta.query_start_loc,
        meta.seq_lens, plan.query_lens, plan.rows, plan.starts, scale,
        out if sinks is None else sinks,  # unread without sinks
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        meta.block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=q.shape[1] // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=plan.block_m, BLOCK_N=block_n, WINDOW=window or 0,
        HAS_SINKS=sinks is not None, num_warps=num_warps, **stages,
    )  # fmt: skip


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    rows: int,
    scale: float,
    splits: int | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    order: torch.Tensor | None = None,
    halves: bool | None = None,
    native: bool = True,
) -> None:
    """Write into `out` the attention of the first `rows` queries of q, one token a row, over
    the keys their block tables name (`seq_lens` of them); `order`: the rows' indices, longest
    first (see `plan.decode_order`), which the programs take in that order. The launch settings
    are the kernel's tuned ones (bench/decode_attention.py sweeps them); `halves`: keys and
    values read in two halves of the head (`_attend_keys_halves`; by default for a float8
    cache, which it speeds up). A float8 cache that the CUDA kernel of `kernels/cuda` covers
    goes to it instead, where it could be built (`native=False`: Triton's whatever the cache;
    the launch settings are then unread)."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    heads = q.shape[1]
    group = heads // num_kv_heads
    if rows > MAX_GRID_ROWS:  # the launch grid's second axis
        raise ValueError(f"decode attention takes at most {MAX_GRID_ROWS} rows a step, not {rows}")
    if splits is None:
        splits = decode_splits(rows, num_kv_heads, multiprocessors(q.device))
    cuda = None
    if native and fp8_decode.serves(q, k_cache, v_cache, window, sinks):
        cuda = fp8_decode.library(torch.cuda.get_device_capability(q.device))
    has_sinks = sinks is not None
    sinks = out if sinks is None else sinks  # unread without sinks
    parts = stats = out  # unread with one split
    if splits > 1:
        parts = torch.empty(rows, heads, splits, head_dim, dtype=torch.float32, device=q.device)
        stats = torch.empty(rows, heads, splits, 2, dtype=torch.float32, device=q.device)
    if cuda is not None:
        fp8_decode.decode(
            cuda, q, k_cache, v_cache, block_tables, seq_lens, out, rows, scale, splits,
            parts, stats, order,
        )  # fmt: skip
    else:
        if block_n is None:
            block_n = DECODE_BLOCK_N if splits <= 2 else SPLIT_BLOCK_N
        if halves is None:
            halves = k_cache.dtype == torch.float8_e4m3fn
        _decode_kernel[(num_kv_heads, rows, splits)](
            q, k_cache, v_cache, out, parts, stats, block_tables, seq_lens, scale, sinks,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.stride(0), out.stride(0), out.stride(1),
            HEADS=heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
            HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=block_n, SPLITS=splits,
            WINDOW=window or 0, HAS_SINKS=has_sinks,
            ORDER=out if order is None else order, ORDERED=order is not None, HALVES=halves,
            num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    if splits > 1:
        _merge_kernel[(rows, heads)](
            parts, stats, out, sinks, out.stride(0), out.stride(1),
            HEADS=heads, HEAD_DIM=head_dim, SPLITS=splits, HAS_SINKS=has_sinks,
        )  # fmt: skip

"""The CUDA path's Triton kernels, run by Triton's interpreter on the CPU, against the torch
formulas they replace: their indexing, masking, splitting and merging, not their speed.

The interpreter computes float32 and float16 faithfully but not bfloat16 or float8 (it rounds
e4m3 wrongly and has no bf16 constants), so those dtypes stay with `bench/gpu_check.py` on the
device. `TRITON_INTERPRET` is set by the root conftest, before any kernel is decorated.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import triton

from inflight.model.attention import TorchAttentionBackend
from inflight.model.attention.triton import TritonAttentionBackend
from inflight.model.config import MoEConfig
from inflight.model.kernels.triton import (
    attention,
    fp8_matmul,
    fp8_tensorwise,
    lora,
    mamba,
    matmul,
    moe,
    ops,
    rope,
)
from inflight.model.kernels.triton.plan import plan_prefill
from inflight.model.layers.activation import torch_silu_mul
from inflight.model.layers.mamba import ssm_decode as torch_ssm_decode
from inflight.model.layers.moe import Experts
from inflight.model.layers.norm import torch_rms_norm
from inflight.model.layers.platform import Platform
from inflight.model.layers.quantization import FP8_MAX, LinearMethods, TorchLinearMethod, fp8_rows
from inflight.model.layers.rotary import rotate
from inflight.runtime.device.batch_builder import RowInput, build_ragged_batch

from helpers import scattered_step, windowed_steps

H200_SMS = 132


@triton.jit
def _probe(x):
    pass


def test_the_kernels_run_in_the_interpreter():
    """A kernel decorated at this module's import, as ours were by it, is interpreted."""
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(_probe, InterpretedFunction)


def _step(shapes, kv_heads, dim, dtype, block_size=16, num_blocks=96, seed=0):
    """A ragged step over scattered blocks ((query length, past length) per row) and random
    caches [blocks, block_size, kv heads, dim]."""
    torch.manual_seed(seed)
    meta = scattered_step(shapes, block_size, num_blocks, seed)
    caches = [torch.randn(num_blocks, block_size, kv_heads, dim).to(dtype) for _ in range(2)]
    return meta, caches


def _head_major(cache: torch.Tensor) -> torch.Tensor:
    """The torch backend's layout [kv heads, slots, dim], in float32."""
    kv_heads, dim = cache.shape[2:]
    return cache.permute(2, 0, 1, 3).reshape(kv_heads, -1, dim).float().contiguous()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


# Decode rows (their pasts crossing blocks, one a whole number of blocks), then prefill chunks
# with and without a past (one over several programs of PREFILL_BLOCK_M queries, the last one
# partial), and a decode row after them.
SHAPES = [(1, 0), (1, 16), (1, 63), (1, 200), (37, 0), (150, 30), (20, 45), (1, 3)]


@pytest.mark.parametrize(
    "heads,kv_heads,dim,dtype",
    [(8, 2, 32, torch.float32), (4, 4, 64, torch.float32), (16, 2, 32, torch.float16)],
)
def test_the_backend_stores_the_step_and_attends_like_the_torch_backend(
    heads, kv_heads, dim, dtype, monkeypatch
):
    monkeypatch.setattr(attention, "multiprocessors", lambda device: H200_SMS)
    meta, (k_cache, v_cache) = _step(SHAPES, kv_heads, dim, dtype)
    tokens = sum(q for q, _ in SHAPES)
    q = torch.randn(tokens, heads, dim).to(dtype)
    k, v = (torch.randn(tokens, kv_heads, dim).to(dtype) for _ in range(2))
    reference = TorchAttentionBackend()
    reference.plan(meta)
    ref_cache = (_head_major(k_cache), _head_major(v_cache))
    want = reference.forward(q.float(), k.float(), v.float(), ref_cache, meta, dim**-0.5)
    backend = TritonAttentionBackend()
    backend.plan(meta)
    got = backend.forward(q, k, v, (k_cache, v_cache), meta, dim**-0.5)
    assert torch.equal(_head_major(k_cache), ref_cache[0])
    assert torch.equal(_head_major(v_cache), ref_cache[1])
    # Row by row: an unwritten row would be garbage, not a small error.
    bound = 1e-6 if dtype == torch.float32 else 2e-3
    starts = meta.query_start_loc.tolist()
    for lo, hi in zip(starts, starts[1:], strict=False):
        assert _rel(got[lo:hi], want[lo:hi]) < bound, (lo, hi)


@pytest.mark.parametrize("splits", [1, 2, 4, 16])
def test_decode_rows_split_their_keys_and_merge_to_the_same_output(splits):
    """Flash decoding: each row's keys walked in `splits` parts (some empty for short rows),
    merged by their running maxima and sums."""
    shapes = [(1, 0), (1, 5), (1, 64), (1, 129), (1, 700)]
    heads, kv_heads, dim = 8, 2, 32
    meta, caches = _step(shapes, kv_heads, dim, torch.float32)
    # The new keys are already in the caches: the reference reads them back from there.
    slots = meta.slot_mapping
    k, v = (c.view(-1, kv_heads, dim)[slots] for c in caches)
    q = torch.randn(len(shapes), heads, dim)
    reference = TorchAttentionBackend()
    reference.plan(meta)
    ref_cache = tuple(_head_major(c) for c in caches)
    want = reference.forward(q, k, v, ref_cache, meta, dim**-0.5)
    got = attention.paged_attention(q, *caches, meta, dim**-0.5, splits=splits)
    for row in range(len(shapes)):
        assert _rel(got[row], want[row]) < 1e-6, row


@pytest.mark.parametrize("splits", [1, 4])
def test_decode_rows_read_in_halves_of_the_head_attend_alike(splits):
    """The FP8 cache's path (`halves`: each key and value read in two halves of the head) gives
    the whole path's output, split or not, on a float32 cache (the interpreter's float8 is not
    the GPU's)."""
    shapes = [(1, 0), (1, 5), (1, 64), (1, 129), (1, 700)]
    heads, kv_heads, dim = 8, 2, 32
    meta, caches = _step(shapes, kv_heads, dim, torch.float32)
    q = torch.randn(len(shapes), heads, dim)
    got = {}
    for halves in (False, True):
        out = torch.full_like(q, float("nan"))
        attention.decode_attention(
            q, *caches, meta.block_tables, meta.seq_lens, out, len(shapes), dim**-0.5,
            splits=splits, halves=halves,
        )  # fmt: skip
        got[halves] = out
    assert not got[True].isnan().any()
    for row in range(len(shapes)):
        assert _rel(got[True][row], got[False][row].float()) < 1e-6, row


def test_decode_rows_taken_longest_first_keep_their_bits():
    """The step plan's order (rows longest first, so a step's last wave of programs is of short
    rows) changes which program takes a row, not the row's result."""
    shapes = [(1, 5), (1, 700), (1, 64), (1, 300), (1, 0)]
    heads, kv_heads, dim = 8, 2, 32
    meta, caches = _step(shapes, kv_heads, dim, torch.float32)
    q = torch.randn(len(shapes), heads, dim)
    TritonAttentionBackend().plan(meta)
    assert meta.plan.prefill is None
    assert meta.plan.decode_order.tolist() == [1, 3, 2, 0, 4]
    ordered = attention.paged_attention(q, *caches, meta, dim**-0.5, splits=1)
    meta.plan = None
    assert torch.equal(ordered, attention.paged_attention(q, *caches, meta, dim**-0.5, splits=1))


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 16), (16, 64)])
def test_prefill_programs_of_other_sizes_attend_alike(block_m, block_n):
    """The prefill kernel's launch settings (bench/prefill_attention.py sweeps them) change
    which program serves which queries and how many keys an iteration takes, not the output."""
    heads, kv_heads, dim = 8, 2, 32
    meta, caches = _step(SHAPES, kv_heads, dim, torch.float32)
    q = torch.randn(meta.slot_mapping.shape[0], heads, dim)
    backend = TritonAttentionBackend()
    backend.plan(meta)
    want = attention.paged_attention(q, *caches, meta, dim**-0.5)
    plan = plan_prefill(meta.query_lens_host, meta.num_decodes, q.device, block_m)
    got = torch.zeros_like(q)
    attention.prefill_attention(q, *caches, meta, plan, got, dim**-0.5, block_n=block_n)
    first = meta.num_decodes
    assert got[:first].eq(0).all()  # decode rows are not the prefill kernel's
    assert _rel(got[first:], want[first:]) < 1e-6


def test_a_windowed_prefill_refuses_programs_longer_than_their_key_tiles():
    meta, caches = _step([(37, 0)], 2, 32, torch.float32)
    q = torch.randn(37, 8, 32)
    plan = plan_prefill(meta.query_lens_host, 0, q.device, 64)
    with pytest.raises(ValueError, match="block_m <= block_n"):
        attention.prefill_attention(q, *caches, meta, plan, q, 1.0, window=8, block_n=32)


def test_decode_rows_past_the_launch_grid_are_refused_by_name():
    """Rows are the decode grid's second axis, which CUDA caps at 65,535 programs."""
    q = torch.zeros(1, 8, 32)
    cache = torch.zeros(1, 16, 2, 32)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="at most 65535 rows a step, not 65536"):
        attention.decode_attention(q, cache, cache, tables, lens, q, 65_536, 1.0)


def test_the_batch_invariant_backend_gives_a_decode_row_its_bits_alone_or_among_80(monkeypatch):
    """By default the step's row count picks how many parts a row's keys are split in (here 16
    alone, 4 among 80 rows), so the order its sums run in; the batch-invariant backend never
    splits them."""
    monkeypatch.setattr(attention, "multiprocessors", lambda device: H200_SMS)
    shapes = [(1, 300)] + [(1, n) for n in torch.randint(0, 60, (79,)).tolist()]
    heads, kv_heads, dim = 8, 2, 32
    meta, caches = _step(shapes, kv_heads, dim, torch.float32, num_blocks=400)
    table = meta.block_tables[0, : -(-301 // 16)].tolist()
    alone = build_ragged_batch([RowInput([0], 300, table, True)], 16, torch.device("cpu"))
    q = torch.randn(len(shapes), heads, dim)
    k, v = (torch.randn(len(shapes), kv_heads, dim) for _ in range(2))
    backend = TritonAttentionBackend(batch_invariant=True)
    outputs = []
    for step, rows in ((meta, len(shapes)), (alone.forward.attention, 1)):
        backend.plan(step)
        outputs.append(backend.forward(q[:rows], k[:rows], v[:rows], caches, step, dim**-0.5))
    assert torch.equal(outputs[0][:1], outputs[1])


@pytest.mark.parametrize("bias", [False, True], ids=["plain", "bias"])
def test_the_invariant_matmul_gives_each_row_its_bits_whatever_the_row_count(bias):
    """x @ w^T (+ b) with N and K off the tiles' multiples and rows over several row tiles:
    the formula's result, and each row's bits the same whatever the row count. The slices keep
    each row's place in its tile: the interpreter's dots are numpy's, whose bits for a row can
    hang on that place, where a tensor core's do not (a row at any place in a step:
    `bench/gpu_check.py "batch invariance"`)."""
    torch.manual_seed(0)
    w, x = torch.randn(200, 150), torch.randn(130, 150)
    b = torch.randn(200) if bias else None
    y = matmul.invariant_linear(x, w, b)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert _rel(y, want.float()) < 1e-6
    for rows in (slice(0, 1), slice(0, 7), slice(0, 65), slice(64, 130)):
        assert torch.equal(matmul.invariant_linear(x[rows], w, b), y[rows])
    y3 = matmul.invariant_linear(x.reshape(10, 13, 150), w, b)
    assert torch.equal(y3, y.reshape(10, 13, 200))


@pytest.mark.parametrize("window", [5, 40])
def test_windowed_rows_match_the_torch_backend_and_read_no_block_before_their_window(
    window, monkeypatch
):
    """Each query over the last `window` keys up to its own: decode rows (their keys split in
    16 parts, most empty) and prefill chunks (a program's first query's window starting inside
    the chunk, a later one's past its first keys) as the torch backend computes them. The
    table entries before each row's window name a block of NaN (as a block given back and
    reused holds anything): no kernel reads it."""
    monkeypatch.setattr(attention, "multiprocessors", lambda device: H200_SMS)
    torch.manual_seed(3)
    shapes = [(1, 0), (1, 16), (1, 200), (1, 700), (37, 0), (150, 30), (20, 45), (1, 3)]
    heads, kv_heads, dim, size = 8, 2, 32, 16
    meta, poisoned = windowed_steps(shapes, size, 96, window)
    tokens = sum(q for q, _ in shapes)
    q = torch.randn(tokens, heads, dim)
    k, v = torch.randn(tokens, kv_heads, dim), torch.randn(tokens, kv_heads, dim)
    caches = [torch.randn(96, size, kv_heads, dim) for _ in range(2)]
    reference = TorchAttentionBackend()
    ref_cache = tuple(_head_major(c) for c in caches)
    want = reference.forward(q, k, v, ref_cache, meta, dim**-0.5, window)
    for c in caches:
        c[0] = float("nan")
    backend = TritonAttentionBackend()
    backend.plan(poisoned)
    got = backend.forward(q, k, v, tuple(caches), poisoned, dim**-0.5, window)
    starts = poisoned.query_start_loc.tolist()
    for lo, hi in zip(starts, starts[1:], strict=False):
        assert _rel(got[lo:hi], want[lo:hi]) < 1e-6, (lo, hi)


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("splits", [1, 16])
def test_sinks_match_the_torch_backend(window, splits, monkeypatch):
    """gpt-oss's sinks, a logit per query head that joins each softmax as one more score:
    decode rows normalized in one program or across 16 parts by the merge, and prefill
    chunks, as the torch backend computes them."""
    monkeypatch.setattr(attention, "multiprocessors", lambda device: H200_SMS)
    torch.manual_seed(5)
    shapes = [(1, 0), (1, 16), (1, 200), (1, 700), (37, 0), (150, 30), (20, 45)]
    heads, kv_heads, dim, size = 8, 2, 32, 16
    meta, _ = windowed_steps(shapes, size, 96, window or 10**6)
    tokens = sum(q for q, _ in shapes)
    q = torch.randn(tokens, heads, dim)
    k, v = torch.randn(tokens, kv_heads, dim), torch.randn(tokens, kv_heads, dim)
    caches = [torch.randn(96, size, kv_heads, dim) for _ in range(2)]
    sinks = torch.randn(heads) * 2
    want = TorchAttentionBackend().forward(
        q, k, v, tuple(_head_major(c) for c in caches), meta, dim**-0.5, window, sinks
    )
    backend = TritonAttentionBackend()
    backend.plan(meta)
    plain = backend.forward(q, k, v, tuple(caches), meta, dim**-0.5, window)  # stores k, v
    got = attention.paged_attention(
        q, *caches, meta, dim**-0.5, splits=splits, window=window, sinks=sinks
    )
    starts = meta.query_start_loc.tolist()
    for lo, hi in zip(starts, starts[1:], strict=False):
        assert _rel(got[lo:hi], want[lo:hi]) < 1e-6, (lo, hi)
        assert _rel(plain[lo:hi], want[lo:hi]) > 1e-3, (lo, hi)


def _rope_reference(qkv, heads, kv_heads, cos, sin, norms):
    """The torch path: q and k normed per head in their dtype (`torch_rms_norm`), rotated
    (`rotate`) in float32, where the kernel rotates; v as it came."""
    tokens, dim = qkv.shape[0], cos.shape[-1]
    parts = qkv.view(tokens, -1, dim).split([heads, kv_heads, kv_heads], dim=1)
    rotated = []
    for x, weight in zip(parts[:2], norms[:2] if norms else (None, None), strict=True):
        if norms:
            x = torch_rms_norm(x, weight, norms[2])[0]
        rotated.append(rotate(x.float(), (cos.float(), sin.float())))
    return rotated[0], rotated[1], parts[2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("normed", [True, False], ids=["qk-norm", "plain"])
def test_rope_store_rotates_q_and_stores_k_v_at_their_slots_only(dtype, normed):
    torch.manual_seed(1)
    tokens, heads, kv_heads, dim, eps = 37, 4, 2, 32, 1e-6  # 16 tokens a program, 3 programs
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    angle = torch.rand(tokens, 1, dim // 2) * 40
    angle = torch.cat((angle, angle), dim=-1)
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    norms = None
    if normed:
        norms = (*((1 + 0.1 * torch.randn(dim)).to(dtype) for _ in range(2)), eps)
    slots = torch.randperm(8 * 16)[:tokens]
    caches = [torch.full((8, 16, kv_heads, dim), float("nan"), dtype=dtype) for _ in range(2)]
    q = rope.rope_store(qkv, heads, kv_heads, (cos, sin), slots, *caches, norms)
    want_q, want_k, want_v = _rope_reference(qkv, heads, kv_heads, cos, sin, norms)
    k_cache, v_cache = (c.view(-1, kv_heads, dim) for c in caches)
    # float32 rounds nowhere; float16 rounds the rotation once where torch rounds each term.
    ulp = 1e-6 if dtype == torch.float32 else 2**-10
    for got, want in ((q, want_q), (k_cache[slots], want_k)):
        assert ((got.float() - want).abs() / want.abs().clamp_min(1.0)).max() <= 2 * ulp
    assert torch.equal(v_cache[slots], want_v)
    untouched = torch.ones(k_cache.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert k_cache[untouched].isnan().all() and v_cache[untouched].isnan().all()
    # A token's bits alone as among the others (a decode as in a prefill).
    for t in (0, 20, tokens - 1):
        alone = [torch.zeros_like(c) for c in caches]
        q_t = rope.rope_store(qkv[t : t + 1], heads, kv_heads, (cos[t : t + 1], sin[t : t + 1]),
                              slots[t : t + 1], *alone, norms)  # fmt: skip
        assert torch.equal(q_t, q[t : t + 1])
        for cache, got in zip(caches, alone, strict=True):
            assert torch.equal(
                got.view(-1, kv_heads, dim)[slots[t]], cache.view(-1, kv_heads, dim)[slots[t]]
            )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_with_and_without_the_residual(dtype):
    """Against the torch path the layers take without a kernel."""
    torch.manual_seed(2)
    x, residual = (torch.randn(7, 1000).to(dtype) for _ in range(2))  # not a power of two
    weight = (1 + 0.1 * torch.randn(1000)).to(dtype)
    plain, none = ops.rms_norm(x, weight, 1e-6)
    normed, summed = ops.rms_norm(x, weight, 1e-6, residual)
    assert none is None
    want_normed, want_summed = torch_rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(summed, want_summed)
    # One rounding step apart at most: the kernel sums the squares in its own order.
    step = 1e-6 if dtype == torch.float32 else 2**-10
    for got, want in ((plain, torch_rms_norm(x, weight, 1e-6)[0]), (normed, want_normed)):
        assert ((got.float() - want.float()).abs() / want.float().abs().clamp_min(1)).max() <= step


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_mul_matches_the_torch_path(dtype):
    torch.manual_seed(3)
    gate_up = 4 * torch.randn(5, 2 * 1500).to(dtype)  # two column blocks, the second ragged
    want = torch_silu_mul(gate_up)
    got = ops.silu_mul(gate_up)
    # float16: the kernel's exp and torch's may round silu(gate) one step apart.
    step = 1e-6 if dtype == torch.float32 else 2**-10
    assert ((got.float() - want.float()).abs() / want.float().abs().clamp_min(1)).max() <= step


@pytest.mark.parametrize(
    ("rows", "out_features", "in_features", "tiles"),
    [
        (1, 200, 512, fp8_matmul.Fp8Tiles(64, 128)),  # weight rows past the last tile's
        (5, 130, 1000, fp8_matmul.Fp8Tiles()),  # K not a multiple of the step
        (37, 96, 384, fp8_matmul.Fp8Tiles(32, 128)),  # rows padded to a tile of 64
        (fp8_matmul.MAX_ROWS, 64, 256, fp8_matmul.Fp8Tiles()),  # four tiles of 32 rows
        (100, 96, 384, fp8_matmul.Fp8Tiles(block_m=64, split=2)),  # the last tile part-empty
        (5, 130, 1000, fp8_matmul.Fp8Tiles(split=2)),  # the second part runs past K
        (40, 200, 1024, fp8_matmul.Fp8Tiles(32, 128, split=4)),
        (3, 64, 256, fp8_matmul.Fp8Tiles(split=4)),  # the last two parts hold no K
    ],
)
def test_fp8_few_rows_kernel_matches_its_formula(rows, out_features, in_features, tiles):
    """Float8 operands made by torch (the interpreter reads them right), so the products are
    exact and only the float32 sums' order may differ."""
    torch.manual_seed(rows)
    xq, x_scale = fp8_rows(torch.randn(rows, in_features))
    wq, w_scale = fp8_rows(torch.randn(out_features, in_features) * 0.02)
    bias = torch.randn(out_features)
    want = (xq.double() * x_scale.double()) @ (wq.double() * w_scale.double()).T + bias.double()
    got = fp8_matmul.fp8_few_rows_linear(xq, x_scale, wq, w_scale, bias, torch.float32, tiles)
    assert got.shape == (rows, out_features)
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-6


@pytest.mark.parametrize("size", [1000, ops.ONE_PASS_MAX + 100], ids=["one pass", "two passes"])
def test_fp8_rows_kernel_scales_each_row_as_the_formula(size):
    """The scales only: the interpreter rounds to e4m3 otherwise than the GPU (the quantized
    values are checked bit for bit on the device, `bench/gpu_check.py "fp8 linear"`)."""
    torch.manual_seed(size)
    x = 3 * torch.randn(3, size)
    x[1] = 0  # an all-zero row keeps scale 1
    q, scale = ops.fp8_rows(x, FP8_MAX)
    assert q.shape == x.shape and q.dtype == torch.float8_e4m3fn
    assert torch.equal(scale, fp8_rows(x)[1])


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("size", [1000, ops.ONE_PASS_MAX + 100], ids=["one kernel", "two kernels"])
def test_rms_norm_fp8_is_the_norm_then_the_quantizer_bit_for_bit(size, residual):
    """The fused kernel quantizes the norm's rows as rounded to the activation dtype, so it
    gives the bits of `rms_norm` then `fp8_rows` (the interpreter's e4m3 rounding on both
    sides; the GPU's is checked in `bench/gpu_check.py "fp8 linear"`)."""
    torch.manual_seed(size)
    x, res = (torch.randn(3, size).to(torch.float16) for _ in range(2))
    x[1] = 0
    res[1] = 0  # an all-zero row keeps scale 1
    weight = (1 + 0.1 * torch.randn(size)).to(torch.float16)
    r = res if residual else None
    values, scales, summed = ops.rms_norm_fp8(x, weight, 1e-6, r, FP8_MAX)
    normed, want_summed = ops.rms_norm(x, weight, 1e-6, r)
    want_values, want_scales = ops.fp8_rows(normed, FP8_MAX)
    assert values.dtype == torch.float8_e4m3fn and scales.shape == (3, 1)
    assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))
    assert torch.equal(scales, want_scales)
    assert scales[1].item() == 1.0
    assert (summed is None) == (not residual)
    if residual:
        assert torch.equal(summed, want_summed)


@pytest.mark.parametrize("size", [1500, ops.ONE_PASS_MAX + 100], ids=["one kernel", "two kernels"])
def test_silu_mul_fp8_is_silu_mul_then_the_quantizer_bit_for_bit(size):
    torch.manual_seed(size)
    gate_up = 4 * torch.randn(3, 2 * size).to(torch.float16)
    gate_up[1] = 0
    values, scales = ops.silu_mul_fp8(gate_up, FP8_MAX)
    want_values, want_scales = ops.fp8_rows(ops.silu_mul(gate_up), FP8_MAX)
    assert values.shape == (3, size) and values.dtype == torch.float8_e4m3fn
    assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))
    assert torch.equal(scales, want_scales)
    assert scales[1].item() == 1.0


@pytest.mark.parametrize(
    ("rows", "cols", "bias"), [(1, 300, True), (37, 512, False), (160, 1000, True)]
)
def test_fp8_tensorwise_scales_each_element_by_its_row_and_column(rows, cols, bias):
    torch.manual_seed(rows)
    product = torch.randn(rows, cols) * 100
    x_scale, w_scale = torch.rand(rows, 1) + 0.1, torch.rand(cols, 1) + 0.1
    b = torch.randn(cols) if bias else None
    got = fp8_tensorwise.scale_product(product, x_scale, w_scale, b, torch.float32)
    want = product * x_scale * w_scale.t() + (b if bias else 0)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


def test_fp8_tensorwise_takes_the_rows_where_the_rowwise_gemm_is_slow():
    takes = fp8_tensorwise.takes
    assert not takes(128, 28672, 4096) and takes(129, 28672, 4096) and takes(192, 4096, 4096)
    assert not takes(256, 28672, 4096) and takes(256, 4096, 14336)  # down only, past 192
    assert not takes(257, 4096, 14336) and not takes(8192, 4096, 14336)  # prefill


def test_fp8_plan_cuts_k_only_while_weight_tiles_leave_multiprocessors_idle():
    tiles = fp8_matmul.Fp8Tiles()
    # Llama-3.1-8B's layers on an H200 (132 multiprocessors).
    assert fp8_matmul.plan(16, 28672, 4096, tiles, 132) == (16, 1)  # gate_up: 448 tiles
    assert fp8_matmul.plan(64, 4096, 14336, tiles, 132) == (64, 4)  # down: 64 tiles
    assert fp8_matmul.plan(1, 6144, 4096, tiles, 132) == (16, 2)  # qkv: 96 tiles
    assert fp8_matmul.plan(16, 4096, 4096, tiles, 132) == (16, 4)  # o: 64 tiles
    assert fp8_matmul.plan(100, 4096, 4096, tiles, 132) == (64, 2)  # o: 2 x 64 tiles
    assert fp8_matmul.plan(8, 4096, 1024, tiles, 132) == (16, 1)  # K of 8 steps: not cut
    assert fp8_matmul.plan(8, 64, 14336, tiles, 132) == (16, fp8_matmul.MAX_SPLIT)
    assert fp8_matmul.plan(8, 64, 4096, fp8_matmul.Fp8Tiles(block_m=32, split=1), 132) == (32, 1)


def test_fp8_few_rows_kernel_takes_more_than_64_rows_only_where_weight_tiles_are_few():
    assert fp8_matmul.takes(64, 28672, 132)  # gate_up: 448 tiles of 64 weight rows
    assert not fp8_matmul.takes(65, 28672, 132)
    assert fp8_matmul.takes(fp8_matmul.MAX_ROWS, 4096, 132)
    assert not fp8_matmul.takes(fp8_matmul.MAX_ROWS + 1, 4096, 132)


def test_fp8_few_rows_kernel_refuses_more_rows_than_it_takes():
    xq, x_scale = fp8_rows(torch.randn(fp8_matmul.MAX_ROWS + 1, 128))
    wq, w_scale = fp8_rows(torch.randn(32, 128))
    with pytest.raises(ValueError, match="at most"):
        fp8_matmul.fp8_few_rows_linear(xq, x_scale, wq, w_scale, None, torch.float32)


def test_lora_adds_each_tokens_slot_and_leaves_base_tokens_alone():
    """Three parts (a fused qkv), slots of ranks 16 and 5 and an unused one, tokens of every slot
    and of the base model (-1), more tokens than one block of them."""
    gen = torch.Generator().manual_seed(4)
    parts, in_features, max_rank, num_slots = [300, 100, 100], 200, 16, 3
    out = sum(parts)
    starts = (0, 300, 400, 500)
    a = torch.zeros(3, num_slots, max_rank, in_features)
    bt = torch.zeros(num_slots, max_rank, out)
    for slot, rank in ((0, 16), (1, 5)):
        a[:, slot, :rank] = 0.1 * torch.randn(3, rank, in_features, generator=gen)
        bt[slot, :rank] = 0.1 * torch.randn(rank, out, generator=gen)
    token_slots = torch.tensor([0, -1, 1, 0, 2, -1, 1, 1] * 3, dtype=torch.int32)
    tokens = len(token_slots)
    x = torch.randn(tokens, in_features, generator=gen)
    y0 = torch.randn(tokens, out, generator=gen)
    want = y0.double().clone()
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            for p in range(3):
                lo, hi = starts[p], starts[p + 1]
                h = x[t].double() @ a[p, slot].double().T
                want[t, lo:hi] += h @ bt[slot, :, lo:hi].double()
    y = y0.clone()
    lora.lora_add(y, x, token_slots, a, bt, starts)
    assert ((y.double() - want).abs().max() / want.abs().max()).item() < 1e-6
    base = token_slots < 0
    assert torch.equal(y[base], y0[base])


def test_mamba_decode_step_updates_only_its_rows_slots():
    """Against the torch step the CPU runs: rows in scattered slots, heads sharing B and C in
    groups, a head_dim the kernel's block does not divide; the other slots untouched."""
    torch.manual_seed(5)
    rows, heads, head_dim, d_state, groups, num_slots = 5, 4, 48, 32, 2, 9
    state = torch.randn(num_slots, heads, head_dim, d_state)
    slots = torch.randperm(num_slots)[:rows]
    x = torch.randn(rows, heads, head_dim)
    dt = torch.rand(rows, heads) * 0.2
    a = -torch.rand(heads) * 4
    b, c = (torch.randn(rows, groups, d_state) for _ in range(2))
    d = torch.randn(heads)
    want = state.clone()
    want_y = torch_ssm_decode(want, slots, x, dt, a, b, c, d)
    y = mamba.ssm_decode(state, slots, x, dt, a, b, c, d)
    assert ((state - want).abs().max() / want.abs().max()).item() < 1e-6
    assert ((y - want_y).abs().max() / want_y.abs().max()).item() < 1e-5


def test_moe_align_sorts_pairs_into_blocks_of_one_expert():
    """Every (token, choice) pair once, each block's pairs of its expert, padding past them,
    blocks past the last real one marked -1; sized by the pair count alone."""
    gen = torch.Generator().manual_seed(7)
    tokens, k, experts, block = 37, 3, 8, 16
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    ids[:10] = torch.tensor([0, 1, 2])  # an uneven load: experts 0-2 fill more than a block
    sorted_pairs, block_expert = moe.align(ids, experts, block)
    pairs = tokens * k
    assert sorted_pairs.numel() == pairs + experts * (block - 1)
    real = sorted_pairs[sorted_pairs < pairs]
    assert sorted(real.tolist()) == list(range(pairs))
    flat = ids.flatten()
    for b, expert in enumerate(block_expert.tolist()):
        slots = sorted_pairs[b * block : (b + 1) * block]
        chosen = slots[slots < pairs].long()
        if expert < 0:
            assert chosen.numel() == 0
        else:
            assert chosen.numel() > 0 and (flat[chosen] == expert).all()
    used = int(torch.unique(flat).numel())
    assert (block_expert >= 0).sum().item() >= used


@pytest.mark.parametrize("activation", ["silu", "relu2", "swiglu_clamped"])
def test_fused_experts_match_the_per_expert_layers(activation):
    """The grouped kernel's experts (CUDA's path) against the experts' own layers run one
    expert at a time (the CPU path), float32: SwiGLU, relu² and gpt-oss's clamped SwiGLU with
    biases; 29 tokens, 3 experts each of 8, an expert chosen by none."""
    config = MoEConfig(8, 3, 48, (0,), activation=activation, expert_bias=activation != "silu")
    platform = Platform(torch.device("cpu"), torch.float32)
    experts = Experts(64, config, platform, LinearMethods(TorchLinearMethod()), "experts")
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    x = torch.randn(29, 64, generator=gen)
    ids = torch.stack([torch.randperm(7, generator=gen)[:3] for _ in range(29)])
    weights = torch.rand(29, 3, generator=gen)
    want = experts(x, weights, ids)
    stack = [torch.stack([layer.weight for layer in experts.gate_up]),
             torch.stack([layer.weight for layer in experts.down])]  # fmt: skip
    biases = [None, None]
    if config.expert_bias:
        biases = [
            torch.stack([layer.bias for layer in group])
            for group in (experts.gate_up, experts.down)
        ]
    got = moe.fused_experts(x, weights, ids, *stack, *biases, experts.activate)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


# Run in a process of its own: under TRITON_INTERPRET the kernels are the interpreter's.
_NORM_LAYOUTS = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from inflight.model.kernels.triton import ops
from inflight.model.layers.quantization import FP8_MAX

found = {}
for block in (1024, 4096, 16384):
    for residual in (False, True):
        for fp8 in (False, True):
            signature = {
                "X": "*bf16", "R": "*bf16", "OUT": "*fp8e4nv" if fp8 else "*bf16",
                "SCALE": "*fp32", "RES_OUT": "*bf16", "W": "*bf16", "stride_x": "i32",
                "stride_r": "i32", "stride_o": "i32", "stride_ro": "i32", "size": "i32",
                "eps": "fp32", "HAS_RESIDUAL": "constexpr", "FP8_MAX": "constexpr",
                "BLOCK": "constexpr",
            }
            # Pointers, strides and the size 16-aligned, as a real launch specializes them.
            aligned = {(i,): [["tt.divisibility", 16]] for i in range(11)}
            constants = {"HAS_RESIDUAL": residual, "FP8_MAX": FP8_MAX if fp8 else 0.0,
                         "BLOCK": block}
            compiled = triton.compile(
                ASTSource(ops._rms_norm_kernel, signature, constants, attrs=aligned),
                target=GPUTarget("cuda", 90, 32),
                options={"num_warps": 8 if block > 4096 else 4},
            )
            found[f"{block} {residual} {fp8}"] = sorted(
                line.split("=", 1)[1] for line in compiled.asm["ttgir"].splitlines()
                if line.startswith("#blocked")
            )
json.dump(found, sys.stdout)
"""


@pytest.fixture(scope="module")
def norm_layouts() -> dict[str, list[str]]:
    """The register layouts Triton gives the norm kernel compiled for an sm_90 (no GPU needed),
    float and float8 output, by row block and residual."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _NORM_LAYOUTS], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("block", [1024, 4096, 16384])
def test_the_fp8_norm_is_laid_out_as_the_float_norm_so_its_sum_of_squares_adds_alike(
    norm_layouts, block, residual
):
    """The norm's sum of squares adds each thread's values first, so its bits follow the
    kernel's register layout: the float8 rows must be computed in the float norm's, or a row's
    rstd can differ by a bit from `rms_norm`'s (16 values a thread against 8 did, on an H100).
    The interpreter cannot see this; Triton's compile for sm_90 can, without a GPU."""
    float_layouts = norm_layouts[f"{block} {residual} False"]
    assert len(float_layouts) == 1
    assert norm_layouts[f"{block} {residual} True"] == float_layouts

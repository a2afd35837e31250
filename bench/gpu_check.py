"""CUDA path checks, run on the device: the Triton attention backend against the torch reference.

1. Kernels (and again with a sliding window of 100 keys): a ragged step mixing decode rows
   (their keys split in 16, 1 and 4 parts) and prefill chunks with a past, over scattered KV
   blocks; relative error of the Triton output against the torch backend computed in
   float32, with the output memory poisoned (NaN) beforehand so every element must be
   written; again over a float8 (e4m3) KV cache, whose decode rows the CUDA kernel of
   `kernels/cuda` takes where it was built; that kernel also alone against a float32 reference
   and beside Triton's (query heads 1-8 a KV head, keys in 1, 4 and 16 parts).
2. Fused RMSNorm (+ residual), SiLU-mul and norm + RoPE + KV store kernels against the torch
   formulas they replace.
3. The Triton Mamba2 decode step against its torch formula (float32).
4. End to end: greedy tokens of 8 prompts through a random-weight Qwen3-0.6B-shaped model (and a
   Bamba-9B-shaped hybrid) in bf16, Triton backend (CUDA graphs, overlapped steps) against the
   torch backend on the same weights; a divergence is reported with the reference's top-2
   logit gap at that point (a near-tie under 0.1, or a bug). Where the bf16 gap is wider, the
   same prefix in float32 arbitrates: the two picks within 0.1 there is a tie rounding broke,
   and a Triton pick that float32 ranks above the reference's is the reference's rounding.
5. Structured outputs on CUDA: constrained rows beside free ones stay in their languages.
6. FP8 weights: the Triton per-token activation quantizer bit for bit against the torch
   formula, and the FP8 linear against its float64 formula, at a few rows (the few-rows Triton
   kernel, K a multiple of its step or not) and at many (torch._scaled_mm, rowwise scales).
7. The LoRA side paths in bf16 (the indexed Triton kernel, the masked matmuls) against the float64
   formula: a fused three-part layer, slots of two ranks and an empty one, tokens of every slot
   and of the base model.
8. Media input: random-weight LLaVA (`llava-clip-b16-smollm2`), Qwen2-VL-2B (M-RoPE, images of
   different sizes) and Voxtral-Mini-3B (audio clips of 3 to 40 s) in bf16, 8 prompts of one
   item each, the Triton backend with CUDA graphs and overlapped steps against the torch
   backend eagerly on the same weights; divergences must be near-ties (the gap read from the
   reference's top-2 logprobs with the item in the prompt); and the encoder in bf16 against
   the same weights in float32 on the CPU (relative error under 2e-2).
9. Mixture of experts: the grouped Triton kernel (bf16, Qwen3-30B-A3B's expert shape, 256
   tokens of 8 experts each) against the experts' formula in float32 on the same weights, a
   token's bits alone and beside others; greedy tokens of a 4-layer Qwen3-30B-A3B-shaped model
   as in check 4.
10. gpt-oss: the kernels of check 1 with a window of 100 and a sink logit per query head;
   a 4-layer gpt-oss-20b-shaped model (sinks, alternating 128-token windows, clamped-SwiGLU
   experts with biases, YaRN): its bf16 greedy tokens part from float32's within a few tokens
   on either backend, so the check compares the first token's top-20 logprobs of the Triton
   path and of the torch backend in bf16 with float32's (`check_first_logprobs`).
11. Batch invariance (`batch_invariant=True`): a request's tokens and logprobs alone and
   beside 1, 7 and 63 others, bit for bit (`check_batch_invariance`).

    python3 bench/gpu_check.py [NAME ...] [--seeds N]   (prints a table; exits 1 on a failed
    check; with names, only the checks whose names contain one of them, e.g. "fused" "greedy";
    each at seeds 0 .. N - 1, 2 by default)
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import itertools
import math
import os
import random
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from decode_attention import BLOCK_SIZE, block_tables
from PIL import Image

from inflight.bench.random_model import random_checkpoint
from inflight.model.attention import TorchAttentionBackend
from inflight.model.attention.triton import TritonAttentionBackend
from inflight.model.config import MoEConfig
from inflight.model.kernels.cuda import fp8_decode
from inflight.model.kernels.triton.attention import decode_attention, paged_attention
from inflight.model.layers.moe import Experts
from inflight.model.layers.platform import Platform
from inflight.model.layers.quantization import LinearMethods, TorchLinearMethod
from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.outputs import materialize
from inflight.protocol.request import GenerationRequest, SamplingParams
from inflight.runtime.device import sampler as sampler_module
from inflight.runtime.device.batch_builder import RowInput, build_ragged_batch
from inflight.runtime.device.sampler import Sampler
from inflight.runtime.host.rows import SamplingRow
from inflight.runtime.runtime import Runtime


def _poison_allocator(device: torch.device) -> None:
    """Fill freed cached memory with NaN, so an unwritten output element shows up."""
    junk = torch.full((256 * 1024 * 1024,), float("nan"), device=device, dtype=torch.bfloat16)
    del junk


def check_kernels(
    device: torch.device,
    seed: int,
    kv_dtype: torch.dtype = torch.bfloat16,
    window: int | None = None,
    sinks: bool = False,
) -> tuple[bool, str]:
    """With `kv_dtype` float8 e4m3, the reference computes on the same float8 values (the new
    keys and values rounded as the cache stores them): the kernels' own error is compared.
    With a `window`, every query attends over its last `window` keys; with `sinks`, each
    query head's random sink logit joins its softmaxes (gpt-oss)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    heads, kv_heads, dim, block_size, num_blocks = 16, 4, 128, 16, 512
    # (query length, past length): decode rows first, then prefill chunks.
    shapes = [(1, 0), (1, 16), (1, 63), (1, 200), (1, 999), (1, 1500)]
    shapes += [(37, 0), (64, 128), (200, 33), (130, 700), (1, 45)]
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    rows, cursor = [], 0
    for qlen, past in shapes:
        need = -(-(qlen + past) // block_size)
        table = blocks[cursor : cursor + need]
        cursor += need
        rows.append(RowInput([0] * qlen, past, table, True))
    batch = build_ragged_batch(rows, block_size, device)
    meta = batch.forward.attention
    tokens = sum(q for q, _ in shapes)
    q = torch.randn(tokens, heads, dim, device=device, dtype=torch.bfloat16)
    k = torch.randn(tokens, kv_heads, dim, device=device, dtype=torch.bfloat16)
    v = torch.randn(tokens, kv_heads, dim, device=device, dtype=torch.bfloat16)
    cache_k = torch.randn(num_blocks, block_size, kv_heads, dim, device=device).to(kv_dtype)
    cache_v = torch.randn(num_blocks, block_size, kv_heads, dim, device=device).to(kv_dtype)

    def head_major(cache: torch.Tensor) -> torch.Tensor:
        return cache.permute(2, 0, 1, 3).reshape(kv_heads, -1, dim).float().contiguous()

    ref_cache = (head_major(cache_k), head_major(cache_v))
    sink = torch.randn(heads, device=device) * 2 if sinks else None
    reference = TorchAttentionBackend()
    reference.plan(meta)
    stored_k, stored_v = (x.to(kv_dtype).float() for x in (k, v))
    expected = reference.forward(
        q.float(), stored_k, stored_v, ref_cache, meta, dim**-0.5, window, sink
    )
    triton_backend = TritonAttentionBackend()
    triton_backend.plan(meta)
    _poison_allocator(device)
    got = triton_backend.forward(q, k, v, (cache_k, cache_v), meta, dim**-0.5, window, sink)
    # The decode rows' keys in one part and in 4 (the default for 6 rows splits them in 16).
    outputs = [got] + [
        paged_attention(q, cache_k, cache_v, meta, dim**-0.5, splits=n, window=window, sinks=sink)
        for n in (1, 4)
    ]
    torch.cuda.synchronize()
    written = not any(torch.isnan(out).any().item() for out in outputs)
    rel = max(((out.float() - expected).norm() / expected.norm()).item() for out in outputs)
    cache_ok = torch.equal(head_major(cache_k), ref_cache[0])
    ok = written and rel < 1e-2 and cache_ok
    return ok, f"rel err {rel:.2e} (decode keys in 16, 1, 4 parts), all written {written}, " + (
        f"KV stored {cache_ok}"
    )


def check_fp8_decode_cuda(device: torch.device, seed: int) -> tuple[bool, str]:
    """The CUDA decode kernel of a float8 cache (`kernels/cuda/fp8_decode.cu`) against a
    float32 reference on the same float8 values, beside Triton's decode kernel on the same
    case: 1, 2, 4 and 8 query heads a KV head, keys in 1, 4 and 16 parts, the rows in order
    and longest first, contexts of 1 to 1,500 keys (partial blocks), output poisoned first;
    and its reads through the tensor memory accelerator bit for bit against its direct loads."""
    capability = torch.cuda.get_device_capability(device)
    if fp8_decode.library(capability) is None:
        return False, "the kernel was not built (see the warning above)"
    rng = random.Random(seed)
    torch.manual_seed(seed)
    kv_heads, dim, block_size = 4, 128, BLOCK_SIZE
    lens = [1, 2, 15, 16, 17, 100, 999, 1500] + [rng.randint(1, 1200) for _ in range(24)]
    need = [-(-n // block_size) for n in lens]
    host_tables = block_tables(lens, runs=False, seed=seed)  # blocks scattered over the cache
    tables, seq_lens = host_tables.to(device), torch.tensor(lens, dtype=torch.int32, device=device)
    fp8 = torch.float8_e4m3fn
    shape = (sum(need), block_size, kv_heads, dim)
    cache_k = (torch.randn(shape, device=device) * 2).to(fp8)
    cache_v = torch.randn(shape, device=device).to(fp8)
    # The slots of a row's last block past its end hold a NaN's bytes: none may leak out.
    for row, n in enumerate(lens):
        if n % block_size:
            last = int(host_tables[row, need[row] - 1])
            for cache in (cache_k, cache_v):
                cache.view(torch.uint8)[last, n % block_size :] = 0x7F
    order = torch.argsort(seq_lens, descending=True)
    worst = worst_triton = 0.0
    apart = []  # cases where the TMA kernel's bits differ from the direct loads'
    for group in fp8_decode.GROUPS:
        q = torch.randn(len(lens), group * kv_heads, dim, device=device, dtype=torch.bfloat16)
        expected = torch.empty(q.shape, device=device)
        for row, n in enumerate(lens):
            slots = tables[row, : need[row]].long()
            k = cache_k[slots].float().reshape(-1, kv_heads, dim)[:n]
            v = cache_v[slots].float().reshape(-1, kv_heads, dim)[:n]
            k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
            scores = torch.einsum("hd,nhd->hn", q[row].float(), k) * dim**-0.5
            expected[row] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
        for splits, rows_order in itertools.product((1, 4, 16), (None, order)):
            outs = []
            for native in (True, False):
                _poison_allocator(device)
                out = torch.empty_like(q)
                decode_attention(
                    q, cache_k, cache_v, tables, seq_lens, out, len(lens), dim**-0.5,
                    splits=splits, order=rows_order, native=native,
                )  # fmt: skip
                outs.append(out.float())
            rel = [((o - expected).norm() / expected.norm()).item() for o in outs]
            if any(o.isnan().any().item() for o in outs):
                return False, f"NaN in the output (group {group}, {splits} parts)"
            worst, worst_triton = max(worst, rel[0]), max(worst_triton, rel[1])
        for splits, rows_order in itertools.product((1, 4), (None, order)):
            case = (q, cache_k, cache_v, tables, seq_lens, splits, rows_order)
            if not _fp8_decode_paths_agree(*case):
                apart.append((group, splits, rows_order is not None))
    ok = worst < 1e-2 and not apart
    paths = f"apart at (group, parts, ordered) {apart}" if apart else "bit-identical"
    return ok, (
        f"rel err at most {worst:.2e} (Triton's on the same cases {worst_triton:.2e}); "
        f"TMA and direct loads {paths}"
    )


def _fp8_decode_paths_agree(q, cache_k, cache_v, tables, seq_lens, splits, order) -> bool:
    """Whether the CUDA kernel's two ways of reading the cache (the tensor memory accelerator
    from compute capability 9.0, direct loads before it) give the same bits: the same arithmetic
    in the same order. Before 9.0 both calls take the direct loads."""
    lib = fp8_decode.library(torch.cuda.get_device_capability(q.device))
    rows, heads, dim = q.shape
    results = []
    for tma in (True, False):
        out = torch.full_like(q, float("nan"))
        parts = torch.full((rows, heads, splits, dim), float("nan"), device=q.device)
        stats = torch.full((rows, heads, splits, 2), float("nan"), device=q.device)
        fp8_decode.decode(
            lib, q, cache_k, cache_v, tables, seq_lens, out, rows, dim**-0.5, splits, parts,
            stats, order, tma=tma,
        )  # fmt: skip
        results.append(out if splits == 1 else torch.cat([parts.flatten(), stats.flatten()]))
    # Compared as bytes: a part with no keys leaves -inf either way.
    return torch.equal(results[0].view(torch.uint8), results[1].view(torch.uint8))


def _greedy(runtime: Runtime, prompts: list[list[int]], n: int) -> list[tuple[int, ...]]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    outputs = run_all(runtime, [GenerationRequest(prompt, params) for prompt in prompts])
    return [tuple(output.token_ids) for output in outputs]


def check_end_to_end(shape: str, device: torch.device, seed: int) -> tuple[bool, str]:
    config = dict(device="cuda", max_batch_size=8, max_model_len=512)
    fast = Runtime(
        random_checkpoint(shape, device, seed),
        DeploymentOptions(attention_backend="triton", **config),
    )
    ref = Runtime(
        random_checkpoint(shape, device, seed),
        DeploymentOptions(attention_backend="torch", **config),
    )
    rng = random.Random(seed)
    vocab = fast.checkpoint.config.vocab_size
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(20, 300))] for _ in range(8)]
    got, want = _greedy(fast, prompts, 32), _greedy(ref, prompts, 32)
    # (prompt, token, bf16 top-2 gap, the token's request) of each divergence
    divergences = []
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a == b:
            continue
        j = next(j for j in range(32) if a[j] != b[j])
        params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
        request = GenerationRequest(prompts[i] + list(b[:j]), params)
        (entry,) = run_all(ref, [request])[0].outputs[0].logprobs
        divergences.append((i, j, entry.top[0].logprob - entry.top[1].logprob, request))
    # The float32 arbiter comes after the bf16 runtimes are gone: the three of a 9B model do
    # not fit an 80 GB card together.
    del fast, ref
    gc.collect()
    torch.cuda.empty_cache()
    lines, ok = [], True
    exact: Runtime | None = None
    for i, j, gap, request in divergences:
        near_tie = gap < 0.1
        verdict = "near-tie" if near_tie else "NOT a near-tie"
        if not near_tie:
            # bf16 logits of magnitude 16-32 are 0.125 apart: a gap of one step may still be
            # a tie the rounding broke. The arbiter is float32: the two picks within 0.1 there.
            if exact is None:
                exact = Runtime(
                    random_checkpoint(shape, device, seed),
                    DeploymentOptions(attention_backend="torch", dtype="float32", **config),
                )
            (top,) = run_all(exact, [request])[0].outputs[0].logprobs
            found = {t.token_id: t.logprob for t in top.top}
            picks = got[i][j], want[i][j]
            if all(p in found for p in picks):
                gap32 = abs(found[picks[0]] - found[picks[1]])
                # Where float32 ranks the Triton path's pick first of the two, the bf16
                # reference's rounding parted them, not the path under test.
                fast_right = found[picks[0]] >= found[picks[1]]
                near_tie = gap32 < 0.1 or fast_right
                verdict = f"float32 gap of the two picks {gap32:.3f}, " + (
                    "the Triton path's ahead: the reference's rounding"
                    if fast_right
                    else "the reference's ahead: " + ("near-tie" if near_tie else "NOT a near-tie")
                )
            else:
                verdict = "a pick outside float32's top 5: NOT a near-tie"
        ok &= near_tie
        lines.append(f"prompt {i}: diverges at token {j}, bf16 top-2 gap {gap:.3f} ({verdict})")
    del exact
    gc.collect()
    torch.cuda.empty_cache()
    same = sum(a == b for a, b in zip(got, want, strict=True))
    return ok, f"{same}/8 identical for 32 tokens" + ("; " + "; ".join(lines) if lines else "")


def check_first_logprobs(shape: str, device: torch.device, seed: int) -> tuple[bool, str]:
    """The top-20 logprobs of the first token after 8 prompts, from the Triton backend (CUDA
    graphs, overlapped steps) and the torch backend in bf16, each against the torch backend in
    float32 on the same weights: the Triton path must stay as close to float32 as the bf16
    reference does (its largest deviation at most 1.5 times the reference's, plus 0.05). For
    models whose bf16 greedy tokens part from float32's within a few tokens (gpt-oss's random
    shape: routing among near-tied experts), where check 4 cannot tell a bug from rounding."""
    config = dict(device="cuda", max_batch_size=8, max_model_len=512)
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    tops: dict[str, list[dict[int, float]]] = {}
    for name, backend, dtype in (
        ("float32", "torch", "float32"),
        ("torch", "torch", None),
        ("triton", "triton", None),
    ):
        runtime = Runtime(
            random_checkpoint(shape, device, seed),
            DeploymentOptions(attention_backend=backend, dtype=dtype, **config),
        )
        if not prompts:
            vocab = runtime.checkpoint.config.vocab_size
            prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(20, 300))]
                       for _ in range(8)]  # fmt: skip
        params = SamplingParams(max_tokens=1, temperature=0, logprobs=20)
        outputs = run_all(runtime, [GenerationRequest(p, params) for p in prompts])
        tops[name] = [
            {t.token_id: t.logprob for t in output.outputs[0].logprobs[0].top} for output in outputs
        ]
        del runtime
        torch.cuda.empty_cache()

    def deviation(name: str) -> float:
        return max(
            abs(ours[t] - exact[t])
            for ours, exact in zip(tops[name], tops["float32"], strict=True)
            for t in ours
            if t in exact
        )

    triton, torch_bf16 = deviation("triton"), deviation("torch")
    ok = triton <= 1.5 * torch_bf16 + 0.05
    return ok, (
        f"largest |logprob - float32's| of the top 20: triton {triton:.3f}, "
        f"torch bf16 {torch_bf16:.3f}"
    )


def _picture(rng: np.random.Generator, size: tuple[int, int] = (240, 320)) -> Image.Image:
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def _clip(rng: np.random.Generator) -> np.ndarray:
    """A chirp with noise, 3 to 40 s (1 or 2 of the encoder's 30 s windows)."""
    seconds = float(rng.uniform(3, 40))
    t = np.arange(int(seconds * 16000)) / 16000
    chirp = 0.3 * np.sin(2 * np.pi * (200 + 50 * t) * t)
    return (chirp + 0.02 * rng.standard_normal(t.size)).astype(np.float32)


# What each media check feeds: the model shape, the kind, and a random item.
MEDIA_CHECKS = {
    "llava": ("llava-clip-b16-smollm2", "image", _picture),
    # Images of different sizes: different grids, so different M-RoPE shifts per row.
    "qwen2-vl": (
        "qwen2-vl-2b",
        "image",
        lambda rng: _picture(rng, tuple(int(x) for x in rng.integers(100, 500, 2))),
    ),
    "voxtral": ("voxtral-mini-3b", "audio", _clip),
}


def check_media(which: str, device: torch.device, seed: int) -> tuple[bool, str]:
    shape, kind, make = MEDIA_CHECKS[which]
    config = dict(device="cuda", max_batch_size=8, max_model_len=2048, enable_context_reuse=False)
    fast = Runtime(
        random_checkpoint(shape, device, seed),
        DeploymentOptions(attention_backend="triton", **config),
    )
    ref = Runtime(
        random_checkpoint(shape, device, seed),
        DeploymentOptions(attention_backend="torch", cuda_graphs=False, overlap=False, **config),
    )
    rng = np.random.default_rng(seed)
    placeholder = fast.input_processor.placeholder(kind)
    prompts = []
    for _ in range(8):
        text = rng.integers(100, 40000, int(rng.integers(8, 60))).tolist()
        prompts.append(([1, *text[:5], placeholder, *text[5:]], make(rng)))

    def request(runtime: Runtime, index: int, prefix=(), **params) -> GenerationRequest:
        ids, item = prompts[index]
        expanded, media = runtime.input_processor.expand_media(ids, {kind: item})
        return GenerationRequest([*expanded, *prefix], SamplingParams(**params), media=media)

    def greedy(runtime: Runtime) -> list[tuple[int, ...]]:
        params = dict(max_tokens=32, temperature=0, ignore_eos=True)
        requests = [request(runtime, i, **params) for i in range(len(prompts))]
        return [tuple(o.token_ids) for o in run_all(runtime, requests)]

    def gap(index: int, prefix: tuple[int, ...]) -> float:
        one = request(ref, index, prefix, max_tokens=1, temperature=0, logprobs=2)
        (entry,) = run_all(ref, [one])[0].outputs[0].logprobs
        return entry.top[0].logprob - entry.top[1].logprob

    got, want = greedy(fast), greedy(ref)
    lines, ok = [], True
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a == b:
            continue
        j = next(j for j in range(32) if a[j] != b[j])
        top2 = gap(i, b[:j])
        near_tie = top2 < 0.1
        ok &= near_tie
        lines.append(
            f"prompt {i}: diverges at token {j}, reference top-2 gap {top2:.3f}"
            f" ({'near-tie' if near_tie else 'NOT a near-tie'})"
        )
    # The encoder in bf16 against the same weights in float32 on the CPU, on two items.
    encoder = next(iter(fast.executor.runner.model.media_encoders().values()))
    items = [m.data for m in request(fast, 0).media + request(fast, 1).media]
    exact = torch.cat(copy.deepcopy(encoder).float().cpu().encode(items))
    error = ((torch.cat(encoder.encode(items)).float().cpu() - exact).norm() / exact.norm()).item()
    ok &= error < 2e-2
    same = sum(a == b for a, b in zip(got, want, strict=True))
    return ok, f"{same}/8 identical for 32 tokens; encoder rel. err {error:.2e}" + (
        "; " + "; ".join(lines) if lines else ""
    )


def run_all(runtime: Runtime, requests: list[GenerationRequest]) -> list:
    """Every request admitted into one session at once; their outputs in order."""
    session = runtime.new_session()
    refs = {session.admit(request).ref: i for i, request in enumerate(requests)}
    outputs = {}
    while session.residents():
        for ref, snapshot in session.step().finished.items():
            outputs[refs[ref]] = materialize([snapshot])
    session.finish()
    return [outputs[i] for i in range(len(requests))]


def check_batch_invariance(device: torch.device, seed: int) -> tuple[bool, str]:
    """One request (a 100-token prompt, 24 greedy tokens with their top-5 logprobs) on a
    random-weight Qwen3-0.6B-shaped model, alone and beside 1, 7 and 63 others (prompts of
    20-300 tokens, 8-40 tokens each, so its steps' company changes as they finish; prefills
    chunked at 2,048 tokens a step): with batch_invariant=True its tokens and logprobs must be
    the same bits every time (logprobs are its logits less their log-sum-exp, per row). The
    default mode is run alike and reported, not required."""
    rng = random.Random(seed)
    checkpoint = random_checkpoint("qwen3-0.6b", device, seed)
    vocab = checkpoint.config.vocab_size
    target = GenerationRequest(
        [rng.randrange(1, vocab) for _ in range(100)],
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=5),
    )
    others = [
        GenerationRequest(
            [rng.randrange(1, vocab) for _ in range(rng.randint(20, 300))],
            SamplingParams(max_tokens=rng.randint(8, 40), temperature=0, ignore_eos=True),
        )
        for _ in range(63)
    ]
    details, ok = [], True
    for invariant in (True, False):
        runtime = Runtime(
            checkpoint,
            DeploymentOptions(
                device="cuda",
                max_batch_size=64,
                max_model_len=512,
                max_num_tokens=2048,
                batch_invariant=invariant,
            ),
        )
        runs = [run_all(runtime, [target, *others[:n]])[0] for n in (0, 1, 7, 63)]
        same = [
            r.token_ids == runs[0].token_ids
            and r.outputs[0].logprobs == runs[0].outputs[0].logprobs
            for r in runs[1:]
        ]
        if invariant:
            ok = all(same)
        mode = "batch_invariant" if invariant else "default mode"
        details.append(f"{mode}: beside 1, 7, 63 identical to alone {same}")
        del runtime
        torch.cuda.empty_cache()
    return ok, "; ".join(details)


def check_moe_kernel(device: torch.device, seed: int) -> tuple[bool, str]:
    config = MoEConfig(128, 8, 768, (0,))
    hidden, tokens = 2048, 256
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16) * 0.02

    first, second = normal(128, 2 * 768, hidden), normal(128, hidden, 768)
    with torch.device("meta"):
        experts = Experts(
            hidden, config, Platform(device, torch.bfloat16),
            LinearMethods(TorchLinearMethod()), "experts",
        )  # fmt: skip
    experts = experts.to_empty(device=device).to(torch.bfloat16)
    experts.load("gate_up_proj", first)
    experts.load("down_proj", second)
    experts.finish_loading()
    x = normal(tokens, hidden) * 50
    ids = torch.stack(
        [torch.randperm(128, generator=gen, device=device)[:8] for _ in range(tokens)]
    )
    weights = torch.rand(tokens, 8, generator=gen, device=device).softmax(dim=-1)
    with torch.no_grad():
        got = experts(x, weights, ids)
        want = torch.zeros(tokens, hidden, device=device)
        f32 = x.float()
        for e in range(128):
            token, slot = (ids == e).nonzero(as_tuple=True)
            if token.numel():
                gate, up = F.linear(f32[token], first[e].float()).chunk(2, dim=-1)
                y = F.linear(F.silu(gate) * up, second[e].float())
                want.index_add_(0, token, y * weights[token, slot].unsqueeze(1))
        rel = ((got.float() - want).norm() / want.norm()).item()
        alone = all(
            torch.equal(experts(x[i : i + 1], weights[i : i + 1], ids[i : i + 1]), got[i : i + 1])
            for i in (0, 17, 255)
        )
        beside = torch.equal(experts(x[:37], weights[:37], ids[:37]), got[:37])
    ok = rel < 1e-2 and alone and beside
    return ok, f"rel err {rel:.2e}, a token alone {alone}, beside 36 {beside}"


def check_fused_ops(device: torch.device, seed: int) -> tuple[bool, str]:
    """The fused RMSNorm (+ residual add) and SiLU-mul kernels against the torch formulas they
    replace, in bf16: within two bf16 rounding steps (a reduction order or an exp may round
    differently once, and the product rounds again), every element written."""
    from inflight.model.kernels.triton import ops as triton_ops

    torch.manual_seed(seed)
    _poison_allocator(device)
    x, res = (torch.randn(77, 1024, device=device, dtype=torch.bfloat16) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(1024, device=device)).to(torch.bfloat16)
    gate_up = 4 * torch.randn(77, 2 * 3072, device=device, dtype=torch.bfloat16)

    def ref_norm(v: torch.Tensor) -> torch.Tensor:
        f = v.float()
        return weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6)).to(v.dtype)

    normed, summed = triton_ops.rms_norm(x, weight, 1e-6, res)
    plain, _ = triton_ops.rms_norm(x, weight, 1e-6)
    gate, up = gate_up.split(3072, dim=-1)
    pairs = {
        "norm": (plain, ref_norm(x)),
        "add+norm": (normed, ref_norm(x + res)),
        "sum": (summed, x + res),
        "silu*up": (triton_ops.silu_mul(gate_up), torch.nn.functional.silu(gate) * up),
    }
    # (got, want, the magnitude under which errors count as at that magnitude, ulps allowed)
    checked = {name: (*pair, 1e-3, 2.01) for name, pair in pairs.items()}
    # RoPE sums two products of inputs of magnitude ~1 (randn, or normed): an ulp there is
    # what an output near zero may be off by. A float8 cache's step is 16 bf16 ulps: one
    # rounding there may land either side.
    rope_pairs, stray = _rope_store_pairs(device)
    for name, pair in rope_pairs.items():
        checked[name] = (*pair, 1.0, 16.01 if "fp8" in name else 2.01)
    worst, ok = [f"rope writes outside their slots {stray}"], stray == 0
    for name, (got, want, floor, allowed) in checked.items():
        # One bf16 step at the value's magnitude: 2^-7 relative.
        ulps = ((got.float() - want.float()).abs() / want.float().abs().clamp_min(floor)) * 128
        ok &= bool(torch.isfinite(got.float()).all()) and ulps.max().item() <= allowed
        worst.append(f"{name} {ulps.max().item():.2f} ulp")
    return ok, ", ".join(worst)


def _rope_store_pairs(
    device: torch.device,
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], int]:
    """The fused norm + RoPE + KV store kernel against its formula: q and k normed per head
    (each rounded to bf16 where the torch modules round), rotated in float32, rounded once; k
    and v at scattered slots of caches poisoned with NaN. With and without the norms (Qwen3,
    Llama) and into a float8 cache, 16 query and 8 KV heads of 128. Also how many elements it
    wrote outside the tokens' slots (still NaN unless written)."""
    from inflight.model.kernels.triton.rope import rope_store

    tokens, heads, kv_heads, dim, eps = 77, 16, 8, 128, 1e-6
    bf16 = torch.bfloat16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device=device, dtype=bf16)
    angle = torch.rand(tokens, 1, dim // 2, device=device) * 40
    angle = torch.cat((angle, angle), dim=-1)
    cos, sin = angle.cos().to(bf16), angle.sin().to(bf16)
    weights = [(1 + 0.1 * torch.randn(dim, device=device)).to(bf16) for _ in range(2)]
    slots = torch.randperm(64 * 16, device=device)[:tokens]
    pairs, stray = {}, 0
    for normed, kv_dtype in ((True, bf16), (False, bf16), (True, torch.float8_e4m3fn)):
        nan = torch.full((64, 16, kv_heads, dim), float("nan"), device=device, dtype=bf16)
        caches = [nan.to(kv_dtype)]
        caches.append(caches[0].clone())
        norms = (weights[0], weights[1], eps) if normed else None
        q = rope_store(qkv, heads, kv_heads, (cos, sin), slots, *caches, norms)
        parts = qkv.view(tokens, -1, dim).float().split([heads, kv_heads, kv_heads], dim=1)
        rotated = []
        for x, w in zip(parts[:2], weights, strict=True):
            if normed:
                x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
                x = (w.float() * x.to(bf16).float()).to(bf16).float()
            half = torch.cat((-x[..., dim // 2 :], x[..., : dim // 2]), dim=-1)
            rotated.append(x * cos.float() + half * sin.float())
        tag = ("qk-norm+rope" if normed else "rope") + (" fp8" if kv_dtype != bf16 else "")
        k_cache, v_cache = (c.view(-1, kv_heads, dim) for c in caches)
        pairs[f"{tag} q"] = (q, rotated[0].to(bf16))
        pairs[f"{tag} k"] = (k_cache[slots], rotated[1].to(kv_dtype))
        pairs[f"{tag} v"] = (v_cache[slots], parts[2].to(kv_dtype))
        untouched = torch.ones(k_cache.shape[0], dtype=torch.bool, device=device)
        untouched[slots] = False
        stray += sum(int((~c[untouched].float().isnan()).sum()) for c in (k_cache, v_cache))
    return pairs, stray


def check_lora(device: torch.device, seed: int) -> tuple[bool, str]:
    """Each token's output within two bf16 roundings of its row's size (y + update rounds once,
    and the masked path rounds x A^T too); base tokens keep their bits."""
    from inflight.model.layers.lora import LoRAMapping, LoRASlots

    gen = torch.Generator().manual_seed(seed)
    parts = [2048, 512, 512]
    slots = LoRASlots(1024, parts, max_loras=3, max_rank=16).to(device, torch.bfloat16)
    factors = {
        0: (
            16,
            [
                (torch.randn(16, 1024, generator=gen), torch.randn(p, 16, generator=gen))
                for p in parts
            ],
        ),
        1: (
            8,
            [
                (torch.randn(8, 1024, generator=gen), torch.randn(2048, 8, generator=gen)),
                None,
                None,
            ],
        ),
    }
    for slot, (rank, fs) in factors.items():
        slots.write(
            slot, [None if f is None else (f[0] * 0.05, f[1] * 0.05) for f in fs], rank, 2.0
        )
    token_slots = [0, -1, 1, 2, 0, 1, -1, 0] * 5
    x = torch.randn(len(token_slots), 1024, generator=gen).to(device, torch.bfloat16)
    y0 = torch.randn(len(token_slots), 3072, generator=gen).to(device, torch.bfloat16)
    want = y0.double().clone()
    for t, slot in enumerate(token_slots):
        if slot in factors:
            rank, fs = factors[slot]
            for (lo, hi), f in zip([(0, 2048), (2048, 2560), (2560, 3072)], fs, strict=True):
                if f is not None:
                    a, b = (v.double().to(device) * 0.05 for v in f)
                    want[t, lo:hi] += 2.0 * (x[t].double() @ a.T) @ b.T
    rows = [(slot, 1) for slot in token_slots]
    mappings = {
        "indexed": LoRAMapping.indexed(rows, device),
        "masked": LoRAMapping.masked(rows, 3, torch.bfloat16, device),
    }
    ok, worst = True, []
    base = [t for t, slot in enumerate(token_slots) if slot not in factors]
    for name, mapping in mappings.items():
        y = y0.clone()
        slots.add(y, x, mapping)
        scale = want.abs().amax(dim=1, keepdim=True)
        err = ((y.double() - want).abs() / scale).max().item()
        # bf16 keeps 8 bits: 2^-9 of a row's size per rounding, at most two roundings.
        ok &= err <= 2 * 2**-8 and torch.equal(y[base], y0[base])
        worst.append(f"{name} {err:.2e} of the row")
    return ok, ", ".join(worst)


def check_fp8(device: torch.device, seed: int) -> tuple[bool, str]:
    """The Triton activation quantizer against the torch formula (bit for bit; rows of 20,000
    read in two passes, the others in one), the norm and SiLU-mul kernels that quantize their
    rows for an FP8 layer against the kernel then the quantizer (bit for bit), and the FP8
    linear against its float64 formula:
    1, 2, 5, 40, 100 and 128 rows take the few-rows kernel (K 4,096, 20,000, 14,336, 2,080 (no
    multiple of its step), 4,096 and 14,336: 512 outputs, so K is cut in 2 or 4 parts; the rows
    in two tiles of 64 at 100 and 128), 137 and 256 rows (K 4,096 and 14,336) cuBLASLt's
    tensorwise GEMM and the scaling kernel after it, 300 rows cuBLASLt's rowwise GEMM."""
    from inflight.model.kernels.triton import ops as triton_ops
    from inflight.model.layers.linear import Linear, process_weights_after_loading
    from inflight.model.layers.platform import Platform
    from inflight.model.layers.quantization import FP8_MAX, Fp8LinearMethod, fp8_rows

    torch.manual_seed(seed)
    exact, worst = True, 0.0
    for tokens, size in (
        (1, 4096),
        (5, 14336),
        (300, 2048),
        (64, 1000),
        (40, 2080),
        (2, 20000),
        (100, 4096),
        (128, 14336),
        (137, 4096),
        (256, 14336),
    ):
        x = torch.randn(tokens, size, device=device, dtype=torch.bfloat16)
        if tokens > 1:
            x[0] = 0  # an all-zero row keeps scale 1
        q, scale = triton_ops.fp8_rows(x, FP8_MAX)
        ref_q, ref_scale = fp8_rows(x)
        exact &= torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
        exact &= torch.equal(scale, ref_scale)
        if size % 16:
            continue
        method = Fp8LinearMethod(Platform(device, torch.bfloat16))
        layer = Linear(size, 512, True, method).to(device, torch.bfloat16)
        with torch.no_grad():
            layer.weight.normal_()
            layer.bias.normal_()
        bias = layer.bias.detach().double()
        process_weights_after_loading(layer)
        wq, w_scale = layer.prepared
        want = (ref_q.double() * ref_scale.double()) @ (wq.double() * w_scale.double()).T + bias
        got = layer(x).double()
        worst = max(worst, ((got - want).norm() / want.norm()).item())
    differing = _fused_fp8_differing(device)
    ok = exact and not differing and worst < 1e-2
    return ok, (
        f"quantizer bit-exact {exact}; norm and SiLU-mul quantizing their rows bit-exact "
        f"{not differing}{f' (not: {differing})' if differing else ''}; "
        f"linear rel err {worst:.2e} against its formula"
    )


def _fused_fp8_differing(device: torch.device) -> list[str]:
    """Where the norm and SiLU-mul kernels that quantize their own rows do not give the bits of
    the kernel then the quantizer (rows of 1,024, 4,096, 14,336 and, past one kernel's reach,
    20,000; with and without the residual; an all-zero row): none, if all agree."""
    from inflight.model.kernels.triton import ops as triton_ops
    from inflight.model.layers.quantization import FP8_MAX

    differing = []
    for tokens, size in ((77, 1024), (300, 4096), (5, 14336), (3, 20000)):
        x, res = (torch.randn(tokens, size, device=device, dtype=torch.bfloat16) for _ in range(2))
        x[0], res[0] = 0, 0
        weight = (1 + 0.1 * torch.randn(size, device=device)).to(torch.bfloat16)
        gate_up = 4 * torch.randn(tokens, 2 * size, device=device, dtype=torch.bfloat16)
        gate_up[0] = 0
        silu = triton_ops.silu_mul_fp8(gate_up, FP8_MAX), triton_ops.silu_mul(gate_up), None
        pairs = [(f"SiLU-mul {size}", *silu)]
        for r in (None, res):
            values, scales, summed = triton_ops.rms_norm_fp8(x, weight, 1e-6, r, FP8_MAX)
            normed, want_summed = triton_ops.rms_norm(x, weight, 1e-6, r)
            name = f"norm {size}{'' if r is None else ' + residual'}"
            pairs.append((name, (values, scales), normed, (summed, want_summed)))
        for name, (values, scales), floats, sums in pairs:
            want_values, want_scales = triton_ops.fp8_rows(floats, FP8_MAX)
            same = torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))
            same &= torch.equal(scales, want_scales)
            if sums is not None and sums[1] is not None:
                same &= torch.equal(*sums)
            if not same:
                differing.append(name)
    return differing


def check_mamba_decode(device: torch.device, seed: int) -> tuple[bool, str]:
    """The Triton recurrent step of Mamba2 decode rows against the torch formula in float32:
    rows in scattered slots, heads sharing B and C in groups; the other slots untouched."""
    from inflight.model.kernels.triton.mamba import ssm_decode
    from inflight.model.layers.mamba import ssm_decode as torch_ssm_decode

    torch.manual_seed(seed)
    rows, heads, head_dim, d_state, groups, num_slots = 13, 16, 64, 128, 2, 40
    state = torch.randn(num_slots, heads, head_dim, d_state, device=device)
    slots = torch.randperm(num_slots, device=device)[:rows]
    x = torch.randn(rows, heads, head_dim, device=device)
    dt = torch.rand(rows, heads, device=device) * 0.2
    a = -torch.rand(heads, device=device) * 4
    b, c = (torch.randn(rows, groups, d_state, device=device) for _ in range(2))
    d = torch.randn(heads, device=device)
    want = state.clone()
    want_y = torch_ssm_decode(want, slots, x, dt, a, b, c, d)
    y = ssm_decode(state, slots, x, dt, a, b, c, d)
    state_err = ((state - want).abs().max() / want.abs().max()).item()
    y_err = ((y - want_y).abs().max() / want_y.abs().max()).item()
    ok = state_err < 1e-6 and y_err < 1e-5
    return ok, f"state rel err {state_err:.1e}, y rel err {y_err:.1e} (float32)"


def check_structured_outputs(device: torch.device, seed: int) -> tuple[bool, str]:
    """Constrained rows beside free ones on CUDA (masks applied on the device, steps without
    overlap while they live): every constrained output is a string of its language. A random
    Qwen3-0.6B-shaped model with the embedded model's tokenizer, which the grammars need
    ($INFLIGHT_TOKENIZER: a checkpoint to take it from where the GGUF cannot be read;
    `bench/tokenizer_checkpoint.py` writes one small enough to carry)."""
    import json
    import re

    from inflight.model.checkpoints.loader import open_checkpoint

    tokenizer = open_checkpoint(os.environ.get("INFLIGHT_TOKENIZER")).tokenizer
    checkpoint = random_checkpoint("qwen3-0.6b", device, seed, tokenizer)
    runtime = Runtime(
        checkpoint, DeploymentOptions(device="cuda", max_batch_size=8, max_model_len=512)
    )
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 0, "maximum": 999},
            "tag": {"enum": ["a", "b"]},
        },
        "required": ["n", "tag"],
        "additionalProperties": False,
    }
    constraints = [
        ({"regex": "[0-9]{2}-[a-z]{3}"}, lambda t: re.fullmatch("[0-9]{2}-[a-z]{3}", t)),
        ({"choice": ["north", "south"]}, lambda t: t in ("north", "south")),
        ({"json": schema}, lambda t: set(json.loads(t)) == {"n", "tag"}),
    ]
    session = runtime.new_session()
    refs = {}
    for i in range(8):
        constraint, member = constraints[i % 3] if i % 2 else (None, None)
        params = SamplingParams(
            max_tokens=48, temperature=1.0, seed=seed * 8 + i, structured_outputs=constraint
        )
        refs[session.admit(GenerationRequest([5 + i, 9, 11], params)).ref] = member
    bad = []
    while session.residents():
        for ref, snapshot in session.step().finished.items():
            member = refs[ref]
            if member is not None and (
                snapshot.finish_reason.value != "stop" or not member(snapshot.text)
            ):
                bad.append(repr(snapshot.text))
    session.finish()
    return not bad, f"4 constrained of 8 rows: {len(bad)} outside their language {bad}"


def _sorted_keeps(
    logits: torch.Tensor, top_k: list, top_p: list, min_p: list
) -> tuple[torch.Tensor, torch.Tensor]:
    """The filters by their definition, over each whole row sorted in float64 on the host; and
    the tokens at a cut's edge (the mass before them within 1e-5 of top_p), where float32 sums
    of ~40,000 small probabilities may round to either side."""
    keep = torch.zeros(logits.shape, dtype=torch.bool)
    edge = torch.zeros(logits.shape, dtype=torch.bool)
    for i, row in enumerate(logits.double().cpu()):
        ordered, order = row.sort(descending=True)
        k = top_k[i] if top_k[i] > 0 else len(row)
        probs = torch.softmax(ordered[:k], dim=-1)
        kept = probs >= min_p[i] * probs[0]
        if top_p[i] < 1:
            before = probs.cumsum(0) - probs
            kept &= before < top_p[i]
            edge[i, order[:k][(before - top_p[i]).abs() < 1e-5]] = True
        kept[0] = True
        keep[i, order[:k][kept]] = True
    return keep, edge


def check_sampler(device: torch.device, seed: int) -> tuple[bool, str]:
    """The sampler on the device (rows of 49,152 tokens): top-k / top-p / min-p keep what a
    float64 sort of each whole row keeps but at a nucleus's rounding edge, also with 8
    candidates (the wider looks and whole-row sorts); a seeded row draws the same token alone
    and beside 15 other rows; 20,000 draws of a top-p row stay in its nucleus, its likeliest
    tokens within 4.5 sigma of their share."""
    rng, vocab = random.Random(seed), 49_152
    g = torch.Generator(device=device).manual_seed(seed)
    rows_checked, bad = 0, 0
    saved = sampler_module._CANDIDATES
    try:
        for candidates in (saved, 8):
            sampler_module._CANDIDATES = candidates
            for _ in range(6):
                logits = torch.randn(16, vocab, device=device, generator=g)
                logits *= rng.choice([0.5, 2.0, 4.0])
                top_k = [rng.choice([0, 0, 1, 5, 50, 2000]) for _ in range(16)]
                top_p = [rng.choice([1.0, 0.9, 0.5, 0.99, 1e-6]) for _ in range(16)]
                min_p = [rng.choice([0.0, 0.0, 0.05]) for _ in range(16)]
                got = sampler_module._filter(logits, top_k, top_p, min_p) > float("-inf")
                want, edge = _sorted_keeps(logits, top_k, top_p, min_p)
                bad += int(((got.cpu() != want) & ~edge).any(dim=-1).sum())
                rows_checked += 16
    finally:
        sampler_module._CANDIDATES = saved
    sampler = Sampler(seed=seed, device=device)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234 + seed)
    mine = torch.randn(1, vocab, device=device, generator=g)
    same = True
    for position in range(8):
        alone = sampler(mine, [SamplingRow(seeded, position)])[0].token_id
        others = torch.randn(15, vocab, device=device, generator=g)
        params = [SamplingParams(temperature=0.7, top_k=rng.choice([0, 20])) for _ in range(15)]
        batch = [SamplingRow(p, position) for p in params]
        together = sampler(
            torch.cat([others[:7], mine, others[7:]]),
            [*batch[:7], SamplingRow(seeded, position), *batch[7:]],
        )
        same &= together[7].token_id == alone
    logits = torch.randn(1, vocab, device=device, generator=g) * 0.5
    logits[0, :4] = torch.tensor([12.0, 11.5, 11.0, 10.0], device=device)
    keep = _sorted_keeps(logits / 0.8, [0], [0.9], [0.0])[0][0]
    probs = torch.softmax((logits[0].cpu() / 0.8).masked_fill(~keep, float("-inf")).double(), -1)
    rows = [SamplingRow(SamplingParams(temperature=0.8, top_p=0.9), 0)] * 100
    counts = np.bincount(
        [o.token_id for _ in range(200) for o in sampler(logits.expand(100, -1), rows)],
        minlength=vocab,
    )
    outside = int(counts[~keep.numpy()].sum())
    shares = [(counts[t] / 20_000, probs[t].item()) for t in range(4)]
    sigmas = [abs(f - p) / math.sqrt(p * (1 - p) / 20_000) for f, p in shares if 0 < p < 1]
    ok = bool(bad == 0 and same and outside == 0 and max(sigmas) <= 4.5)
    return ok, (
        f"filters: {bad} of {rows_checked} rows differ from the sorted definition; seeded row "
        f"same beside others: {same}; draws outside the nucleus {outside}, largest deviation "
        f"{max(sigmas):.2f} sigma"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="run only the checks whose names hold one")
    parser.add_argument("--seeds", type=int, default=2, help="each check at seeds 0 .. N - 1")
    args = parser.parse_args()
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    failed = False
    rows = []
    checks = (
        ("kernels", check_kernels),
        ("fp8 KV kernels", functools.partial(check_kernels, kv_dtype=torch.float8_e4m3fn)),
        ("fp8 decode CUDA kernel", check_fp8_decode_cuda),
        ("windowed kernels", functools.partial(check_kernels, window=100)),
        ("sink kernels", functools.partial(check_kernels, window=100, sinks=True)),
        ("fused ops", check_fused_ops),
        ("batch invariance", check_batch_invariance),
        ("greedy end to end", functools.partial(check_end_to_end, "qwen3-0.6b")),
        ("mamba decode kernel", check_mamba_decode),
        ("hybrid end to end", functools.partial(check_end_to_end, "bamba-9b")),
        ("structured outputs", check_structured_outputs),
        ("fp8 linear", check_fp8),
        ("sampler", check_sampler),
        ("moe kernel", check_moe_kernel),
        ("moe end to end", functools.partial(check_end_to_end, "qwen3-30b-a3b-4-layers")),
        ("gpt-oss logprobs", functools.partial(check_first_logprobs, "gpt-oss-20b-4-layers")),
        ("lora side paths", check_lora),
        ("images end to end", functools.partial(check_media, "llava")),
        ("M-RoPE images", functools.partial(check_media, "qwen2-vl")),
        ("audio end to end", functools.partial(check_media, "voxtral")),
    )
    chosen = [(n, c) for n, c in checks if not args.names or any(a in n for a in args.names)]
    for name, check in chosen:
        for seed in range(args.seeds):
            start = time.perf_counter()
            ok, detail = check(device, seed)
            failed |= not ok
            rows.append((name, seed, "ok" if ok else "FAIL", time.perf_counter() - start, detail))
            print(rows[-1], flush=True)
    print(f"\n{'check':<20}{'seed':>5}  {'result':<6}{'s':>7}  detail")
    for name, seed, result, seconds, detail in rows:
        print(f"{name:<20}{seed:>5}  {result:<6}{seconds:7.1f}  {detail}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

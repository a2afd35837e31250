"""GPU throughput on the nano-vllm workload: inflight beside HF transformers' `generate_batch`.

Workload: `--requests` requests (256), prompt lengths uniform in [100, 1024], output lengths
uniform in [100, 1024], random token ids, EOS ignored, seed 0; every request handed over at
once. Models: random-weight, bf16, built on the device in the shapes of Qwen3-0.6B and
Llama-3.1-8B (nothing can be downloaded there), or `bamba-9b` (a hybrid Mamba2 model of
Llama-3.1-8B's width; transformers runs it through `generate` in static batches, its
continuous batching keeping no Mamba state). Prints output tok/s per engine and the ratio;
writes JSON to $OUT (or bench/out).

    python3 bench/gpu_throughput.py [--shapes qwen3-0.6b llama-3.1-8b] [--hf qwen3-0.6b]
    python3 bench/gpu_throughput.py --shapes bamba-9b --hf bamba-9b --requests 64 --batch 64
    python3 bench/gpu_throughput.py --hf --quantization fp8   (FP8 weights; Hopper / Ada)
    python3 bench/gpu_throughput.py --hf --kv-cache-dtype fp8   (an FP8 KV cache)
    python3 bench/gpu_throughput.py --shapes qwen3-30b-a3b --hf qwen3-30b-a3b --requests 64
    python3 bench/gpu_throughput.py --batch-invariant   (the mode's cost)
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from inflight.bench.random_model import SHAPES, random_checkpoint
from inflight.bench.report import report_path, write_report
from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.request import GenerationRequest, SamplingParams
from inflight.runtime.runtime import Runtime


def workload(requests: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(1, vocab) for _ in range(rng.randint(100, 1024))], rng.randint(100, 1024))
        for _ in range(requests)
    ]


def _submit_all(engine, items: list[tuple[list[int], int]]) -> float:
    """Output tok/s of handing every request to the engine at once."""
    start = time.perf_counter()
    handles = [
        engine.submit(
            GenerationRequest(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        )
        for p, n in items
    ]
    produced = sum(len(h.get().token_ids) for h in handles)
    return produced / (time.perf_counter() - start)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The workload's size and the runtime's options, as `ready_engine` reads them."""
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--max-num-tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--quantization", default="none", choices=["none", "fp8"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="each row's logits bit-identical whatever shares its step",
    )
    parser.add_argument(
        "--context-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the context cache, on by default as in the runtime (random prompts never hit it)",
    )


def ready_engine(shape: str, work: list[tuple[list[int], int]], args: argparse.Namespace):
    """The engine on a random-weight model of `shape`, sized for `work` at once, its kernels
    compiled by a warm-up request."""
    from inflight.engine import EngineConfig, RequestEngine

    device = torch.device("cuda")
    runtime = Runtime(
        random_checkpoint(shape, device),
        DeploymentOptions(
            device="cuda",
            max_batch_size=args.batch,
            max_model_len=2048 + 16,
            max_num_tokens=args.max_num_tokens,
            block_size=args.block_size,
            enable_context_reuse=args.context_cache,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            batch_invariant=args.batch_invariant,
        ),
    )
    engine = RequestEngine(
        runtime,
        EngineConfig(
            max_batch_size=args.batch,
            max_pending_requests=len(work) + 8,
            command_queue_capacity=len(work) + 8,
        ),
    )
    _submit_all(engine, [(work[0][0][:32], 8)])
    return engine


def run_inflight(shape: str, work: list[tuple[list[int], int]], args: argparse.Namespace) -> dict:
    engine = ready_engine(shape, work, args)
    tok_s = _submit_all(engine, work)
    engine.shutdown()
    return {"output_tok_s": tok_s}


def _hf_fields(shape: str) -> dict:
    """A transformers config's fields for the decoder of the shape."""
    c = SHAPES[shape]
    return dict(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        tie_word_embeddings=c.tie_word_embeddings,
        max_position_embeddings=4096,
    )


def run_hf_hybrid(shape: str, work: list[tuple[list[int], int]], batch: int) -> dict:
    """transformers' `generate` on a Bamba of the shape, in static batches of `batch` prompts
    (left-padded; its continuous batching serves no Mamba state): each batch runs to its
    longest output length, and the throughput counts the tokens of those lengths."""
    from transformers import BambaConfig, BambaForCausalLM

    c = SHAPES[shape]
    m = c.mamba
    assert m is not None
    config = BambaConfig(
        **_hf_fields(shape),
        attn_layer_indices=[i for i, t in enumerate(m.layer_types) if t == "attention"],
        mamba_n_heads=m.n_heads,
        mamba_d_head=m.head_dim,
        mamba_n_groups=m.n_groups,
        mamba_d_state=m.d_state,
        mamba_d_conv=m.d_conv,
        mamba_expand=m.d_inner // c.hidden_size,
        mamba_chunk_size=m.chunk_size,
        pad_token_id=0,
    )
    with torch.device("cuda"):
        model = BambaForCausalLM(config).to(torch.bfloat16).eval()
    produced, elapsed = 0, 0.0
    for start in range(0, len(work), batch):
        chunk = work[start : start + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk], device="cuda")
        mask = (
            torch.arange(width, device="cuda")
            >= width - torch.tensor([len(p) for p, _ in chunk], device="cuda")[:, None]
        ).long()
        longest = max(n for _, n in chunk)
        torch.cuda.synchronize()
        begin = time.perf_counter()
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=0,
            )
        torch.cuda.synchronize()
        elapsed += time.perf_counter() - begin
        produced += longest * len(chunk)
    del model
    torch.cuda.empty_cache()
    return {
        "output_tok_s": produced / elapsed,
        "note": f"generate in static batches of {batch}, each to its longest output",
    }


def run_hf(shape: str, work: list[tuple[list[int], int]]) -> dict:
    import transformers
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    c = SHAPES[shape]
    fields = _hf_fields(shape)
    family = {"qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe"}.get(c.family, "Llama")
    if c.moe is not None:
        fields.update(
            num_experts=c.moe.num_experts,
            num_experts_per_tok=c.moe.top_k,
            moe_intermediate_size=c.moe.intermediate_size,
            norm_topk_prob=c.moe.renormalize,
        )
    config = getattr(transformers, f"{family}Config")(**fields)
    with torch.device("cuda"):
        model = getattr(transformers, f"{family}ForCausalLM")(config).to(torch.bfloat16).eval()
    model.set_attn_implementation("paged|sdpa")
    generation = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(num_blocks=len(work) * 9, max_batch_tokens=8192)
    model.generate_batch(
        [work[0][0][:32]],
        generation_config=generation,
        max_new_tokens=8,
        continuous_batching_config=cb,
    )
    # generate_batch takes one max_new_tokens for every request: each runs to the longest output
    # length. That is more uniform (kinder to batching) than the workload's lengths; the
    # throughput counts the tokens it produced.
    start = time.perf_counter()
    out = model.generate_batch(
        [p for p, _ in work],
        generation_config=generation,
        max_new_tokens=max(n for _, n in work),
        continuous_batching_config=cb,
    )
    elapsed = time.perf_counter() - start
    produced = sum(len(r.generated_tokens) for r in out.values())
    del model
    torch.cuda.empty_cache()
    return {"output_tok_s": produced / elapsed, "note": "every request ran to the longest length"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen3-0.6b", "llama-3.1-8b"])
    parser.add_argument(
        "--hf",
        nargs="*",
        default=[],
        help="shapes to also run through transformers' generate_batch (none unless named: "
        "Qwen3-0.6B's takes minutes, at ~660 tok/s on an H200)",
    )
    parser.add_argument(
        "--hf-batch", type=int, default=64, help="transformers' static batch for hybrid shapes"
    )
    add_engine_args(parser)
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    results: dict[str, dict] = {}
    for shape in args.shapes:
        work = workload(args.requests, SHAPES[shape].vocab_size)
        results[shape] = {"inflight": run_inflight(shape, work, args)}
        print(shape, "inflight", results[shape]["inflight"], flush=True)
        if shape in args.hf:
            if SHAPES[shape].mamba is not None:
                results[shape]["transformers"] = run_hf_hybrid(shape, work, args.hf_batch)
            else:
                results[shape]["transformers"] = run_hf(shape, work)
            print(shape, "transformers", results[shape]["transformers"], flush=True)
    print(f"\n{'shape':<14}{'inflight tok/s':>16}{'transformers tok/s':>20}{'ratio':>8}")
    for shape, r in results.items():
        ours = r["inflight"]["output_tok_s"]
        theirs = r.get("transformers", {}).get("output_tok_s")
        ratio = f"{ours / theirs:8.1f}" if theirs else "       -"
        print(f"{shape:<14}{ours:16.0f}{(theirs or float('nan')):20.0f}{ratio}")
    write_report(
        report_path("gpu_throughput.json"),
        device=torch.cuda.get_device_name(),
        args=vars(args),
        results=results,
    )


if __name__ == "__main__":
    main()

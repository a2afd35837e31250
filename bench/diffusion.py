"""Block diffusion under in-flight batching (DiffusionGemma): output tokens per second and tokens
per forward at 1, 4 and 16 concurrent requests, beside transformers' `generate()` on the same
shape with the same number of rows.

The model is random-weight: `--shape real` is DiffusionGemma-26B-A4B as reconstructed here (no
hub: 30 layers of 2,816, five sliding (window 1,024; 16 query and 8 KV heads of 256) to one
full (2 KV heads of 512, a quarter of it rotated), a dense MLP of 2,112 beside 128 experts of
704, 8 a token; vocab 262,144; canvas 256), `--shape tiny` the tests' model. Random weights
never settle a canvas early: every canvas runs all `--steps` denoising steps, and each step
accepts about one position (their entropies are all near log(vocab)), so tokens per forward
are the floor of what a trained model gives.

Each request is a `--prompt-len` prompt of random ids with `--max-tokens` tokens (whole
canvases; EOS ignored, as transformers' rows run without one), its own seed. Ours:
`--concurrency` requests submitted at once to one LLM (in-flight batching); tok/s is their
tokens over the time until the last ends, tokens per forward the tokens over the model
forwards the runtime made (all rows), tokens per denoising step the tokens over the
canvases' steps (per row, transformers' `tokens_per_forward`). Transformers: `generate()` of
the same rows as one batch.

    .venv/bin/python bench/diffusion.py --shape tiny --concurrency 1 4
    python bench/diffusion.py --shape real --device cuda       # on the GPU machine
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from inflight import LLM  # noqa: E402
from inflight.bench.random_model import RandomWeights, numbered_tokenizer  # noqa: E402
from inflight.bench.report import report_path, write_report  # noqa: E402
from inflight.model import registry  # noqa: E402
from inflight.model.checkpoints.loader import Checkpoint  # noqa: E402
from inflight.protocol.deployment import DeploymentOptions  # noqa: E402
from inflight.protocol.request import (  # noqa: E402
    DiffusionParams,
    GenerationRequest,
    SamplingParams,
)
from inflight.runtime.diffusion.runtime import DiffusionRuntime  # noqa: E402

from diffusion_reference import config_dict  # noqa: E402

REAL = dict(
    text_config=dict(
        vocab_size=262144,
        hidden_size=2816,
        intermediate_size=2112,
        num_hidden_layers=30,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        global_head_dim=512,
        num_global_key_value_heads=2,
        sliding_window=1024,
        num_experts=128,
        top_k_experts=8,
        moe_intermediate_size=704,
        max_position_embeddings=131072,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    ),
    vision_config=dict(model_type="gemma4_vision", num_hidden_layers=1),
    canvas_length=256,
)


def shape(name: str) -> dict:
    return REAL if name == "real" else config_dict()


def random_checkpoint(args, config: dict, device: torch.device) -> Checkpoint:
    parsed = registry.config_from_hf(
        {**config, "architectures": ["DiffusionGemmaForBlockDiffusion"]}
    )
    parsed = replace(parsed, vision=None)  # text prompts: no tower to load
    return Checkpoint(
        path=Path(f"diffusiongemma-{args.shape}-random"),
        config=parsed,
        tokenizer=numbered_tokenizer(parsed.vocab_size),
        source=RandomWeights(parsed, device),
    )


def deployment(args, checkpoint: Checkpoint, device: torch.device) -> dict:
    canvas = checkpoint.config.diffusion.canvas_length
    most = max(args.concurrency)
    return dict(
        device=device.type,
        max_batch_size=most,
        max_num_tokens=most * canvas + args.prompt_len,
        max_model_len=args.prompt_len + args.max_tokens + canvas,
    )


def ours(args, config: dict, device: torch.device) -> list[dict]:
    checkpoint = random_checkpoint(args, config, device)
    parsed = checkpoint.config
    llm = LLM(checkpoint, enable_in_flight_batching=True, **deployment(args, checkpoint, device))
    runtime = llm._runtime
    diffusion = DiffusionParams(max_denoising_steps=args.steps)
    gen = torch.Generator().manual_seed(0)
    rows = []
    try:
        for c in [1, *args.concurrency]:  # the first: warm-up
            prompts = [
                {
                    "prompt_token_ids": torch.randint(
                        3, parsed.vocab_size, (args.prompt_len,), generator=gen
                    ).tolist()
                }
                for _ in range(c)
            ]
            params = [
                SamplingParams(max_tokens=args.max_tokens, seed=i, ignore_eos=True)
                for i in range(c)
            ]
            before = (
                runtime.counters.forwards,
                runtime.counters.denoise_steps,
                runtime.counters.tokens,
            )
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, diffusion=diffusion)
            wall = time.perf_counter() - start
            forwards, steps, tokens = (
                now - then
                for now, then in zip(
                    (
                        runtime.counters.forwards,
                        runtime.counters.denoise_steps,
                        runtime.counters.tokens,
                    ),
                    before,
                    strict=True,
                )
            )
            made = sum(len(o.outputs[0].token_ids) for o in outputs)
            assert made == tokens
            row = dict(
                engine="inflight",
                concurrency=c,
                tokens=made,
                seconds=round(wall, 3),
                tok_s=round(made / wall, 1),
                forwards=forwards,
                tokens_per_forward=round(made / forwards, 2),
                tokens_per_denoising_step=round(made / steps, 2),
                forward_ms=round(1000 * wall / forwards, 1),
            )
            if rows:  # not the warm-up
                print(row, flush=True)
            rows.append(row)
    finally:
        llm.close()
    return rows[1:]


def transformers_generate(args, config: dict, device: torch.device) -> list[dict]:
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DiffusionGemmaForBlockDiffusion(DiffusionGemmaConfig(**config)).eval()
    finally:
        torch.set_default_dtype(previous)
    vocab = config["text_config"]["vocab_size"]
    rows = []
    for c in [1, *args.concurrency]:
        # Below the image placeholders (the last ids).
        prompt = torch.randint(3, vocab - 3, (c, args.prompt_len), device=device)
        torch.manual_seed(0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                prompt,
                max_new_tokens=args.max_tokens,
                max_denoising_steps=args.steps,
                eos_token_id=None,
            )
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
        made = c * (out.sequences.shape[1] - args.prompt_len)
        row = dict(
            engine="transformers",
            concurrency=c,
            tokens=made,
            seconds=round(wall, 3),
            tok_s=round(made / wall, 1),
            tokens_per_denoising_step=round(float(out.tokens_per_forward.mean()), 2),
        )
        if rows:
            print(row, flush=True)
        rows.append(row)
    del model
    return rows[1:]


def profile(args, config: dict, device: torch.device) -> None:
    """Our steps at each concurrency under torch's profiler, driven on this thread: the ops by
    device time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    checkpoint = random_checkpoint(args, config, device)
    runtime = DiffusionRuntime(
        checkpoint, DeploymentOptions(**deployment(args, checkpoint, device))
    )
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    vocab = checkpoint.config.vocab_size
    for c in args.concurrency:
        session = runtime.new_session()
        for i in range(c):
            prompt = torch.randint(3, vocab - 3, (args.prompt_len,)).tolist()
            params = SamplingParams(max_tokens=args.max_tokens, seed=i, ignore_eos=True)
            diffusion = DiffusionParams(max_denoising_steps=args.steps)
            session.admit(runtime.check(GenerationRequest(prompt, params, diffusion=diffusion)))
        session.step()  # the prompts' encode, beside the first canvas steps
        with torch_profile(activities=activities) as prof:
            while session.residents():
                session.step()
            if cuda:
                torch.cuda.synchronize()
        session.finish()
        key = "cuda_time_total" if cuda else "cpu_time_total"
        print(f"concurrency {c}:")
        print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=50))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=("tiny", "real"), default="tiny")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--profile", action="store_true", help="profile our runs instead")
    args = parser.parse_args()
    device = torch.device(args.device)
    config = shape(args.shape)
    if args.shape == "tiny":
        args.max_tokens = min(args.max_tokens, 64)
    if args.profile:
        profile(args, config, device)
        return
    rows = ours(args, config, device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not args.no_transformers:
        rows += transformers_generate(args, config, device)
    write_report(
        report_path(f"diffusion_{args.shape}.json"),
        command=" ".join(sys.argv),
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        shape=args.shape,
        prompt_len=args.prompt_len,
        max_tokens=args.max_tokens,
        steps=args.steps,
        rows=rows,
    )


if __name__ == "__main__":
    main()

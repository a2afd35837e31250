"""Concurrent image (or audio) + text chats under in-flight batching: TTFT and throughput with
the encoder cache cold and warm.

A random-weight model of a real shape: by default a small LLaVA (`llava-clip-b16-smollm2`: a
CLIP ViT-B/16 tower of 224-pixel images, 196 image tokens, and SmolLM2-135M's decoder);
`--shape qwen2-vl-2b` (400x300 images: 150 tokens at their M-RoPE positions) or
`--shape voxtral-mini-3b` (10 s clips: one 30 s window, 375 tokens). `--requests` chats, each
an item and a short question, are handed to the engine at once (a streaming consumer thread
each): "cold" with items the encoder cache has not seen, "warm" again with the same items
(every encoder output found in the cache), "cold again" with other new items (the encoder's
batch shape seen before). The context cache is off, so every run recomputes every prompt: what
differs is the encoder alone. Prints TTFT p50 / p99, output tok/s and the encoder counters;
writes JSON to $OUT (or bench/out).

    .venv/bin/python bench/multimodal.py [--requests 16] [--max-tokens 32]
    python3 bench/multimodal.py --device cuda [--shape qwen2-vl-2b|voxtral-mini-3b]
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np
import torch
from PIL import Image

from inflight.bench.online import percentile
from inflight.bench.random_model import random_checkpoint
from inflight.bench.report import report_path, write_report
from inflight.engine import EngineConfig, RequestEngine
from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.request import GenerationRequest, SamplingParams
from inflight.runtime.runtime import Runtime

SHAPES = ("llava-clip-b16-smollm2", "qwen2-vl-2b", "voxtral-mini-3b")


def _item(kind: str, rng: np.random.Generator):
    """A random picture (300x400), or 10 s of noisy tone."""
    if kind == "image":
        return Image.fromarray(rng.integers(0, 256, (300, 400, 3), dtype=np.uint8))
    t = np.arange(160_000) / 16000
    tone = 0.3 * np.sin(2 * np.pi * rng.uniform(100, 800) * t)
    return (tone + 0.02 * rng.standard_normal(t.size)).astype(np.float32)


def chats(runtime: Runtime, count: int, seed: int, max_tokens: int) -> list[GenerationRequest]:
    """`count` requests: a few text tokens, an image or clip (random), a question."""
    rng = np.random.default_rng(seed)
    (kind,) = runtime.media
    placeholder = runtime.input_processor.placeholder(kind)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    requests = []
    for _ in range(count):
        text = rng.integers(100, 40000, 24).tolist()
        prompt = [1, *text[:8], placeholder, *text[8:]]
        ids, media = runtime.input_processor.expand_media(prompt, {kind: _item(kind, rng)})
        requests.append(GenerationRequest(ids, params, media=media))
    return requests


def run(
    engine: RequestEngine, requests: list[GenerationRequest]
) -> tuple[dict[str, float], list[list[int]]]:
    """Every request submitted at once: TTFT of each and output tok/s of all, and each one's
    output tokens."""
    ttft: list[float] = []
    outputs: list[list[int]] = [[] for _ in requests]
    lock = threading.Lock()
    start = time.perf_counter()

    def consume(handle, out: list[int]) -> None:
        for chunk in handle:
            if chunk.token_ids and not out:
                with lock:
                    ttft.append(time.perf_counter() - start)
            out += chunk.token_ids

    handles = [engine.submit(request) for request in requests]
    threads = [
        threading.Thread(target=consume, args=(h, out))
        for h, out in zip(handles, outputs, strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    figures = {
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "output_tok_s": sum(map(len, outputs)) / elapsed,
        "seconds": elapsed,
    }
    return figures, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--shape", choices=SHAPES, default=SHAPES[0])
    args = parser.parse_args()
    device = torch.device(args.device)
    config = DeploymentOptions(
        max_batch_size=args.requests,
        max_model_len=1024,
        enable_context_reuse=False,
        device=args.device,
    )
    runtime = Runtime(random_checkpoint(args.shape, device), config)
    engine = RequestEngine(
        runtime, EngineConfig(max_batch_size=args.requests, max_pending_requests=256)
    )
    # Warm-up on other images (kernel builds, graph capture), then the measured runs.
    run(engine, chats(runtime, 2, seed=99, max_tokens=4))
    cache = runtime.encoder_cache
    requests = chats(runtime, args.requests, seed=0, max_tokens=args.max_tokens)
    others = chats(runtime, args.requests, seed=1, max_tokens=args.max_tokens)
    results: dict = {}
    outputs = {}
    for phase, batch in (("cold", requests), ("warm", requests), ("cold again", others)):
        before = cache.snapshot()
        results[phase], outputs[phase] = run(engine, batch)
        after = cache.snapshot()
        results[phase]["encoder_runs"] = after["encoder_runs"] - before["encoder_runs"]
        results[phase]["encoder_cache_hits"] = (
            after["encoder_cache_hits"] - before["encoder_cache_hits"]
        )
        r = results[phase]
        print(
            f"{phase}: TTFT p50 {r['ttft_p50_s'] * 1e3:.0f} ms, "
            f"p99 {r['ttft_p99_s'] * 1e3:.0f} ms, "
            f"{r['output_tok_s']:.1f} output tok/s, encoder runs {r['encoder_runs']}, "
            f"cache hits {r['encoder_cache_hits']}",
            flush=True,
        )
    engine.shutdown()
    same = sum(a == b for a, b in zip(outputs["cold"], outputs["warm"], strict=True))
    print(f"warm outputs identical to cold: {same}/{len(requests)}")
    write_report(
        report_path(f"multimodal-{args.shape}.json"),
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        threads=torch.get_num_threads(),
        args=vars(args),
        shape=args.shape,
        media_tokens=requests[0].media[0].length,
        results=results,
        identical_outputs=f"{same}/{len(requests)}",
    )


if __name__ == "__main__":
    main()

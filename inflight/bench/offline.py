"""Offline throughput: every request handed over at once, inflight beside its peers.

The workload: `num_prompts` prompts of `prompt_len` tokens (windows of real text), `output_len`
greedy tokens each, EOS ignored, so every engine does the same work. Peers, each on the same
model file: HF transformers' static batch (`generate` on a left-padded batch) and its continuous
batching (`generate_batch`), and llama.cpp's `llama-server` with one slot per prompt.

inflight and llama-server each run an untimed pass of a warm-up workload of the same shape
first (prompts of the text's tokens in random order, so that no prefix of the timed prompts is
cached by it): the timed pass measures a warm engine, not the first steps after its start (on a
CPU under a hypervisor, the first pass after loading SmolLM2 ran up to a quarter slower).
"""

from __future__ import annotations

import concurrent.futures
import random
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from inflight.model.checkpoints.loader import default_model_path, open_checkpoint
from inflight.protocol.tokenizer import Tokenizer

TEXT = (
    "The history of science is the study of the development of science and scientific "
    "knowledge, including both the natural and social sciences. Early cultures recorded "
    "observations of the stars, developed methods of measurement, and practised medicine. "
)


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_len: int
    warmup: list[list[int]]  # the untimed pass's prompts, as many and as long

    @property
    def output_tokens(self) -> int:
        return len(self.prompts) * self.output_len


def run_requests(
    runtime, requests: list, concurrency: int | None = None
) -> tuple[list[tuple[int, ...]], float]:
    """Every request (`GenerationRequest`s) handed at once to an in-flight batching engine over
    `runtime` that runs `concurrency` of them at a time (default: all), a queued one joining as
    another ends: each one's output tokens, and the seconds until the last ended."""
    from inflight.engine import EngineConfig, RequestEngine

    batch = concurrency or len(requests)
    room = max(len(requests), 256)  # every request submitted at once
    engine = RequestEngine(
        runtime,
        EngineConfig(max_batch_size=batch, max_pending_requests=room, command_queue_capacity=room),
    )
    start = time.perf_counter()
    handles = [engine.submit(request) for request in requests]
    outputs = [tuple(h.get().token_ids) for h in handles]
    elapsed = time.perf_counter() - start
    engine.shutdown()
    return outputs, elapsed


def load_tokenizer(model: str | None) -> Tokenizer:
    """The tokenizer of a checkpoint (default: the embedded model), without its weights."""
    return open_checkpoint(model).tokenizer


def make_workload(
    tokenizer, num_prompts: int, prompt_len: int, output_len: int, seed: int = 0
) -> Workload:
    corpus = tokenizer.encode(TEXT * (prompt_len // 20 + 10), add_special_tokens=False)
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        start = rng.randint(0, len(corpus) - prompt_len)
        prompts.append(corpus[start : start + prompt_len])
    warmup = [rng.choices(corpus, k=prompt_len) for _ in range(num_prompts)]
    return Workload(prompts, output_len, warmup)


def run_inflight(model: str | None, work: Workload, batch: int, **llm_options) -> float:
    """Output tok/s of inflight under in-flight batching (after a warm-up request)."""
    from inflight import LLM, SamplingParams

    llm = LLM(model, enable_in_flight_batching=True, max_batch_size=batch, **llm_options)
    params = SamplingParams(temperature=0, max_tokens=work.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in work.warmup], params)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in work.prompts], params)
    elapsed = time.perf_counter() - start
    llm.close()
    assert sum(len(o.token_ids) for o in outputs) == work.output_tokens
    return work.output_tokens / elapsed


def hf_model(model: str | None):
    """HF transformers' own float32 load of the same checkpoint (a directory or a GGUF file)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(model) if model else default_model_path()
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def run_hf_static(model: str | None, work: Workload, pad_token_id: int) -> float:
    """Output tok/s of HF `generate` over one left-padded batch of every prompt."""
    import torch

    hf = hf_model(model)
    width = max(len(p) for p in work.prompts)
    ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in work.prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in work.prompts])

    def generate(n: int) -> None:
        with torch.no_grad():
            hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=pad_token_id,
            )

    generate(2)
    start = time.perf_counter()
    generate(work.output_len)
    return work.output_tokens / (time.perf_counter() - start)


def run_hf_continuous(model: str | None, work: Workload) -> float:
    """Output tok/s of HF `generate_batch` (continuous batching), KV sized for the workload."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    hf = hf_model(model)
    tokens = max(len(p) for p in work.prompts) + work.output_len
    config = ContinuousBatchingConfig(
        page_size=32,
        num_blocks=len(work.prompts) * (-(-tokens // 32) + 1),
        max_batch_tokens=512,
    )
    generation = GenerationConfig(
        max_new_tokens=work.output_len, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    hf.generate_batch(
        [work.prompts[0]], generation_config=generation, continuous_batching_config=config
    )
    start = time.perf_counter()
    results = hf.generate_batch(
        work.prompts, generation_config=generation, continuous_batching_config=config
    )
    elapsed = time.perf_counter() - start
    produced = sum(len(r.generated_tokens) for r in results.values())
    return produced / elapsed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_llama_server(binary: str, model: str | None, work: Workload, threads: int) -> float:
    """Output tok/s of llama.cpp's server with one parallel slot per prompt."""
    path = str(Path(model) if model else default_model_path())
    port = _free_port()
    slots = len(work.prompts)
    per_slot = max(len(p) for p in work.prompts) + work.output_len + 16
    server = subprocess.Popen(
        [
            binary,
            "-m",
            path,
            "--port",
            str(port),
            "-np",
            str(slots),
            "-c",
            str(slots * per_slot),
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "--no-webui",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).is_success:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("llama-server did not start")
            time.sleep(0.5)

        def complete(prompt: list[int], n: int) -> int:
            body = {
                "prompt": prompt,
                "n_predict": n,
                "temperature": 0,
                "ignore_eos": True,
                "cache_prompt": False,
            }
            reply = httpx.post(url + "/completion", json=body, timeout=600).json()
            return reply["tokens_predicted"]

        with concurrent.futures.ThreadPoolExecutor(slots) as pool:
            sum(pool.map(lambda p: complete(p, work.output_len), work.warmup))
            start = time.perf_counter()
            produced = sum(pool.map(lambda p: complete(p, work.output_len), work.prompts))
            elapsed = time.perf_counter() - start
        return produced / elapsed
    finally:
        server.terminate()
        server.wait(timeout=30)

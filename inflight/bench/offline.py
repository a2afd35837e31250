"""Offline throughput: every request handed over at once, inflight beside its peers.

The workload: `num_prompts` prompts of `prompt_len` tokens (windows of real text), `output_len`
greedy tokens each, EOS ignored, so every engine does the same work. Peers, each on the same
model file: HF transformers' static batch (`generate` on a left-padded batch) and its continuous
batching (`generate_batch`), and llama.cpp's `llama-server` with one slot per prompt.

Each engine is opened (loaded, then an untimed pass of a warm-up workload of the same shape:
prompts of the text's tokens in random order, so that no prefix of a timed prompt is cached by
it) and then runs timed passes on demand: the timed passes measure a warm engine, not the first
steps after its start (on a CPU under a hypervisor, the first pass after loading SmolLM2 ran up to
a quarter slower). With several rounds the engines stay open and their passes alternate, each
round on prompts of its own (the first round's are the text's windows, later ones random-order
tokens: no round's prefix is cached by another's), so that a drift of the machine's speed (a
virtual machine's host moved the same kernel's time by a fifth for tens of seconds) falls on
every engine alike.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import random
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from inflight.model.checkpoints.loader import default_model_path, open_checkpoint
from inflight.protocol.tokenizer import Tokenizer
from inflight.runtime.device.openmp_pool import release_thread_pool

TEXT = (
    "The history of science is the study of the development of science and scientific "
    "knowledge, including both the natural and social sciences. Early cultures recorded "
    "observations of the stars, developed methods of measurement, and practised medicine. "
)


@dataclass(frozen=True)
class Workload:
    rounds: list[list[list[int]]]  # each timed round's prompts
    output_len: int
    warmup: list[list[int]]  # the untimed pass's prompts, as many and as long

    @property
    def prompts(self) -> list[list[int]]:
        """The first round's prompts."""
        return self.rounds[0]


# An open engine's timed pass: one round's prompts in, output tok/s out.
TimedPass = Callable[[list[list[int]]], float]


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
    tokenizer, num_prompts: int, prompt_len: int, output_len: int, seed: int = 0, rounds: int = 1
) -> Workload:
    corpus = tokenizer.encode(TEXT * (prompt_len // 20 + 10), add_special_tokens=False)
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        start = rng.randint(0, len(corpus) - prompt_len)
        prompts.append(corpus[start : start + prompt_len])
    warmup = [rng.choices(corpus, k=prompt_len) for _ in range(num_prompts)]
    later = [
        [rng.choices(corpus, k=prompt_len) for _ in range(num_prompts)] for _ in range(rounds - 1)
    ]
    return Workload([prompts, *later], output_len, warmup)


@contextlib.contextmanager
def open_inflight(
    model: str | None, work: Workload, batch: int, **llm_options
) -> Iterator[TimedPass]:
    """inflight under in-flight batching, `batch` requests at a time, warm."""
    from inflight import LLM, SamplingParams

    llm = LLM(model, enable_in_flight_batching=True, max_batch_size=batch, **llm_options)
    params = SamplingParams(temperature=0, max_tokens=work.output_len, ignore_eos=True)

    def timed(prompts: list[list[int]]) -> float:
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        elapsed = time.perf_counter() - start
        produced = sum(len(o.token_ids) for o in outputs)
        assert produced == len(prompts) * work.output_len
        return produced / elapsed

    try:
        timed(work.warmup)
        yield timed
    finally:
        llm.close()


def hf_model(model: str | None):
    """HF transformers' own float32 load of the same checkpoint (a directory or a GGUF file).
    Its torch ops run on the calling thread, whose OpenMP workers the HF engines release after
    the load and after each pass: alive beside an inflight engine's they would make libgomp
    throttle that engine's waiting (inflight/runtime/device/openmp_pool.py)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(model) if model else default_model_path()
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@contextlib.contextmanager
def open_hf_static(model: str | None, work: Workload, pad_token_id: int) -> Iterator[TimedPass]:
    """HF `generate` over one left-padded batch of every prompt."""
    import torch

    hf = hf_model(model)

    def generate(prompts: list[list[int]], n: int) -> None:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=pad_token_id,
            )

    def timed(prompts: list[list[int]]) -> float:
        start = time.perf_counter()
        generate(prompts, work.output_len)
        tok_s = len(prompts) * work.output_len / (time.perf_counter() - start)
        release_thread_pool()
        return tok_s

    generate(work.warmup, 2)
    release_thread_pool()
    yield timed


@contextlib.contextmanager
def open_hf_continuous(model: str | None, work: Workload) -> Iterator[TimedPass]:
    """HF `generate_batch` (continuous batching), KV sized for the workload."""
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

    def timed(prompts: list[list[int]]) -> float:
        start = time.perf_counter()
        results = hf.generate_batch(
            prompts, generation_config=generation, continuous_batching_config=config
        )
        elapsed = time.perf_counter() - start
        release_thread_pool()
        return sum(len(r.generated_tokens) for r in results.values()) / elapsed

    hf.generate_batch(
        [work.warmup[0]], generation_config=generation, continuous_batching_config=config
    )
    release_thread_pool()
    yield timed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def open_llama_server(
    binary: str, model: str | None, work: Workload, threads: int
) -> Iterator[TimedPass]:
    """llama.cpp's server with one parallel slot per prompt, warm."""
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

            def timed(prompts: list[list[int]]) -> float:
                start = time.perf_counter()
                produced = sum(pool.map(lambda p: complete(p, work.output_len), prompts))
                return produced / (time.perf_counter() - start)

            timed(work.warmup)
            yield timed
    finally:
        server.terminate()
        server.wait(timeout=30)

"""Batch-invariant mode (`batch_invariant=True`): where it is served, and a request's bits alone
and beside others on the CPU path. CUDA's side (fixed-shape matmuls, unsplit decode attention)
runs its kernels' tests in the interpreter (tests/model/test_triton_kernels.py) and is checked
end to end on the device (`bench/gpu_check.py "batch invariance"`)."""

import random
from dataclasses import replace

import pytest

from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.request import GenerationRequest, SamplingParams
from inflight.runtime.deployment import MachineFacts, ModelFacts, resolve
from inflight.runtime.runtime import Runtime

from helpers import run_staggered

DENSE = ModelFacts("qwen3", 1024, 16, 8, 128, 3072, 40960)
CUDA = MachineFacts(cuda_devices=1, cuda_capability=(9, 0))


def test_a_dense_text_model_on_cuda_and_the_cpu_float32_path_are_served():
    assert resolve(DeploymentOptions(batch_invariant=True), DENSE, CUDA).options.batch_invariant
    cpu = DeploymentOptions(device="cpu", batch_invariant=True)
    assert resolve(cpu, DENSE, MachineFacts()).options.batch_invariant


@pytest.mark.parametrize(
    "options,facts,named",
    [
        (dict(quantization="fp8"), DENSE, "quantization='fp8'"),
        (dict(attention_backend="torch"), DENSE, "attention_backend='torch'"),
        (dict(enable_lora=True), DENSE, "LoRA"),
        (dict(), ModelFacts("qwen3_moe", 1024, 4, 2, 16, 128, 4096, experts=True), "experts"),
        (dict(), ModelFacts("bamba", 1024, 4, 2, 16, 128, 4096, recurrent=True), "Mamba"),
        (dict(), ModelFacts("gemma3", 1024, 4, 2, 16, 128, 4096, kv_window=512), "sliding"),
        (dict(), ModelFacts("llava", 1024, 4, 2, 16, 128, 4096, media=("image",)), "media"),
        (dict(device="cpu", dtype="bfloat16"), DENSE, "float32"),
        (dict(device="cpu", attention_backend="torch"), DENSE, "native attention"),
    ],
)
def test_what_it_is_not_checked_for_is_refused_by_name(options, facts, named):
    options = DeploymentOptions(batch_invariant=True, **options)
    with pytest.raises(ValueError, match=f"batch_invariant=True.*{named}"):
        resolve(options, facts, CUDA)
    # Without the mode the same deployment stands, where its other rules allow it.
    if named not in ("float32", "quantization='fp8'"):
        resolve(replace(options, batch_invariant=False), facts, CUDA)


def test_a_request_gets_the_same_bits_alone_and_beside_1_and_7_others():
    """The default model as users get it (its GGUF kernels), prefills chunked at 64 tokens a
    step, companions joining every other step and leaving at their own lengths: the request's
    tokens and top-5 logprobs are the same bits in every company."""
    runtime = Runtime(
        None,
        DeploymentOptions(
            batch_invariant=True, max_batch_size=8, max_model_len=512, max_num_tokens=64
        ),
    )
    rng = random.Random(0)
    vocab = runtime.checkpoint.config.vocab_size
    target = GenerationRequest(
        [rng.randrange(1, vocab) for _ in range(90)],
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5),
    )
    others = [
        GenerationRequest(
            [rng.randrange(1, vocab) for _ in range(rng.randint(5, 120))],
            SamplingParams(max_tokens=rng.randint(2, 16), temperature=0, ignore_eos=True),
        )
        for _ in range(7)
    ]
    alone = run_staggered(runtime, [target])[0]
    for n in (1, 7):
        beside = run_staggered(runtime, [target, *others[:n]])[0]
        assert beside.token_ids == alone.token_ids, n
        assert beside.outputs[0].logprobs == alone.outputs[0].logprobs, n

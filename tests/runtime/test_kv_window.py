"""A sliding-window model's sequences hold the KV blocks of their window only: those before it
go back to the pool as they grow, whatever their length, and their tokens stay transformers'."""

import functools
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from inflight.protocol.deployment import DeploymentOptions, SpeculativeConfig
from inflight.protocol.request import GenerationRequest, SamplingParams
from inflight.protocol.stepped import AdmissionAnswer
from inflight.runtime.deployment import MachineFacts, ModelFacts, resolve
from inflight.runtime.host.kv_window import KVWindow
from inflight.runtime.runtime import Runtime

from helpers import (
    assert_no_leaks,
    assert_same_outputs,
    assert_warm_up_writes_only_scratch,
    run_staggered,
    with_eager_graphs,
)
from tiny_models import SLIDING_WINDOW, VOCAB

# The long runs' prompt.
PROMPT = [(7 * i) % VOCAB for i in range(100)]


@functools.cache
def _hf_greedy(path: Path, n: int = 1900) -> list[int]:
    """transformers' greedy tokens after PROMPT on the checkpoint at `path` through its KV
    cache, EOS a token like any other (as `ignore_eos` serves it; `generate` would keep it from
    being picked). Cached: the plain and overlapped runs of a test compare with the same."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokens, cache = [], DynamicCache()
    with torch.no_grad():
        logits = hf.eval()(torch.tensor([PROMPT]), cache=cache).logits
        for _ in range(n):
            tokens.append(int(logits[0, -1].argmax()))
            logits = hf(torch.tensor([tokens[-1:]]), cache=cache).logits
    return tokens


def _decode_alone(runtime, prompt, pool, sliding_kv):
    """1,900 greedy tokens after `prompt`, the only request: its tokens; after each step, its
    tokens emitted, the blocks of its sliding KV (`sliding_kv` of its SequenceKV) and of its
    whole KV it holds; and the blocks `pool` has given out."""
    residents = runtime.scheduler.residents
    session = runtime.new_session()
    params = SamplingParams(max_tokens=1900, temperature=0, ignore_eos=True)
    admission = session.admit(GenerationRequest(prompt, params))
    assert admission.answer is AdmissionAnswer.ADMITTED
    tokens, held, taken = [], [], []
    while session.residents():
        result = session.step()
        if admission.ref in result.deltas:
            tokens += result.deltas[admission.ref].token_ids
        if admission.ref in residents:
            r = residents[admission.ref]
            held.append((len(r.output), len(sliding_kv(r.kv).held), len(r.kv.held)))
            taken.append(pool.num_blocks - pool.num_free)
    session.finish()
    return tokens, held, taken


def test_the_quota_spans_the_window_and_two_chunks():
    """A sequence reserves its window before `committed` plus two rows of a chunk (half a
    window, at least a block and a decode row), or its whole length where that is shorter."""
    assert (KVWindow(12, 4).chunk, KVWindow(12, 4).quota) == (6, 7)
    assert (KVWindow(4096, 16).chunk, KVWindow(4096, 16).quota) == (2048, 513)
    assert KVWindow(4, 16, decode_tokens=5).chunk == 16
    assert KVWindow(12, 4).sequence_blocks(10) == 3


def test_the_plan_sizes_the_pool_by_the_quota():
    """The default pool holds each resident's quota, not max_model_len's blocks; a draft
    model's KV in the same blocks lags behind the target's, so there sequences keep them all."""
    facts = ModelFacts("mistral", VOCAB, 4, 2, 16, 128, 4096, kv_window=12)
    options = DeploymentOptions(block_size=4, max_batch_size=8)
    plan = resolve(options, facts, MachineFacts())
    assert plan.kv_window == KVWindow(12, 4) and plan.num_kv_blocks == 8 * 7
    ngram = replace(options, speculative_config=SpeculativeConfig(num_speculative_tokens=3))
    assert resolve(ngram, facts, MachineFacts()).kv_window == KVWindow(12, 4, decode_tokens=4)
    drafted = replace(
        options, speculative_config=SpeculativeConfig(4, method="draft_model", model="draft")
    )
    plan = resolve(drafted, facts, MachineFacts(), draft=facts)
    assert plan.kv_window is None and plan.num_kv_blocks == 8 * 4096 // 4


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_a_long_sequence_holds_a_window_of_blocks(sliding_dirs, overlap):
    """Every layer slides over 12 tokens (Mistral-style), blocks of 4: a 2,000-token sequence
    (a 100-token prompt, 1,900 greedy tokens) takes 7 blocks of a 16-block pool (all its KV
    would need 500), holds at most window / block_size + 1 = 4 of them while it decodes, and
    its tokens are transformers'. Overlapped: each step is planned while the one before is in
    flight, whose KV is not committed yet (so not released from yet)."""
    path = sliding_dirs["mistral"]
    want = _hf_greedy(path)
    options = dict(max_model_len=2048, block_size=4, num_kv_blocks=16, quantization="none")
    runtime = Runtime(path, DeploymentOptions(**options, overlap=overlap))
    assert runtime.scheduler.window == KVWindow(SLIDING_WINDOW, 4)
    tokens, held, taken = _decode_alone(runtime, PROMPT, runtime.blocks, lambda kv: kv)
    assert tokens == want
    # Past its first tokens: until then its prompt's last chunk, in flight when the first
    # decode rows are planned (overlapped), is not committed, so blocks before it stay held.
    assert max(n for emitted, n, _ in held if emitted >= 4) == SLIDING_WINDOW // 4 + 1
    assert max(n for _, n, _ in held) <= 7 and set(taken) == {7}
    assert_no_leaks(runtime)


def test_the_n_sequences_of_a_request_each_compute_their_prompt(sliding_dirs):
    """No prompt blocks are shared (a sequence gives its blocks back on its own): each of the
    n sequences prefills the prompt and reserves its own quota; greedy, they agree with a
    request of one."""
    options = dict(max_model_len=256, block_size=4, quantization="none")
    runtime = Runtime(sliding_dirs["mistral"], DeploymentOptions(**options))
    prompt = list(range(5, 45))
    params = dict(max_tokens=30, temperature=0, ignore_eos=True)
    request = GenerationRequest(prompt, SamplingParams(n=3, **params))
    intent = runtime.check(request).intent
    assert (intent.shared_blocks, intent.sequence_blocks, intent.blocks_needed) == (0, 7, 21)
    three = runtime.handle_request(request).result()
    one = runtime.handle_request(GenerationRequest(prompt, SamplingParams(**params))).result()
    assert [o.token_ids for o in three.outputs] == [one.token_ids] * 3
    assert_no_leaks(runtime)


def test_the_plan_keeps_a_partly_sliding_models_window_group_apart():
    """Where only some layers slide, their KV goes in a pool of its own, a quota a resident;
    not under tensor parallelism or with a draft model (one table for every layer there)."""
    facts = ModelFacts("qwen3", VOCAB, 4, 2, 16, 128, 4096, sliding_group_window=12)
    options = DeploymentOptions(block_size=4, max_batch_size=8, max_model_len=512)
    plan = resolve(options, facts, MachineFacts())
    assert plan.kv_window is None and plan.num_kv_blocks == 8 * 128
    assert plan.window_group == KVWindow(12, 4) and plan.num_window_blocks == 8 * 7
    assert (
        resolve(replace(options, tensor_parallel_size=2), facts, MachineFacts()).window_group
        is None
    )
    drafted = replace(
        options, speculative_config=SpeculativeConfig(4, method="draft_model", model="draft")
    )
    assert resolve(drafted, facts, MachineFacts(), draft=facts).window_group is None


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_a_partly_sliding_models_sliding_layers_hold_a_window_of_blocks(sliding_dirs, overlap):
    """Sliding and full layers alternating (window 12, blocks of 4): a 2,000-token sequence
    holds all 500 blocks of its full layers, but at most window / block_size + 1 = 4 of the
    window group's pool once it decodes (7 reserved), and its tokens are transformers'. A
    prompt asked again comes from the context cache (the sliding layers' last window from
    their pool) with the same tokens."""
    path = sliding_dirs["qwen3"]
    want = _hf_greedy(path)
    options = dict(max_model_len=2048, block_size=4, max_batch_size=2, quantization="none")
    runtime = Runtime(path, DeploymentOptions(**options, overlap=overlap))
    assert runtime.scheduler.window is None
    assert runtime.scheduler.window_group == KVWindow(SLIDING_WINDOW, 4)
    pool, window_pool = runtime.blocks, runtime.window_blocks
    assert window_pool.num_blocks == 2 * 7
    tokens, held, taken = _decode_alone(runtime, PROMPT, window_pool, lambda kv: kv.window)
    assert tokens == want
    assert max(n for emitted, n, _ in held if emitted >= 4) == SLIDING_WINDOW // 4 + 1
    assert max(n for _, n, _ in held) <= 7 and set(taken) == {7}
    assert held[-1][2] == 500 and pool.num_blocks - pool.num_free == 0
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    # The long run has reused its window blocks many times over: its prompt's full layers'
    # blocks are cached, not its sliding layers' last window, so the prompt is computed again.
    rerun = runtime.handle_request(GenerationRequest(PROMPT, params))
    output = rerun.result()
    assert output.cached_tokens == 0 and list(output.token_ids) == want[:8]
    # A short run leaves the last window of its prompt cached in the window group's pool.
    other = [(11 * i + 3) % VOCAB for i in range(99)]
    short = GenerationRequest(other, params)
    first, again = (runtime.handle_request(short).result() for _ in range(2))
    assert (first.cached_tokens, again.cached_tokens) == (0, 96)
    assert again.token_ids == first.token_ids
    assert_no_leaks(runtime)


def test_the_warm_up_writes_only_the_scratch_blocks_of_both_pools(sliding_dirs):
    """The eager pass a graphed runtime runs once at start writes the scratch block of the full
    layers' pool and of the window group's, and no other block of either."""
    options = dict(max_model_len=512, block_size=4, max_batch_size=4, quantization="none")
    runtime = with_eager_graphs(Runtime(sliding_dirs["qwen3"], DeploymentOptions(**options)))
    assert runtime.window_blocks is not None
    assert_warm_up_writes_only_scratch(runtime)


def test_the_window_group_replays_graphs_as_eager_steps(sliding_dirs, monkeypatch):
    """A partly sliding model with decode graphs (replayed eagerly on the CPU, through the
    window group's static buffers too) and overlapped steps: requests joining a running batch
    give the tokens and logprobs of eager steps."""
    options = dict(max_model_len=512, block_size=4, max_batch_size=4, quantization="none")
    eager = Runtime(sliding_dirs["qwen3"], DeploymentOptions(**options))
    graphed = with_eager_graphs(
        Runtime(sliding_dirs["qwen3"], DeploymentOptions(**options, overlap=True))
    )
    assert graphed.window_blocks is not None
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2)
    requests = [
        GenerationRequest([(5 * i + 11 * k) % VOCAB for i in range(n)], params)
        for k, n in enumerate((30, 7, 50, 18, 3))
    ]
    want = run_staggered(eager, requests)
    planned, steps = [], []
    backend, scheduler = graphed.executor.runner.caches.backend, graphed.scheduler
    plan, schedule = backend.plan, scheduler.schedule
    monkeypatch.setattr(backend, "plan", lambda meta: planned.append(meta) or plan(meta))
    monkeypatch.setattr(scheduler, "schedule", lambda i: steps.append(i) or schedule(i))
    assert_same_outputs(run_staggered(graphed, requests), want)
    assert len(planned) < len(steps) / 2  # most steps replayed a graph
    assert_no_leaks(graphed)

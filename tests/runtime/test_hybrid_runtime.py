"""Hybrid Mamba2/attention models through the runtime (tiny random Bamba and NemotronH, CPU,
float32): greedy output equal to transformers' with the prompt prefilled in chunks; each row's
tokens and logprobs bit-identical alone and in a batch that rows join and leave mid-flight;
state slots freed after finishes, cancels, a failed step and shutdown; the context cache
bypassed (lookups counted as skipped), n > 1 sequences each computing their prompt."""

import copy

import pytest
import torch

from inflight.engine import EngineConfig, RequestEngine, RequestFailed
from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.request import GenerationRequest, SamplingParams
from inflight.runtime.runtime import Runtime

from helpers import (
    assert_no_leaks,
    assert_same_outputs,
    assert_warm_up_writes_only_scratch,
    run_staggered,
    with_eager_graphs,
)
from tiny_models import make_tiny_hybrid

FAMILIES = ("bamba", "nemotron_h")
CONFIG = dict(max_batch_size=4, max_model_len=256, block_size=8, enable_context_reuse=False)


@pytest.fixture(scope="module", params=FAMILIES)
def hybrid(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return path, make_tiny_hybrid(request.param, path)


def _prompt(n: int, seed: int) -> list[int]:
    return [1] + [(37 * i + 11 * seed) % 300 + 3 for i in range(n - 1)]


def _request(ids, max_tokens=16, **params):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **params)
    return GenerationRequest(ids, params)


def test_greedy_with_chunked_prefill_is_transformers_greedy(hybrid):
    """Prompts of 21 and 45 tokens prefilled 16 tokens a step (state carried between chunks;
    the Mamba scan's own chunks are 8), then 32 decode steps: transformers' greedy tokens, each
    from its full forward over the sequence so far (in float64: its cached decode step rounds
    differently from its own full forward)."""
    path, hf = hybrid
    hf = copy.deepcopy(hf).double()
    runtime = Runtime(path, DeploymentOptions(**dict(CONFIG, max_num_tokens=16)))
    for ids in (_prompt(21, 1), _prompt(45, 2)):
        got = runtime.handle_request(_request(ids, max_tokens=32)).result().token_ids
        seq = list(ids)
        with torch.no_grad():
            for _ in range(32):
                seq.append(int(hf(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
        assert got == tuple(seq[len(ids) :])
    assert_no_leaks(runtime)


@pytest.mark.parametrize("max_num_tokens", [2048, 12])
def test_rows_are_bit_identical_alone_and_in_a_changing_batch(hybrid, max_num_tokens):
    """Requests of different lengths join a running batch every other step and leave as they
    finish (max_tokens 6 to 20), prefilled whole or (12 tokens a step) in chunks of 8: each
    row's tokens and logprobs equal its run alone, bit for bit."""
    runtime = Runtime(hybrid[0], DeploymentOptions(**dict(CONFIG, max_num_tokens=max_num_tokens)))
    requests = [
        _request(_prompt(n, seed), max_tokens=m, logprobs=2)
        for seed, (n, m) in enumerate(((9, 20), (30, 6), (17, 12), (5, 16), (23, 9), (12, 14)))
    ]
    alone = [runtime.handle_request(r).result() for r in requests]
    together = run_staggered(runtime, requests)
    assert_same_outputs(together, alone)
    assert_no_leaks(runtime)


def test_state_slots_are_freed_after_cancels_failures_and_shutdown(hybrid):
    """Under the engine: two requests cancelled while running, two failed by a step that
    raises, then a request in slots those left dirty computes what it computes alone, and
    shutdown with one running. Every state slot (a resident's slot) is free at the end."""
    runtime = Runtime(hybrid[0], DeploymentOptions(**CONFIG))
    later = _request(_prompt(8, 7), max_tokens=6)
    want = runtime.handle_request(later).result().token_ids
    engine = RequestEngine(runtime, EngineConfig(max_batch_size=4, max_pending_requests=16))
    handles = [engine.submit(_request(_prompt(10 + i, i), max_tokens=200)) for i in range(4)]
    next(iter(handles[0]))  # running
    for handle in handles[:2]:
        handle.cancel()
    forward = runtime.executor.runner.model.forward

    def failing(*args, **kwargs):
        raise RuntimeError("injected fault")

    runtime.executor.runner.model.forward = failing
    try:
        for handle in handles[2:]:
            with pytest.raises(RequestFailed, match="injected fault"):
                handle.get(timeout=30)
    finally:
        runtime.executor.runner.model.forward = forward
    assert engine.submit(later).get(timeout=30).token_ids == want
    engine.submit(_request(_prompt(8, 8), max_tokens=200))
    engine.shutdown()
    assert_no_leaks(runtime)


def test_the_context_cache_is_bypassed_and_n_sequences_each_compute_their_prompt(hybrid):
    path, _ = hybrid
    cached = Runtime(path, DeploymentOptions(**dict(CONFIG, enable_context_reuse=True)))
    ids = _prompt(40, 3)
    first = cached.handle_request(_request(ids)).result()
    again = cached.handle_request(_request(ids)).result()
    assert again.cached_tokens == 0 and again.token_ids == first.token_ids
    metrics = cached.context_cache.snapshot()
    assert metrics["skipped_lookups"] == 2 and metrics["lookups"] == 0
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, n=3)
    three = cached.handle_request(GenerationRequest(ids, params)).result()
    assert [o.token_ids for o in three.outputs] == [first.token_ids[:8]] * 3
    assert_no_leaks(cached)


def test_speculative_decoding_is_refused_for_hybrids(hybrid):
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="not served for hybrid Mamba models"):
        Runtime(hybrid[0], DeploymentOptions(**dict(CONFIG, speculative_config=spec)))


def test_the_warm_up_writes_only_the_scratch_block_and_state_slot(hybrid):
    """The eager pass a graphed runtime runs once at start (a full step's prefill) leaves every
    resident's KV blocks and state slots as they were."""
    config = dict(CONFIG, max_num_tokens=40)
    assert_warm_up_writes_only_scratch(
        with_eager_graphs(Runtime(hybrid[0], DeploymentOptions(**config)))
    )


def test_decode_graphs_and_overlap_give_the_eager_tokens(hybrid, monkeypatch):
    """Decode steps replay graphs (run eagerly on the CPU, through the same static buffers and
    scratch state slot as on CUDA) with overlapped steps: every row's tokens and logprobs are
    those of eager steps."""
    config = dict(CONFIG, max_num_tokens=12)
    eager = Runtime(hybrid[0], DeploymentOptions(**config))
    graphed = with_eager_graphs(Runtime(hybrid[0], DeploymentOptions(**config, overlap=True)))
    planned = []
    plan = graphed.executor.runner.caches.backend.plan
    monkeypatch.setattr(
        graphed.executor.runner.caches.backend,
        "plan",
        lambda meta: planned.append(meta) or plan(meta),
    )
    requests = [
        _request(_prompt(n, seed), max_tokens=m, logprobs=2)
        for seed, (n, m) in enumerate(((9, 20), (30, 6), (1, 12), (17, 16), (5, 9)))
    ]
    want = run_staggered(eager, requests)
    steps = []
    schedule = graphed.scheduler.schedule
    monkeypatch.setattr(graphed.scheduler, "schedule", lambda i: steps.append(i) or schedule(i))
    got = run_staggered(graphed, requests)
    assert_same_outputs(got, want)
    assert len(planned) < len(steps) / 2  # most steps replayed a graph
    assert_no_leaks(graphed)

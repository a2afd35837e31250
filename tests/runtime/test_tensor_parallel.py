"""Tensor parallelism on the CPU: two ranks over gloo, each a worker process of its own.

The sharded model is checked against the single-rank run and transformers through the
log-probabilities the runtime reports (logits less their logsumexp: prompt tokens scored by the
LM head in slices, and sampled tokens), then under in-flight batching with joiners and cancels,
and against a worker that is killed or cannot start."""

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from inflight import LLM, SamplingParams
from inflight.bench.random_model import SHAPES, RandomWeights, numbered_tokenizer
from inflight.engine import RequestCancelled, RequestFailed, SubmitError
from inflight.model.checkpoints.loader import Checkpoint, open_checkpoint
from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.request import GenerationRequest
from inflight.runtime.runtime import Runtime

from helpers import assert_no_leaks, run_staggered
from tiny_models import COMMON, _save_random, make_tiny_model, small_shape

pytestmark = pytest.mark.slow

TOL = 1e-5
PROMPT = "The quick brown fox jumps over the lazy dog. In-flight batching"


@pytest.fixture(scope="module")
def tp_models(tmp_path_factory):
    """A Llama whose 2 KV heads split over 2 ranks, and one with a single KV head (replicated on
    both) and an odd vocabulary (the last rank's head slice padded); their transformers models."""
    root = tmp_path_factory.mktemp("tp")
    split = make_tiny_model("llama", root / "split")
    config = LlamaConfig(**{**COMMON, "num_key_value_heads": 1, "vocab_size": 319})
    replicated = _save_random(LlamaForCausalLM, config, root / "replicated", seed=1)
    return {"split": (root / "split", split), "replicated": (root / "replicated", replicated)}


def _config(tp: int, **kw) -> DeploymentOptions:
    return DeploymentOptions(
        max_batch_size=4, max_model_len=256, quantization="none", tensor_parallel_size=tp, **kw
    )


def _scored(runtime: Runtime, ids: list[int], n: int):
    request = GenerationRequest(
        ids,
        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=5, prompt_logprobs=5),
    )
    return runtime.handle_request(request).result()


def _logprobs(out) -> list[dict[int, float]]:
    """Every scored position's top-5 (prompt tokens after the first, then sampled tokens)."""
    entries = [e for e in out.prompt_logprobs if e is not None] + list(out.logprobs)
    return [{t.token_id: t.logprob for t in e.top} | {e.token_id: e.logprob} for e in entries]


def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1)


@pytest.mark.parametrize("kind", ["split", "replicated"])
def test_two_ranks_match_one_rank_and_transformers(tp_models, kind):
    path, hf = tp_models[kind]
    one = Runtime(path, _config(1))
    ids = one.tokenizer.encode(PROMPT)
    alone = _scored(one, ids, 24)
    two = Runtime(path, _config(2, max_num_tokens=16))  # the prompt in 16-token chunks
    try:
        split = _scored(two, ids, 24)
        assert split.token_ids == alone.token_ids  # greedy identical
        ref = _hf_logprobs(hf.eval(), ids + list(alone.token_ids))
        assert hf.config.vocab_size == two.checkpoint.config.vocab_size
        positions = _logprobs(split)
        assert len(positions) == len(ids) - 1 + 24
        for i, (ours, single) in enumerate(zip(positions, _logprobs(alone), strict=True)):
            assert ours.keys() == single.keys()
            for token, logprob in ours.items():
                assert abs(logprob - single[token]) < TOL
                assert abs(logprob - ref[i, token].item()) < TOL
        assert_no_leaks(two)
    finally:
        two.close()


def test_joiners_and_cancels_under_in_flight_batching(tp_models):
    path, _ = tp_models["split"]
    prompts = [PROMPT[: 12 + 7 * i] for i in range(6)]
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    one = Runtime(path, _config(1, max_num_tokens=24))
    requests = [GenerationRequest(one.tokenizer.encode(p), greedy) for p in prompts]
    expected = run_staggered(one, requests)
    # Overlapped steps: decode rows read the token rank 0 sampled on its device, which every
    # rank then takes from rank 0's broadcast of the input ids.
    two = Runtime(path, _config(2, max_num_tokens=24, overlap=True))
    runner, shared = two.executor.runner, []
    share = runner.share_ids
    runner.share_ids = lambda batch: shared.append(1) or share(batch)
    try:
        # Rows join every other step, prefill in chunks beside decoding rows, and leave.
        outputs = run_staggered(two, requests)
        assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
        assert len(shared) > 20
        assert_no_leaks(two)
    finally:
        two.close()
    with LLM(path, enable_in_flight_batching=True, tensor_parallel_size=2, max_batch_size=4) as llm:
        long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        handles = [
            llm.start(llm.prepare(p, long if i % 2 else greedy)) for i, p in enumerate(prompts)
        ]
        for handle in handles[1::2]:
            next(handle)  # generating: the cancel lands mid-flight, not before admission
            handle.cancel()
        for i, handle in enumerate(handles):
            if i % 2:
                with pytest.raises(RequestCancelled):
                    handle.get()
            else:
                assert handle.get().token_ids == expected[i].token_ids
        _wait_idle(llm)
        assert_no_leaks(llm)  # rank 0 owns every block and slot; workers hold no requests


def _wait_for(predicate, timeout=10.0):
    """Until `predicate()` holds or `timeout` seconds pass (the caller asserts what it needs)."""
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)


def _wait_idle(llm):
    _wait_for(lambda: not llm.resident_slot_usage()[0])


def _spawned_pids(start):
    """The pids of the processes `start()` spawns (its tensor-parallel ranks 1..N-1, one
    process each), and what it returns."""
    before = set(multiprocessing.active_children())
    started = start()
    return [p.pid for p in multiprocessing.active_children() if p not in before], started


def test_killed_worker_fails_its_requests_and_the_engine(tp_models):
    path, _ = tp_models["split"]
    pids, llm = _spawned_pids(
        lambda: LLM(path, enable_in_flight_batching=True, tensor_parallel_size=2)
    )
    try:
        (pid,) = pids
        long = SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True)
        handle = llm.generate_stream("Once upon a time", long)
        first = next(iter(handle))  # generating
        assert first.token_ids
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RequestFailed, match="tensor-parallel rank 1 exited"):
            handle.get()
        _wait_for(lambda: llm.engine_fault is not None)
        assert "tensor-parallel rank 1" in llm.engine_fault
        with pytest.raises(Exception, match="tensor-parallel rank 1"):
            llm.generate("again", SamplingParams(max_tokens=2))
    finally:
        llm.close()


def test_idle_worker_death_is_a_fault(tp_models):
    path, _ = tp_models["split"]
    pids, runtime = _spawned_pids(lambda: Runtime(path, _config(2)))
    try:
        (pid,) = pids
        os.kill(pid, signal.SIGKILL)
        _wait_for(lambda: runtime.fault is not None)
        assert runtime.fault == "tensor-parallel rank 1 exited with code -9"
        with pytest.raises(RuntimeError, match="rank 1 exited"):
            runtime.new_session()
    finally:
        runtime.close()


def test_start_after_an_idle_rank_died_is_refused_naming_it(tp_models):
    """Under in-flight batching, a worker rank killed between requests (no step running): once
    its death is seen (within seconds), start() refuses new requests for good, a SubmitError
    naming the lost rank, even with wait_for_room; none is accepted only to fail."""
    path, _ = tp_models["split"]
    pids, llm = _spawned_pids(
        lambda: LLM(path, enable_in_flight_batching=True, tensor_parallel_size=2)
    )
    try:
        (pid,) = pids
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        assert len(llm.generate("Once upon a time", params)[0].token_ids) == 4
        _wait_idle(llm)
        request = llm.prepare("And then", params)
        submitted = llm.get_scheduling_metrics()["submitted"]
        os.kill(pid, signal.SIGKILL)
        _wait_for(lambda: llm.engine_fault is not None)
        assert llm.engine_fault is not None, "the rank's death was not seen"
        with pytest.raises(SubmitError, match="tensor-parallel rank 1 exited"):
            llm.start(request)
        with pytest.raises(SubmitError, match="tensor-parallel rank 1 exited"):
            llm.start(request, wait_for_room=True)
        assert llm.get_scheduling_metrics()["submitted"] == submitted
    finally:
        llm.close()


def test_a_rank_that_cannot_start_is_named(tp_models, tmp_path):
    path, _ = tp_models["split"]
    # Rank 0 has read the config; the worker, opening the checkpoint after, finds none.
    moved = tmp_path / "model"
    moved.mkdir()
    for f in path.iterdir():
        (moved / f.name).write_bytes(f.read_bytes())
    checkpoint = open_checkpoint(moved)
    (moved / "config.json").unlink()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1 could not start: .*config"):
        Runtime(checkpoint, _config(2))
    assert time.monotonic() - started < 60


def test_uneven_splits_are_refused_before_any_worker_starts(tp_models):
    path, _ = tp_models["split"]
    with pytest.raises(ValueError, match=r"attention heads \(4\) do not split over 3 ranks"):
        Runtime(path, _config(3))
    with pytest.raises(ValueError, match="LoRA is not served with tensor parallelism"):
        Runtime(path, DeploymentOptions(tensor_parallel_size=2, enable_lora=True))
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        DeploymentOptions(tensor_parallel_size=0)


def test_a_checkpoint_without_files_is_sent_to_the_workers():
    """A benchmark's random weights (made from a seed, no files) load on every rank alike."""
    config = small_shape(SHAPES["llama-3.1-8b"])
    cpu = torch.device("cpu")
    outputs = []
    for tp in (1, 2):
        checkpoint = Checkpoint(
            Path("random-small"),
            config,
            numbered_tokenizer(512),
            source=RandomWeights(config, cpu),
        )
        runtime = Runtime(checkpoint, _config(tp))
        try:
            request = GenerationRequest(
                list(range(5, 40)), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
            )
            outputs.append(runtime.handle_request(request).result().token_ids)
        finally:
            runtime.close()
    assert outputs[0] == outputs[1]

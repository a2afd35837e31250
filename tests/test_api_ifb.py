"""The Python API under in-flight batching, end to end on the embedded default model."""

import threading
import time

import pytest

from inflight import LLM, SamplingParams
from inflight.engine import RequestCancelled
from inflight.protocol.request import AudioReply, GenerationRequest
from inflight.runtime import deployment

from helpers import assert_no_leaks

PROMPTS = [
    "The capital of France is",
    "List three fruits:",
    "Once upon a time,",
    "Explain gravity in one sentence.",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "The best way to learn Python is",
    "A recipe for pancakes:",
]


def _mixed_params(i):
    """16 requests: half greedy, half sampled, with varied lengths, stops and logprobs."""
    common = dict(max_tokens=[6, 14, 22, 30][i % 4], logprobs=[None, 0, 2, 5][i % 4])
    if i % 3 == 0:
        common["stop"] = ["\n\n", "."]
    if i % 2 == 0:
        return SamplingParams(temperature=0, **common)
    return SamplingParams(temperature=[0.5, 0.9, 1.3][i % 3], top_p=0.9, seed=i, **common)


@pytest.mark.slow
def test_sixteen_concurrent_mixed_requests_match_single_runs(ifb_llm, llm):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(16)]
    params = [_mixed_params(i) for i in range(16)]
    before = ifb_llm.get_scheduling_metrics()
    outputs = ifb_llm.generate(prompts, params)
    after = ifb_llm.get_scheduling_metrics()
    assert after["admitted_mid_flight"] - before["admitted_mid_flight"] > 0
    assert after["completed"] - before["completed"] == 16
    for prompt, p, out in zip(prompts, params, outputs, strict=True):
        alone = llm.generate(prompt, p)[0]  # the blocking path, same weights
        if p.temperature == 0 or p.seed is not None:
            assert out.token_ids == alone.token_ids, prompt
            assert out.text == alone.text
        assert len(out.token_ids) <= p.max_tokens
        if p.logprobs is not None:
            assert len(out.logprobs) == len(out.token_ids)
            assert all(len(e.top) == p.logprobs and e.logprob <= 0 for e in out.logprobs)
    _wait_idle(ifb_llm)
    assert_no_leaks(ifb_llm)


def _wait_idle(llm):
    deadline = time.monotonic() + 10
    while llm.get_scheduling_metrics()["resident"] or llm.get_scheduling_metrics()["queued"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.mark.slow
def test_callers_on_several_threads_overlap(ifb_llm):
    before = ifb_llm.get_scheduling_metrics()["admitted_mid_flight"]
    results = {}

    def call(i):
        results[i] = ifb_llm.generate(PROMPTS[i], SamplingParams(temperature=0, max_tokens=12))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 6 and all(r[0].token_ids for r in results.values())
    assert ifb_llm.get_scheduling_metrics()["admitted_mid_flight"] > before


@pytest.mark.slow
def test_cancelling_a_resident_ends_it_within_two_steps(ifb_llm):
    _wait_idle(ifb_llm)
    request = ifb_llm.prepare(
        "Tell me a very long story.", SamplingParams(max_tokens=500, ignore_eos=True)
    )
    handle = ifb_llm.start(request)
    for _ in range(3):
        assert next(handle).token_ids
    cancelled_at = ifb_llm.get_scheduling_metrics()["steps"]
    handle.cancel()
    with pytest.raises(RequestCancelled):
        handle.get()
    deadline = time.monotonic() + 10
    while not handle.ready():
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert ifb_llm.get_scheduling_metrics()["steps"] - cancelled_at <= 2
    assert handle.stream().is_cancelled
    with pytest.raises(RequestCancelled):  # the rest of its stream ends saying how it ended
        for _ in handle:
            pass
    _wait_idle(ifb_llm)
    assert_no_leaks(ifb_llm)


@pytest.mark.slow
def test_closing_a_stream_cancels_but_a_clean_end_does_not(ifb_llm):
    _wait_idle(ifb_llm)
    cancelled = ifb_llm.get_scheduling_metrics()["cancelled"]
    deltas = list(ifb_llm.generate_stream("Hello", SamplingParams(max_tokens=5, temperature=0)))
    assert deltas[-1].finished and deltas[-1].finish_reason in ("stop", "length")
    assert ifb_llm.get_scheduling_metrics()["cancelled"] == cancelled
    full = ifb_llm.generate("Hello", SamplingParams(max_tokens=5, temperature=0))[0]
    assert "".join(d.text for d in deltas) == full.text
    stream = ifb_llm.generate_stream(
        "Tell me a long story.", SamplingParams(max_tokens=400, ignore_eos=True)
    )
    next(stream)
    stream.close()
    deadline = time.monotonic() + 10
    while ifb_llm.get_scheduling_metrics()["cancelled"] == cancelled:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    _wait_idle(ifb_llm)
    assert_no_leaks(ifb_llm)


@pytest.mark.slow
def test_bad_input_is_a_value_error_before_submit(ifb_llm):
    submitted = ifb_llm.get_scheduling_metrics()["submitted"]
    with pytest.raises(ValueError, match="max_model_len"):
        ifb_llm.generate("word " * 1100, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match=r"speech output.*not served by this deployment"):
        ifb_llm.start(GenerationRequest([1, 2], generate_audio=AudioReply("ethan")))
    with pytest.raises(ValueError, match=r"LoRA.*not served by this deployment.*--enable-lora"):
        ifb_llm.prepare("hi", SamplingParams(), lora_name="adapter")
    with pytest.raises(ValueError, match=r"n \(5\) exceeds max_batch_size \(4\)"):
        ifb_llm.prepare("hi", SamplingParams(n=5))
    assert ifb_llm.get_scheduling_metrics()["submitted"] == submitted


@pytest.mark.slow
def test_a_request_of_four_sequences_joins_a_running_batch(ifb_llm, llm):
    _wait_idle(ifb_llm)
    before = ifb_llm.get_scheduling_metrics()
    running = ifb_llm.start(
        ifb_llm.prepare("Tell me a long story.", SamplingParams(max_tokens=40, ignore_eos=True))
    )
    next(running)  # seated and decoding
    params = SamplingParams(max_tokens=16, n=3, temperature=0.9, seed=7, ignore_eos=True)
    (joined,) = ifb_llm.generate("The capital of France is", params)
    running.get(timeout=60)
    after = ifb_llm.get_scheduling_metrics()
    assert after["admitted_mid_flight"] > before["admitted_mid_flight"]
    assert len({s.token_ids for s in joined.outputs}) == 3
    alone = llm.generate("The capital of France is", params)[0]  # the blocking path
    assert [s.token_ids for s in joined.outputs] == [s.token_ids for s in alone.outputs]
    _wait_idle(ifb_llm)
    assert_no_leaks(ifb_llm)


def test_blocking_path_has_no_scheduling_metrics(tiny_dirs):
    llm = LLM(tiny_dirs["qwen2"], max_model_len=64)
    assert llm.get_scheduling_metrics() is None and not llm.in_flight_batching
    llm.close()


def test_the_deployment_gate_reads_the_plan(tiny_dirs, monkeypatch):
    """`ifb_unsupported_reason` reads the deployment plan: a feature the deployment uses that
    cannot run beside joiners refuses in-flight batching at load, naming it; the same
    deployment serves on the blocking path; a deployment without the feature is not refused."""
    monkeypatch.setitem(deployment.STEPPED, "lora", "its adapters would swap mid-batch")
    path = tiny_dirs["qwen2"]
    plain = LLM(path, max_model_len=64, enable_in_flight_batching=True)
    assert plain.in_flight_batching
    plain.close()
    with pytest.raises(
        ValueError,
        match="lora: its adapters would swap mid-batch; start without --enable-in-flight-batching",
    ):
        LLM(path, max_model_len=64, enable_in_flight_batching=True, enable_lora=True)
    # Without the flag the same deployment serves on the blocking path; never a silent fallback.
    llm = LLM(path, max_model_len=64, enable_lora=True)
    assert llm.generate("hi", SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids
    llm.close()


def test_close_drains_accepted_requests(tiny_dirs):
    llm = LLM(
        tiny_dirs["llama"], max_model_len=128, enable_in_flight_batching=True, max_batch_size=2
    )
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    handles = [llm.start(llm.prepare(p, params)) for p in ["a", "b", "c", "d"]]
    llm.close()
    assert all(len(h.get(timeout=0).token_ids) == 20 for h in handles)
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate("x")


def test_context_cache_reuse_metrics_under_ifb(tiny_dirs):
    llm = LLM(
        tiny_dirs["qwen3"],
        max_model_len=512,
        enable_in_flight_batching=True,
        max_batch_size=2,
        enable_context_reuse=True,
        block_size=8,
    )
    prefix = {"prompt_token_ids": list(range(10, 90))}
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    first = llm.generate(prefix, params)[0]
    second = llm.generate(prefix, params)[0]
    assert first.cached_tokens == 0 and second.cached_tokens == 72
    assert second.token_ids == first.token_ids
    metrics = llm.get_scheduling_metrics()
    assert metrics["context_cache_lookups"] == 2
    assert metrics["context_cache_hit_tokens"] == 72
    assert metrics["context_cache_hit_ratio"] == pytest.approx(72 / 160)
    llm.close()


def test_the_options_table_refuses_alike_on_both_paths(tiny_dirs):
    """Speech output, system-prompt KV capture (served where the context cache is on; here it
    is off) and trajectory execution, asked for by hand-built requests, are refused at start()
    with the same message under in-flight batching as on the blocking path: one naming what
    serves the caller instead, never "the blocking path" (which refuses them too). Each LLM
    serves on after its refusals."""
    options = {
        "generate_audio": AudioReply("ethan"),
        "save_system_prompt_kv_cache": True,
        "past_trajectory": [1],
    }
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    refusals = {}
    for ifb in (False, True):
        with LLM(
            tiny_dirs["qwen2"],
            max_model_len=64,
            enable_in_flight_batching=ifb,
            enable_context_reuse=False,
        ) as llm:
            for field, value in options.items():
                with pytest.raises(ValueError) as info:
                    llm.start(GenerationRequest([1, 2, 3], params, **{field: value}))
                refusals[field, ifb] = str(info.value)
            assert len(llm.generate({"prompt_token_ids": [1, 2, 3]}, params)[0].token_ids) == 2
    for field in options:
        refusal = refusals[field, True]
        assert refusal == refusals[field, False]
        assert f"({field}) is not served by this deployment: " in refusal
        assert "blocking path" not in refusal


def test_an_unprepared_request_is_refused_at_start_and_the_queue_serves_on(tiny_dirs):
    """A request built by hand (no prepare()) naming a LoRA adapter, on an LLM without LoRA:
    start() refuses it at once, a ValueError naming the option and --enable-lora, and queues
    nothing; a request started right after it completes."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with LLM(tiny_dirs["qwen2"], max_model_len=64, enable_in_flight_batching=True) as llm:
        with pytest.raises(ValueError, match=r"LoRA \(lora_name\) is not served.*--enable-lora"):
            llm.start(GenerationRequest([1, 2, 3], params, lora_name="sql"))
        metrics = llm.get_scheduling_metrics()
        assert metrics["submitted"] == 0 and metrics["queued"] == 0
        assert len(llm.start(GenerationRequest([1, 2, 3], params)).get(timeout=30).token_ids) == 4


def test_the_default_queue_accepts_three_hundred_requests_at_once(server_llm):
    # Requests wait in the engine, not refused, up to max_queued_requests (deep by default).
    assert server_llm.max_queued_requests == 4096
    params = SamplingParams(max_tokens=1)
    handles = [server_llm.start(server_llm.prepare("Hi", params)) for _ in range(300)]
    assert all(len(h.get(timeout=300).token_ids) == 1 for h in handles)


@pytest.mark.slow
def test_the_priority_policy_seats_the_lowest_priority_first(tiny_dirs):
    llm = LLM(
        tiny_dirs["llama"],
        max_model_len=128,
        enable_in_flight_batching=True,
        max_batch_size=1,
        scheduling_policy="priority",
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        running = llm.generate_stream("a", params)
        next(iter(running))  # seated: the rest queue behind it
        later = llm.start(llm.prepare("b", params, priority=3))
        sooner = llm.start(llm.prepare("c", params, priority=-2))
        alone = llm.generate("c", params)[0]  # queued last, at priority 0: after `sooner`
        assert later.ready() is False and sooner.ready()
        assert sooner.get().token_ids == alone.token_ids
        assert len(later.get(timeout=30).token_ids) == len(running.get().token_ids) == 24
    finally:
        llm.close()
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        LLM(tiny_dirs["llama"], max_model_len=128).prepare("a", priority=1)

"""Overlapped stepping (complete step N while step N+1 runs), exercised on the CPU."""

import pytest

from inflight.engine import EngineConfig, RequestEngine
from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.outputs import FinishReason
from inflight.protocol.request import GenerationRequest, SamplingParams
from inflight.runtime.runtime import Runtime

from helpers import assert_no_leaks, run_staggered


@pytest.fixture(scope="module")
def runtimes(tiny_dirs):
    def make(overlap):
        config = DeploymentOptions(
            max_batch_size=4, max_model_len=256, max_num_tokens=24, overlap=overlap, block_size=8
        )
        return Runtime(tiny_dirs["qwen3"], config)

    return make(False), make(True)


def _requests():
    params = [
        dict(max_tokens=1, temperature=0),
        dict(max_tokens=7, temperature=0, stop_token_ids=[]),
        dict(max_tokens=12, temperature=0.8, seed=5),
        dict(max_tokens=5, temperature=0, logprobs=2),
        dict(max_tokens=9, temperature=1.0, top_k=20, seed=9),
        dict(max_tokens=8, temperature=0),  # exactly fills its last KV block (16 + 8 = 24)
    ]
    prompts = [range(3, 13), range(20, 47), range(5, 9), range(50, 90), range(7, 30), range(1, 17)]
    return [
        GenerationRequest(list(p), SamplingParams(ignore_eos=True, **kw))
        for p, kw in zip(prompts, params, strict=True)
    ]


def test_overlapped_steps_give_the_same_outputs(runtimes):
    plain, overlapped = runtimes
    want = run_staggered(plain, _requests())
    got = run_staggered(overlapped, _requests())
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids and a.text == b.text
        assert a.finish_reason == b.finish_reason
        assert (a.logprobs is None) == (b.logprobs is None)
    assert_no_leaks(overlapped)


def test_penalized_rows_take_in_the_step_before_and_equal_their_solo_runs(runtimes):
    """Penalties read the tokens before a row's on the host: with overlap, the step before is
    taken in before the row is sampled. Beside plain rows, each penalized row gets what it gets
    alone, and the penalties did change what it gets."""
    plain = runtimes[0]
    penalized = [
        dict(max_tokens=14, temperature=0, repetition_penalty=1.6, frequency_penalty=0.5),
        dict(max_tokens=14, temperature=0.9, seed=3, presence_penalty=-2.0),
        dict(max_tokens=14, temperature=0, repetition_penalty=0.5),
    ]
    prompts = [range(30, 45), range(2, 20), range(60, 64)]

    def requests(penalties=True):
        made = [
            GenerationRequest(
                list(p),
                SamplingParams(
                    ignore_eos=True,
                    **{k: v for k, v in kw.items() if penalties or not k.endswith("penalty")},
                ),
            )
            for p, kw in zip(prompts, penalized, strict=True)
        ]
        return [made[0], *_requests()[1:3], made[1], made[2]]

    alone = [plain.handle_request(r).result().token_ids for r in requests()]
    for runtime in runtimes:
        assert [o.token_ids for o in run_staggered(runtime, requests())] == alone
        assert_no_leaks(runtime)
    unpenalized = [plain.handle_request(r).result().token_ids for r in requests(False)]
    for i in (0, 3, 4):
        assert alone[i] != unpenalized[i], i


def test_a_step_completes_one_call_later(runtimes):
    _, overlapped = runtimes
    session = overlapped.new_session()
    ref = session.admit(_requests()[0]).ref  # max_tokens=1
    first = session.step()  # launches the prefill; nothing is complete yet
    assert not first.deltas and not first.finished
    second = session.step()  # launches a (wasted) decode row, completes the prefill
    assert second.finished[ref].finish_reason is FinishReason.LENGTH
    assert len(second.deltas[ref].token_ids) == 1
    assert session.residents() == []
    session.finish()  # waits for the wasted step
    assert_no_leaks(overlapped)


def test_cancel_and_abort_with_a_step_in_flight(runtimes):
    _, overlapped = runtimes
    session = overlapped.new_session()
    keep = session.admit(_requests()[2]).ref
    drop = session.admit(_requests()[4]).ref
    session.step()
    session.step()
    result = session.step(cancelled=[drop])
    assert result.finished[drop].finish_reason is FinishReason.CANCELLED
    assert drop not in result.deltas and keep in result.deltas
    assert session.abort() == [keep]
    session.finish()
    assert_no_leaks(overlapped)


def test_the_engine_drives_an_overlapped_runtime(runtimes):
    plain, overlapped = runtimes
    want = [plain.handle_request(r).result().token_ids for r in _requests()]
    engine = RequestEngine(overlapped, EngineConfig(max_batch_size=4))
    handles = [engine.submit(r) for r in _requests()]
    assert [h.get(timeout=30).token_ids for h in handles] == want
    engine.shutdown()
    assert engine.metrics.admitted_mid_flight > 0
    assert_no_leaks(overlapped)

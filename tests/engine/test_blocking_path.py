"""The blocking path: the engine with batches of one request each, every request run whole
alone in a session of its own (against a fake execution)."""

import pytest

from inflight.engine import EngineConfig, RequestCancelled, RequestEngine, RequestFailed
from inflight.protocol.request import AudioReply

from fake_execution import FakeFactory
from test_request_engine import req, wait_until


class FakeBlockingRuntime:
    """The fake execution factory, and what the tests read of it."""

    def __init__(self, **factory) -> None:
        self.factory = FakeFactory(max_batch_size=1, **factory)


def blocking_engine(runtime, **config):
    return RequestEngine(
        runtime.factory, EngineConfig(**{"max_batch_size": 1, "idle_wait": 0.01, **config})
    )


def test_requests_run_whole_one_at_a_time_in_fcfs_order():
    runtime = FakeBlockingRuntime(step_delay=0.005)
    e = blocking_engine(runtime)
    handles = [e.submit(req(tokens=3 + i, prompt=(i,))) for i in range(4)]
    outputs = [h.get(timeout=5) for h in handles]
    assert [o.token_ids for o in outputs] == [tuple(range(1, 4 + i)) for i in range(4)]
    assert [r.prompt_token_ids for r in runtime.factory.admitted] == [(0,), (1,), (2,), (3,)]
    assert runtime.factory.sessions == 4  # each request ran in a session of its own
    assert e.metrics.admitted_mid_flight == 0 and e.metrics.completed == 4
    e.shutdown()


def test_a_stream_carries_the_runs_chunks_then_its_end():
    e = blocking_engine(FakeBlockingRuntime())
    chunks = list(e.submit(req(tokens=3)))  # a consumer that lags gets them merged
    assert [t for c in chunks for t in c.token_ids] == [1, 2, 3]
    assert "".join(c.text for c in chunks) == "<1><2><3>"
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    e.shutdown()


def test_cancel_closes_the_run_within_a_tick():
    runtime = FakeBlockingRuntime(step_delay=0.01)
    e = blocking_engine(runtime)
    handle = e.submit(req(tokens=1000))
    assert next(handle).token_ids == [1]
    handle.cancel()
    wait_until(handle.ready)
    with pytest.raises(RequestCancelled):
        handle.get()
    assert runtime.factory.slots.num_free == 1  # the run was aborted: its slot is back
    assert e.submit(req(tokens=2)).get(timeout=5).token_ids == (1, 2)
    e.shutdown()


def test_a_request_the_runtime_rejects_fails_and_the_next_one_runs():
    runtime = FakeBlockingRuntime(reject_if=lambda r: r.prompt_token_ids == (9,))
    e = blocking_engine(runtime)
    with pytest.raises(RequestFailed, match="the fake rejects"):
        e.submit(req(prompt=(9,))).get(timeout=5)
    assert e.submit(req(tokens=2)).get(timeout=5).token_ids == (1, 2)
    e.shutdown()


def test_a_failing_run_fails_its_request_only():
    runtime = FakeBlockingRuntime(fail_steps=1)
    e = blocking_engine(runtime)
    with pytest.raises(RequestFailed, match="step failed"):
        e.submit(req()).get(timeout=5)
    assert e.submit(req(tokens=2)).get(timeout=5).token_ids == (1, 2)
    assert runtime.factory.slots.num_free == 1
    e.shutdown()


def test_what_the_runtime_refuses_is_refused_at_submit_as_under_ifb():
    """The blocking path refuses what its runtime's check refuses, a permanent refusal at
    submit (nothing queued); what the runtime serves runs (here the fake serves speech)."""
    e = blocking_engine(FakeBlockingRuntime(check_refuses=lambda r: r.past_trajectory))
    assert e.submit(req(tokens=2, generate_audio=AudioReply("ethan"))).get(timeout=5).token_ids == (
        1,
        2,
    )
    with pytest.raises(ValueError, match="check refuses"):
        e.submit(req(past_trajectory=[1]))
    assert e.metrics.submitted == 1
    e.shutdown()


def test_shutdown_drains_the_queue():
    e = blocking_engine(FakeBlockingRuntime(step_delay=0.005))
    handles = [e.submit(req(tokens=5)) for _ in range(3)]
    e.shutdown()
    assert all(h.get(timeout=0).token_ids == (1, 2, 3, 4, 5) for h in handles)

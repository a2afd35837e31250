"""In-flight admission at batch 2 (and more), against a fake SteppedExecution."""

import contextlib
import time

import pytest

from inflight.engine import (
    EngineConfig,
    RequestCancelled,
    RequestEngine,
    RequestFailed,
    ShutdownMode,
    SubmitError,
)
from inflight.protocol.request import RequestFieldError

from fake_execution import FakeFactory
from test_request_engine import req, wait_until


def engine(factory, batch=2, **config):
    return RequestEngine(factory, EngineConfig(max_batch_size=batch, idle_wait=0.01, **config))


def test_joiner_is_admitted_mid_flight_with_its_own_tokens():
    factory = FakeFactory(step_delay=0.02)
    e = engine(factory)
    founder = e.submit(req(tokens=6))
    wait_until(lambda: e.resident == 1)
    joiner = e.submit(req(tokens=3, prompt=(7, 7)))
    assert joiner.get(timeout=5).token_ids == (1, 2, 3)
    assert founder.get(timeout=5).token_ids == (1, 2, 3, 4, 5, 6)
    assert e.metrics.admitted_mid_flight == 1
    assert factory.sessions == 1
    e.shutdown()


def test_early_evicted_founder_is_published_while_the_joiner_decodes():
    factory = FakeFactory(step_delay=0.02)
    e = engine(factory)
    founder = e.submit(req(tokens=2))
    joiner = e.submit(req(tokens=50))
    founder.get(timeout=5)
    assert not joiner.ready() and e.resident == 1
    joiner.get(timeout=10)
    e.shutdown()


@pytest.mark.parametrize(
    ("head", "stall"),
    [
        (req(tokens=3, sp={"temperature": 0.11}), "stalls_incompatible"),
        (req(tokens=3, sp={"structured_outputs": {"regex": "[ab]+"}}), "stalls_incompatible"),
    ],
)
def test_unjoinable_head_waits_and_founds_the_next_batch(head, stall):
    # A V0-like runtime: nothing is applied per row, so sampling parameters must match.
    factory = FakeFactory(step_delay=0.02)
    e = engine(factory)
    founder = e.submit(req(tokens=6))
    wait_until(lambda: e.resident == 1)
    waiting = e.submit(head)
    behind = e.submit(req(tokens=1))  # compatible with the founder, but may not jump the head
    for h in (founder, waiting, behind):
        h.get(timeout=5)
    assert getattr(e.metrics, stall) > 0 and e.metrics.admitted_mid_flight == 0
    # Strict FCFS: the head founded the second batch, and the request behind it the third.
    assert factory.admitted[1] is head and factory.admitted[2].params.max_tokens == 1
    assert factory.sessions == 3
    e.shutdown()


def test_per_row_fields_never_block_a_join():
    factory = FakeFactory(
        step_delay=0.02, per_row_fields=frozenset({"params.temperature", "params.max_tokens"})
    )
    e = engine(factory)
    founder = e.submit(req(tokens=6))
    wait_until(lambda: e.resident == 1)
    joiner = e.submit(req(tokens=2, sp={"temperature": 0.11}))
    joiner.get(timeout=5)
    founder.get(timeout=5)
    assert e.metrics.admitted_mid_flight == 1 and e.metrics.stalls_incompatible == 0
    e.shutdown()


def test_three_no_capacity_answers_then_admission():
    factory = FakeFactory(step_delay=0.02, no_capacity_answers=3)
    e = engine(factory)
    founder = e.submit(req(tokens=20))
    wait_until(lambda: e.resident == 1)
    joiner = e.submit(req(tokens=2))
    joiner.get(timeout=5)
    assert not founder.ready()
    assert e.metrics.stalls_no_capacity == 3 and e.metrics.admitted_mid_flight == 1
    founder.get(timeout=5)
    e.shutdown()


def test_rejected_admission_fails_only_the_head():
    factory = FakeFactory(step_delay=0.02, reject_if=lambda r: r.prompt_token_ids == (66,))
    e = engine(factory)
    founder = e.submit(req(tokens=8))
    wait_until(lambda: e.resident == 1)
    bad = e.submit(req(prompt=(66,)))
    good = e.submit(req(tokens=2))
    with pytest.raises(RequestFailed, match="rejects"):
        bad.get(timeout=5)
    assert good.get(timeout=5) and founder.get(timeout=5)
    assert (e.metrics.failed, e.metrics.completed, e.metrics.admitted_mid_flight) == (1, 2, 1)
    e.shutdown()


def test_a_drained_batch_takes_no_admission():
    factory = FakeFactory(step_delay=0.03)
    e = engine(factory)
    first = e.submit(req(tokens=1))
    first.get(timeout=5)
    second = e.submit(req(tokens=1))
    second.get(timeout=5)
    assert factory.sessions == 2 and e.metrics.admitted_mid_flight == 0
    e.shutdown()


def _without_outcome(e):
    """Accepted requests that have no outcome yet (each holds a backlog reservation)."""
    m = e.metrics.snapshot()
    return m["submitted"] - m["completed"] - m["cancelled"] - m["failed"]


def test_retired_admissions_release_their_backlog_reservation():
    factory = FakeFactory(step_delay=0.01, reject_if=lambda r: r.prompt_token_ids == (66,))
    e = engine(factory, max_pending_requests=3)
    for _ in range(6):
        handles = [e.submit(req(tokens=2)), e.submit(req(prompt=(66,))), e.submit(req(tokens=1))]
        for h in handles:
            with contextlib.suppress(RequestFailed):
                h.get(timeout=5)
        wait_until(lambda: _without_outcome(e) == 0)
    assert e.metrics.refused == 0 and e.metrics.failed == 6
    # The whole backlog is free again: max_pending_requests more are accepted at once.
    handles = [e.submit(req(tokens=5)) for _ in range(3)]
    assert e.metrics.refused == 0
    assert all(h.get(timeout=5) for h in handles)
    e.shutdown()


def test_metrics_add_up_exactly():
    factory = FakeFactory(step_delay=0.05)
    e = engine(factory, max_pending_requests=2)
    a = e.submit(req(tokens=4))
    wait_until(lambda: e.resident == 1)
    b = e.submit(req(tokens=1, sp={"temperature": 0.5}))  # incompatible: stalls while a runs
    with pytest.raises(SubmitError):
        e.submit(req())
    a.get(timeout=5)
    b.get(timeout=5)
    e.shutdown()
    m = e.metrics.snapshot()
    assert (m["submitted"], m["refused"], m["completed"]) == (2, 1, 2)
    assert m["stalls_incompatible"] >= 1 and m["admitted_mid_flight"] == 0
    assert m["queue_latency_count"] == 2 and m["queue_latency_max_us"] > 0
    assert m["queue_latency_avg_us"] == m["queue_latency_total_us"] // 2
    assert m["cancelled"] == m["failed"] == 0


def test_mid_flight_metrics_and_resident_gauge():
    factory = FakeFactory(step_delay=0.03)
    e = engine(factory)
    a = e.submit(req(tokens=6))
    wait_until(lambda: e.resident == 1)
    b = e.submit(req(tokens=2))
    wait_until(lambda: e.resident == 2)
    b.get(timeout=5)
    wait_until(lambda: e.resident == 1)
    a.get(timeout=5)
    wait_until(lambda: e.resident == 0)
    assert e.metrics.admitted_mid_flight == 1 and e.metrics.completed == 2
    e.shutdown()


def test_several_joiners_are_seated_in_one_tick():
    factory = FakeFactory(step_delay=0.05)
    e = engine(factory, batch=4)
    founder = e.submit(req(tokens=10))
    wait_until(lambda: e.resident == 1)
    steps_before = factory.steps
    joiners = [e.submit(req(tokens=2)) for _ in range(3)]
    wait_until(lambda: e.resident == 4, timeout=5)
    assert factory.steps - steps_before <= 2
    for h in [*joiners, founder]:
        h.get(timeout=5)
    assert e.metrics.admitted_mid_flight == 3
    e.shutdown()


def test_a_joiner_lost_by_the_batch_still_gets_an_error():
    factory = FakeFactory(step_delay=0.02, lose_joiners=True)
    e = engine(factory)
    founder = e.submit(req(tokens=8))
    wait_until(lambda: e.resident == 1)
    joiner = e.submit(req(tokens=8))
    with pytest.raises(RequestFailed, match="lost"):
        joiner.get(timeout=5)
    founder.get(timeout=5)
    e.shutdown()


def test_cancelling_shutdown_reaches_a_joiner():
    factory = FakeFactory(step_delay=0.02)
    e = engine(factory)
    a = e.submit(req(tokens=10**9))
    wait_until(lambda: e.resident == 1)
    b = e.submit(req(tokens=10**9))
    wait_until(lambda: e.resident == 2)
    start = time.monotonic()
    e.shutdown(ShutdownMode.CANCEL)
    assert time.monotonic() - start < 5
    for h in (a, b):
        with pytest.raises(RequestCancelled):
            h.get(timeout=0)
    assert e.metrics.cancelled == 2 and e.metrics.completed == 0


def test_the_priority_policy_seats_lower_priorities_first_then_by_arrival():
    factory = FakeFactory(step_delay=0.02)
    e = engine(factory, batch=1, scheduling_policy="priority")
    running = e.submit(req(tokens=8, prompt=(1,)))
    wait_until(lambda: e.resident == 1)
    handles = [
        e.submit(req(tokens=2, prompt=(prompt,), priority=priority))
        for prompt, priority in [(2, 5), (3, 0), (4, 5), (5, -1), (6, 0)]
    ]
    for h in [running, *handles]:
        h.get(timeout=10)
    # Nothing running was preempted: the first request kept its seat.
    assert [r.prompt_token_ids[0] for r in factory.admitted] == [1, 5, 3, 6, 2, 4]
    e.shutdown()


def test_a_cancelled_queued_request_leaves_the_priority_order_of_the_rest():
    factory = FakeFactory(step_delay=0.02)
    e = engine(factory, batch=1, scheduling_policy="priority")
    running = e.submit(req(tokens=8, prompt=(1,)))
    wait_until(lambda: e.resident == 1)
    handles = {
        prompt: e.submit(req(tokens=2, prompt=(prompt,), priority=priority))
        for prompt, priority in [(2, 5), (3, 0), (4, -1), (5, 0)]
    }
    e.cancel(handles[4].id)
    with pytest.raises(RequestCancelled):
        handles[4].get(timeout=10)
    for h in [running, handles[2], handles[3], handles[5]]:
        h.get(timeout=10)
    assert [r.prompt_token_ids[0] for r in factory.admitted] == [1, 3, 5, 2]
    e.shutdown()


def test_a_priority_is_refused_by_name_under_fcfs():
    factory = FakeFactory()
    e = engine(factory)
    with pytest.raises(RequestFieldError, match="--scheduling-policy priority") as err:
        e.submit(req(priority=1))
    assert err.value.field == "priority"
    assert e.metrics.submitted == 0 and e.metrics.refused == 0
    assert e.submit(req(priority=0)).get(timeout=5).token_ids == (1, 2, 3)
    e.shutdown()

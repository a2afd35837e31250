"""RequestEngine against a fake SteppedExecution (reference §7, requestEngineTests)."""

import gc
import threading
import time

import pytest

from inflight.engine import (
    EngineConfig,
    RequestCancelled,
    RequestEngine,
    RequestFailed,
    ShutdownMode,
    StreamChannel,
    SubmitError,
)
from inflight.protocol.request import AudioReply, GenerationRequest, SamplingParams

from fake_execution import FakeFactory


def req(tokens=3, prompt=(1, 2, 3), **kw):
    params = kw.pop("params", None) or SamplingParams(max_tokens=tokens, **kw.pop("sp", {}))
    return GenerationRequest(list(prompt), params, **kw)


def engine(factory=None, **config):
    factory = factory or FakeFactory()
    cfg = EngineConfig(**{"max_batch_size": 1, "idle_wait": 0.01, **config})
    return RequestEngine(factory, cfg)


def wait_until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.002)


# -- submission ----------------------------------------------------------------------------------


def test_submit_returns_at_once_while_the_actor_is_busy():
    e = engine(FakeFactory(step_delay=0.3))
    first = e.submit(req(tokens=3))
    wait_until(lambda: e.resident == 1)
    start = time.monotonic()
    second = e.submit(req(tokens=1))
    assert time.monotonic() - start < 0.2
    assert first.get(timeout=10).token_ids == (1, 2, 3)
    assert second.get(timeout=10).text == "<1>"
    e.shutdown()


def test_ids_are_nonzero_and_increasing():
    e = engine()
    ids = [e.submit(req(tokens=1)).id for _ in range(5)]
    assert ids[0] > 0 and ids == sorted(ids) and len(set(ids)) == 5
    e.shutdown()


def test_batch_of_one_runs_fcfs_each_founding_its_batch():
    factory = FakeFactory()
    e = engine(factory)
    handles = [e.submit(req(tokens=2, prompt=(i,))) for i in range(4)]
    for h in handles:
        h.get(timeout=5)
    assert [r.prompt_token_ids for r in factory.admitted] == [(0,), (1,), (2,), (3,)]
    assert factory.sessions == 4
    assert e.metrics.admitted_mid_flight == 0
    e.shutdown()


def test_what_the_runtimes_check_refuses_is_a_permanent_refusal_at_submit():
    """A request built by hand is checked at submit (a prepared one carries its check): what
    the runtime cannot serve is a ValueError naming it, counted as neither submitted nor
    refused, and nothing is queued."""
    factory = FakeFactory(check_refuses=lambda r: r.generate_audio is not None)
    e = engine(factory)
    with pytest.raises(ValueError, match="check refuses"):
        e.submit(req(generate_audio=AudioReply("ethan")))
    assert e.metrics.submitted == 0 and e.metrics.refused == 0
    assert e.submit(req(tokens=1)).get(timeout=5).text == "<1>"
    assert factory.admitted == [req(tokens=1)]
    e.shutdown()


def test_a_runtime_that_stops_serving_between_batches_closes_admission():
    """A runtime fault seen while no step runs (a tensor-parallel rank lost while idle): new
    requests are refused for good naming it, the queued ones fail, the engine stops."""
    factory = FakeFactory(step_delay=0.02)
    e = engine(factory)
    running = e.submit(req(tokens=20))
    wait_until(lambda: e.resident == 1)
    queued = e.submit(req(tokens=1))
    factory.fault = "tensor-parallel rank 1 exited with code -9"
    assert running.get(timeout=5).token_ids == tuple(range(1, 21))  # its batch ends as it was
    with pytest.raises(RequestFailed, match="rank 1 exited"):
        queued.get(timeout=5)
    with pytest.raises(SubmitError, match="rank 1 exited") as refused:
        e.submit(req())
    assert refused.value.shutting_down and not e.running and "rank 1" in e.fault
    e.shutdown()


def test_full_command_queue_is_a_submit_error():
    factory = FakeFactory(step_delay=0.5)
    e = engine(factory, command_queue_capacity=2)
    e.submit(req(tokens=2))
    wait_until(lambda: e.resident == 1)
    e.submit(req())
    e.submit(req())
    with pytest.raises(SubmitError, match="command queue is full"):
        e.submit(req())
    assert e.metrics.refused == 1 and e.metrics.submitted == 3
    e.shutdown(ShutdownMode.CANCEL)


def test_backlog_is_bounded_by_pending_requests_not_queue_size():
    factory = FakeFactory(step_delay=0.2)
    e = engine(factory, max_pending_requests=3, command_queue_capacity=64)
    handles = [e.submit(req(tokens=2)) for _ in range(3)]
    with pytest.raises(SubmitError, match="too many requests in flight"):
        e.submit(req())
    handles[0].get(timeout=5)
    e.submit(req(tokens=1)).get(timeout=5)  # a finished request frees its reservation
    e.shutdown()


# -- cancellation --------------------------------------------------------------------------------


def test_cancelled_queued_request_releases_caller_and_never_runs():
    factory = FakeFactory(step_delay=0.1)
    e = engine(factory)
    busy = e.submit(req(tokens=5))
    queued = e.submit(req(prompt=(9,)))
    queued.cancel()
    start = time.monotonic()
    with pytest.raises(RequestCancelled):
        queued.get()
    assert time.monotonic() - start < 0.05
    busy.get(timeout=5)
    wait_until(lambda: e.metrics.cancelled == 1)
    assert all(r.prompt_token_ids != (9,) for r in factory.admitted)
    e.shutdown()
    assert e.metrics.cancelled == 1 and e.metrics.completed == 1


def test_cancel_by_id_works_with_a_full_queue():
    factory = FakeFactory(step_delay=0.2)
    e = engine(factory, command_queue_capacity=2)
    busy = e.submit(req(tokens=3))
    wait_until(lambda: e.resident == 1)
    a, b = e.submit(req()), e.submit(req())
    with pytest.raises(SubmitError):
        e.submit(req())
    e.cancel(a.id)
    e.cancel(busy.id)
    e.cancel(123456)  # unknown ids are ignored
    with pytest.raises(RequestCancelled):
        busy.get(timeout=5)
    with pytest.raises(RequestCancelled):
        a.get(timeout=5)
    assert b.get(timeout=5).token_ids == (1, 2, 3)
    e.shutdown()


def test_cancelled_resident_ends_at_next_step_as_cancelled():
    factory = FakeFactory(step_delay=0.02)
    e = engine(factory)
    h = e.submit(req(tokens=1000))
    chunks = h.stream()
    assert chunks.wait_pop(timeout=5) is not None  # it is resident and decoding
    h.cancel()
    with pytest.raises(RequestCancelled):
        h.get()
    wait_until(lambda: h.ready())
    assert e.metrics.cancelled == 1 and e.metrics.completed == 0
    wait_until(lambda: e.resident == 0)
    assert factory.slots.num_free == factory.slots.capacity
    e.shutdown()


def test_caller_channel_is_the_handle_channel_and_sees_a_queued_cancel():
    e = engine(FakeFactory(step_delay=0.1))
    e.submit(req(tokens=3))
    channel = StreamChannel()
    h = e.submit(req(), channel=channel)
    assert h.stream() is channel
    h.cancel()
    assert channel.is_cancelled
    wait_until(h.ready)
    e.shutdown()


def test_cancel_wins_over_a_step_that_finishes_the_sequence():
    handles = []

    def cancel_mid_step(execution):
        # The cancel lands after the step polled the flags, in the step that finishes it.
        if execution.factory.steps == 2:
            handles[0].cancel()

    e = engine(FakeFactory(on_step=cancel_mid_step, step_delay=0.01))
    handles.append(e.submit(req(tokens=2)))
    with pytest.raises(RequestCancelled):
        handles[0].get(timeout=5)
    wait_until(handles[0].ready)
    assert e.metrics.cancelled == 1 and e.metrics.completed == 0
    e.shutdown()


# -- failures ------------------------------------------------------------------------------------


def test_failed_step_is_an_error_with_a_terminal_channel():
    e = engine(FakeFactory(fail_steps=1))
    h = e.submit(req())
    with pytest.raises(RequestFailed, match="step failed"):
        h.get(timeout=5)
    assert h.stream().is_cancelled
    e.shutdown()


def test_a_throwing_step_does_not_kill_the_actor():
    e = engine(FakeFactory(fail_steps=1))
    with pytest.raises(RequestFailed):
        e.submit(req()).get(timeout=5)
    assert e.submit(req(tokens=2)).get(timeout=5).token_ids == (1, 2)
    assert (e.metrics.failed, e.metrics.completed) == (1, 1)
    e.shutdown()


def test_a_failed_step_the_runtime_cannot_recover_from_stops_the_engine():
    """The step fails and so does the batch's abort: the runtime may hold the batch still, so
    the engine stops (failing what waits) rather than founding batches that cannot run."""
    factory = FakeFactory(fail_steps=1, abort_raises=True, step_delay=0.01)
    e = engine(factory)
    first, queued = e.submit(req()), e.submit(req())
    with pytest.raises(RequestFailed, match="the step failed"):
        first.get(timeout=5)
    with pytest.raises(RequestFailed, match="did not recover from a failed step"):
        queued.get(timeout=5)
    assert "did not recover" in e.fault and not e.running
    with pytest.raises(SubmitError, match="internal error"):
        e.submit(req())
    assert (e.metrics.failed, e.metrics.cancelled) == (2, 0)


def test_refused_or_throwing_founding_is_an_error():
    factory = FakeFactory(refuse_founding=True)
    e = engine(factory)
    with pytest.raises(RequestFailed, match="refused"):
        e.submit(req()).get(timeout=5)
    factory.refuse_founding = False
    factory.raise_on_admit = True
    with pytest.raises(RequestFailed, match="blew up"):
        e.submit(req()).get(timeout=5)
    factory.raise_on_admit = False
    assert e.submit(req()).get(timeout=5)
    assert (e.metrics.failed, e.metrics.completed) == (2, 1)
    e.shutdown()


# -- containment: errors outside the step ---------------------------------------------------------


class BrokenChannel(StreamChannel):
    """A consumer's channel whose push raises from its `fail_at`-th chunk on."""

    def __init__(self, fail_at: int = 2) -> None:
        super().__init__()
        self.pushes, self.fail_at = 0, fail_at

    def push(self, chunk) -> None:
        self.pushes += 1
        if self.pushes >= self.fail_at:
            raise OSError("the consumer went away")
        super().push(chunk)


def test_an_error_escaping_the_actor_fails_every_request_and_closes_admission():
    """residents() raising is outside the step: the actor stops, and every accepted request
    (residents, queued, a caller parked in get()) fails with the error; none is reported as
    cancelled; admission closes with that reason."""
    factory = FakeFactory(step_delay=0.02)
    e = engine(factory, max_batch_size=2)
    residents = [e.submit(req(tokens=10**6)) for _ in range(2)]
    wait_until(lambda: e.resident == 2)
    queued = e.submit(req())
    parked = []
    waiter = threading.Thread(target=lambda: parked.append(_outcome(residents[0], 10)))
    waiter.start()
    factory.residents_raise = True
    waiter.join(timeout=5)
    assert len(parked) == 1 and parked[0].startswith("failed:")
    assert "the engine stopped on an internal error" in parked[0]
    for h in [*residents, queued]:
        with pytest.raises(RequestFailed, match="internal error.*lost track of its residents"):
            h.get(timeout=5)
        assert h.stream().ended
    assert e.fault == "RuntimeError: the fake lost track of its residents"
    assert not e.running
    with pytest.raises(SubmitError, match="internal error") as info:
        e.submit(req())
    assert info.value.shutting_down
    m = e.metrics
    assert (m.submitted, m.failed, m.cancelled, m.completed) == (3, 3, 0, 0)
    assert factory.slots.num_free == factory.max_batch_size  # the batch was aborted
    e.shutdown()  # returns: the actor is gone


def _outcome(handle, timeout):
    try:
        handle.get(timeout=timeout)
        return "completed"
    except RequestFailed as exc:
        return f"failed: {exc}"
    except RequestCancelled:
        return "cancelled"


def test_a_channel_that_raises_fails_only_its_own_request():
    factory = FakeFactory(step_delay=0.01)
    e = engine(factory, max_batch_size=2)
    broken = e.submit(req(tokens=6), BrokenChannel(fail_at=2))
    healthy = e.submit(req(tokens=6))
    with pytest.raises(RequestFailed, match="its stream raised: the consumer went away"):
        broken.get(timeout=5)
    assert healthy.get(timeout=5).token_ids == (1, 2, 3, 4, 5, 6)
    assert e.submit(req(tokens=2)).get(timeout=5).token_ids == (1, 2)
    assert e.running and e.fault is None
    m = e.metrics
    assert (m.submitted, m.failed, m.cancelled, m.completed) == (3, 1, 0, 2)
    wait_until(lambda: factory.slots.num_free == factory.max_batch_size)
    e.shutdown()


def test_cancel_releases_a_caller_already_parked_in_get():
    """The caller waits in get() for a request whose steps take a second each; a cancel from
    another thread (by handle, or by id) releases it at once, not at the actor's next step."""
    e = engine(FakeFactory(step_delay=1.0), max_batch_size=2)
    by_handle, by_id = e.submit(req(tokens=100)), e.submit(req(tokens=100))
    wait_until(lambda: e.resident == 2)
    for handle, cancel in ((by_handle, by_handle.cancel), (by_id, lambda: e.cancel(by_id.id))):
        released = []
        waiter = threading.Thread(target=lambda h=handle, out=released: out.append(_outcome(h, 30)))
        waiter.start()
        time.sleep(0.05)  # parked in get()
        start = time.monotonic()
        cancel()
        waiter.join(timeout=5)
        assert released == ["cancelled"]
        assert time.monotonic() - start < 0.5
    e.shutdown(ShutdownMode.CANCEL)
    assert e.metrics.cancelled == 2


# -- shutdown ------------------------------------------------------------------------------------


def test_drain_lets_queued_requests_finish():
    e = engine(FakeFactory(step_delay=0.01))
    handles = [e.submit(req(tokens=3)) for _ in range(5)]
    e.shutdown(ShutdownMode.DRAIN)
    assert all(h.get(timeout=0).token_ids == (1, 2, 3) for h in handles)
    assert e.metrics.completed == 5


def test_cancel_shutdown_wakes_parked_callers():
    e = engine(FakeFactory(step_delay=0.05))
    handles = [e.submit(req(tokens=10000)) for _ in range(3)]
    results = []

    def wait(h):
        try:
            h.get()
        except RequestCancelled:
            results.append("cancelled")

    threads = [threading.Thread(target=wait, args=(h,)) for h in handles]
    for t in threads:
        t.start()
    e.shutdown(ShutdownMode.CANCEL)
    for t in threads:
        t.join(timeout=5)
    assert results == ["cancelled"] * 3
    assert e.metrics.cancelled == 3 and e.metrics.completed == 0


def test_submit_after_shutdown_is_a_submit_error():
    e = engine()
    e.shutdown()
    assert not e.running
    with pytest.raises(SubmitError, match="shutting down") as info:
        e.submit(req())
    assert info.value.shutting_down


def test_dropping_the_engine_shuts_it_down():
    # The thread that runs the steps is the engine's actor thread.
    actors = []
    e = engine(
        FakeFactory(step_delay=0.01, on_step=lambda _: actors.append(threading.current_thread()))
    )
    h = e.submit(req(tokens=100000))
    wait_until(lambda: actors)
    thread = actors[0]
    assert thread is not threading.current_thread() and thread.is_alive()
    del e
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()
    with pytest.raises(RequestCancelled):
        h.get(timeout=1)


def test_submit_racing_shutdown_never_strands_or_cancels_accepted_requests():
    for _ in range(200):
        e = engine(FakeFactory(), max_batch_size=2)
        accepted, refused = [], []
        barrier = threading.Barrier(2)

        def submitter(e=e, accepted=accepted, refused=refused, barrier=barrier):
            barrier.wait()
            for _ in range(5):
                try:
                    accepted.append(e.submit(req(tokens=1)))
                except SubmitError:
                    refused.append(1)

        t = threading.Thread(target=submitter)
        t.start()
        barrier.wait()
        e.shutdown(ShutdownMode.DRAIN)
        t.join()
        assert len(accepted) + len(refused) == 5
        for h in accepted:
            assert h.get(timeout=0).token_ids == (1,)
        assert e.metrics.completed == len(accepted) and e.metrics.cancelled == 0


def test_handle_outlives_its_engine():
    e = engine()
    h = e.submit(req(tokens=2))
    e.shutdown()
    del e
    gc.collect()
    assert h.ready() and h.get().token_ids == (1, 2)
    h.cancel()  # after the outcome: nothing happens
    assert h.get().token_ids == (1, 2)


def test_cancel_shutdown_with_a_full_queue_still_reaches_the_batch():
    factory = FakeFactory(step_delay=0.05)
    e = engine(factory, command_queue_capacity=2)
    running = e.submit(req(tokens=10**9))
    wait_until(lambda: e.resident == 1)
    e.submit(req())
    e.submit(req())
    start = time.monotonic()
    e.shutdown(ShutdownMode.CANCEL)
    assert time.monotonic() - start < 5
    with pytest.raises(RequestCancelled):
        running.get(timeout=0)
    assert e.metrics.cancelled == 3 and e.metrics.completed == 0


def test_concurrent_shutdowns_join_once():
    e = engine(FakeFactory(step_delay=0.01))
    handles = [e.submit(req(tokens=5)) for _ in range(3)]
    threads = [threading.Thread(target=e.shutdown) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=5)
    e.shutdown(ShutdownMode.CANCEL)  # later calls do nothing (the first mode won)
    assert all(h.get(timeout=0) for h in handles)
    assert e.metrics.completed == 3


def test_shutdown_from_the_actor_thread_is_refused():
    errors = []
    holder = {}

    def on_step(execution):
        try:
            holder["engine"].shutdown()
        except RuntimeError as exc:
            errors.append(str(exc))

    e = engine(FakeFactory(on_step=on_step))
    holder["engine"] = e
    e.submit(req(tokens=1)).get(timeout=5)
    assert errors and "deadlock" in errors[0]
    holder.clear()
    e.shutdown()


# -- concurrency and configuration ---------------------------------------------------------------


def test_eight_threads_times_twenty_five_submits_all_complete():
    e = engine(FakeFactory(), max_batch_size=4)
    outputs, lock = [], threading.Lock()

    def worker():
        for _ in range(25):
            while True:
                try:
                    h = e.submit(req(tokens=2))
                    break
                except SubmitError:
                    time.sleep(0.001)
            out = h.get(timeout=10)
            with lock:
                outputs.append(out)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(outputs) == 200 and all(o.token_ids == (1, 2) for o in outputs)
    e.shutdown()
    m = e.metrics
    assert m.completed == m.submitted == 200 and m.failed == m.cancelled == 0


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"idle_wait": 0}, "idle_wait"),
        ({"max_pending_requests": 0}, "max_pending_requests"),
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"command_queue_capacity": -1}, "command_queue_capacity"),
    ],
)
def test_bad_configuration_is_rejected(config, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**config)


def test_construction_refusals():
    with pytest.raises(RuntimeError, match="stepped"):
        RequestEngine(FakeFactory(stepped=False), EngineConfig())
    with pytest.raises(RuntimeError, match="mid-flight"):
        RequestEngine(FakeFactory(seated_admission=False), EngineConfig(max_batch_size=2))
    with pytest.raises(RuntimeError, match="capacity"):
        RequestEngine(FakeFactory(max_batch_size=2), EngineConfig(max_batch_size=3))


def test_handle_request_keeps_its_blocking_contract():
    e = engine(FakeFactory(fail_steps=1, check_refuses=lambda r: r.past_trajectory))
    assert e.handle_request(req()) is None  # the step failed: None, no exception
    assert e.handle_request(req(tokens=2)).token_ids == (1, 2)
    assert e.handle_request(req(past_trajectory=[1])) is None  # refused: None, no exception
    e.shutdown()
    assert e.handle_request(req()) is None  # after shutdown


# -- several sequences per request --------------------------------------------------------------


def test_a_request_of_n_sequences_streams_each_and_ends_once():
    factory = FakeFactory(max_batch_size=4)
    e = engine(factory, max_batch_size=4)
    handle = e.submit(req(tokens=2, sp={"n": 3}))
    chunks = list(handle)
    by_index = {i: [t for c in chunks if c.index == i for t in c.token_ids] for i in range(3)}
    assert by_index == {0: [1, 2], 1: [1, 2, 3], 2: [1, 2, 3, 4]}
    ends = [c for c in chunks if c.finished]
    assert sorted(c.index for c in ends) == [0, 1, 2] and chunks[-1].finished
    output = handle.get()
    assert [s.index for s in output.outputs] == [0, 1, 2]
    assert [len(s.token_ids) for s in output.outputs] == [2, 3, 4]
    assert e.metrics.completed == 1 and factory.slots.num_free == 4
    e.shutdown()


def test_cancelling_a_request_of_n_sequences_ends_them_all():
    factory = FakeFactory(max_batch_size=4, step_delay=0.01)
    e = engine(factory, max_batch_size=4)
    handle = e.submit(req(tokens=1000, sp={"n": 2}))
    next(handle)
    handle.cancel()
    wait_until(handle.ready)
    with pytest.raises(RequestCancelled):
        handle.get()
    wait_until(lambda: factory.slots.num_free == 4)
    assert e.metrics.cancelled == 1
    e.shutdown()


def test_a_request_never_holds_part_of_its_slots():
    factory = FakeFactory(
        max_batch_size=3,
        step_delay=0.01,
        per_row_fields=frozenset({"params.max_tokens", "params.n"}),
    )
    e = engine(factory, max_batch_size=3)
    running = e.submit(req(tokens=30))
    wait_until(lambda: e.resident == 1)
    waiting = e.submit(req(tokens=2, sp={"n": 3}))  # needs all three slots
    assert waiting.get(timeout=10).outputs and running.get(timeout=10)
    assert e.metrics.stalls_no_capacity > 0 and e.metrics.admitted_mid_flight == 0
    e.shutdown()


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_the_heap_the_engine_starts_with_is_frozen_while_it_runs_and_thawed_after():
    # Full collections over the runtime's heap stall steps; it is frozen for the actor's life.
    import weakref

    cycle = _Cycle()
    alive = weakref.ref(cycle)
    e = engine(FakeFactory(step_delay=0.005))
    h = e.submit(req(tokens=10000))
    wait_until(lambda: gc.get_freeze_count() > 0)
    del cycle
    gc.collect()
    assert alive() is not None  # frozen: no collection looks at it
    e.shutdown(ShutdownMode.CANCEL)
    with pytest.raises(RequestCancelled):
        h.get(timeout=1)
    gc.collect()
    assert alive() is None  # thawed when the actor stopped: its garbage is collected


def test_queued_counts_every_accepted_request_without_a_seat():
    e = engine(FakeFactory(step_delay=0.005))
    handles = [e.submit(req(tokens=10000)) for _ in range(5)]
    wait_until(lambda: e.resident == 1)
    assert e.queued == 4  # in the actor's FIFO or still in the command queue
    e.shutdown(ShutdownMode.CANCEL)
    for h in handles:
        with pytest.raises(RequestCancelled):
            h.get(timeout=1)

"""RequestHandle as the caller's stream: sync and async iteration, merging, cancel on close."""

import asyncio
import threading

import pytest

from inflight.engine import EngineConfig, RequestCancelled, RequestEngine, StreamChannel
from inflight.engine.record import RequestHandle, RequestRecord, TerminalStatus
from inflight.protocol.outputs import CompletionOutput, RequestOutput, StreamChunk
from inflight.protocol.request import GenerationRequest

from fake_execution import FakeFactory
from test_request_engine import req, wait_until


def _handle():
    record = RequestRecord(1, GenerationRequest([1]), StreamChannel())
    return record, RequestHandle(record, lambda: None)


def _complete(record):
    sequence = CompletionOutput(0, "ab", (1, 2), "stop", None, None)
    record.publish(TerminalStatus.COMPLETED, RequestOutput((sequence,), 1), "")
    record.channel.push(StreamChunk(prompt_tokens=1, finished=True, finish_reason="stop"))
    record.channel.finish()


def test_chunks_that_piled_up_come_as_one():
    record, handle = _handle()
    record.channel.push(StreamChunk([1], "a", prompt_tokens=1))
    record.channel.push(StreamChunk([2], "b", prompt_tokens=1))
    _complete(record)
    (merged,) = list(handle)
    assert merged.token_ids == [1, 2] and merged.text == "ab"
    assert merged.finished and merged.finish_reason == "stop"
    assert handle.get().text == "ab"


def test_async_iteration_waits_on_the_loop_and_merges():
    record, handle = _handle()

    async def consume():
        got = []
        async for chunk in handle:
            got.append((chunk.token_ids, chunk.finished))
            if len(got) == 1:
                # The producer fills the channel while this consumer is not looking.
                for token in (2, 3):
                    record.channel.push(StreamChunk([token], str(token)))
                _complete(record)
        return got

    async def main():
        threads = threading.active_count()
        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.05)  # the consumer waits on the loop, not on a thread
        assert threading.active_count() == threads
        threading.Thread(target=record.channel.push, args=(StreamChunk([1], "1"),)).start()
        return await asyncio.wait_for(task, 5)

    assert asyncio.run(main()) == [([1], False), ([2, 3], True)]


def test_a_cancelled_stream_raises_where_it_ends():
    engine = RequestEngine(FakeFactory(step_delay=0.01), EngineConfig(idle_wait=0.01))
    handle = engine.submit(req(tokens=1000))
    assert next(handle).token_ids
    handle.cancel()
    with pytest.raises(RequestCancelled):
        for _ in handle:
            pass
    engine.shutdown()


def test_close_cancels_a_running_request_but_not_an_ended_one():
    engine = RequestEngine(FakeFactory(step_delay=0.01), EngineConfig(idle_wait=0.01))
    running = engine.submit(req(tokens=1000))
    next(running)
    running.close()
    wait_until(running.ready)
    with pytest.raises(RequestCancelled):
        running.get()
    done = engine.submit(req(tokens=2))
    assert list(done)[-1].finished
    done.close()
    assert done.get().token_ids == (1, 2)
    engine.shutdown()
    assert engine.metrics.cancelled == 1 and engine.metrics.completed == 1


def test_a_stream_dropped_mid_iteration_is_cancelled():
    engine = RequestEngine(FakeFactory(step_delay=0.01), EngineConfig(idle_wait=0.01))
    handle = engine.submit(req(tokens=1000))
    channel = handle.stream()
    next(handle)
    del handle
    assert channel.is_cancelled
    wait_until(lambda: engine.metrics.cancelled == 1)
    untouched = engine.submit(req(tokens=3))  # dropped before iterating: it runs to its end
    channel = untouched.stream()
    del untouched
    wait_until(lambda: channel.is_finished)
    engine.shutdown()
    assert engine.metrics.completed == 1 and engine.metrics.cancelled == 1


def test_the_channel_wakes_its_waker_on_every_change():
    channel, calls = StreamChannel(), []
    channel.set_waker(lambda: calls.append(1))
    channel.push(StreamChunk([1]))
    channel.finish()
    channel.cancel()
    assert len(calls) == 3
    channel.set_waker(None)
    channel.push(StreamChunk([2]))
    assert len(calls) == 3 and [c.token_ids for c in channel.pop_all()] == [[1], [2]]

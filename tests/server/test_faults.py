"""Faults through the real server, driven by the `openai` client.

A fault inside a step (the forward pass, the sampler, the detokenizer) fails the requests of that
step, and the server serves on with nothing leaked. An error the engine cannot contain (outside
the step) stops it: every request it held fails, `/health` and `/health/ready` answer 503, and
the server stops with exit status 1 instead of answering errors on.
"""

import httpx
import openai
import pytest

from inflight import LLM
from inflight.runtime.device.executor import Executor
from inflight.runtime.device.sampler import Sampler
from inflight.runtime.host.detokenizer import IncrementalDetokenizer
from inflight.runtime.host.session import GenerationSession
from inflight.server import serving

from helpers import assert_no_leaks
from server_harness import running, serve


@pytest.fixture
def llm(tiny_dirs):
    llm = LLM(
        str(tiny_dirs["llama"]), enable_in_flight_batching=True, max_batch_size=4, max_model_len=256
    )
    yield llm
    llm.close()


def _once(target, name, monkeypatch, after=2):
    """Make `target.name` raise on its call after the first `after` only; returns a list that
    holds the calls made."""
    original = getattr(target, name)
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == after + 1:
            raise RuntimeError(f"injected fault in {name}")
        return original(*args, **kwargs)

    monkeypatch.setattr(target, name, failing)
    return calls


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


def _stream(client, max_tokens):
    """A streamed completion that runs `max_tokens` tokens unless something stops it."""
    return client.completions.create(
        model="test-model",
        prompt="one two three",
        max_tokens=max_tokens,
        stream=True,
        extra_body={"ignore_eos": True},
    )


@pytest.mark.parametrize("where", ["forward", "sampler", "detokenizer"])
def test_a_fault_in_a_step_fails_its_requests_and_the_server_serves_on(llm, monkeypatch, where):
    # Patched on the classes: the LLM's runtime is the only one that steps in this test.
    target = {
        "forward": (Executor, "launch"),
        "sampler": (Sampler, "sample"),
        "detokenizer": (IncrementalDetokenizer, "add"),
    }[where]
    calls = _once(*target, monkeypatch)  # the third call raises: the stream has begun
    with serve(llm) as (url, _):
        client = _client(url)
        stream = _stream(client, 60)
        chunks = 0
        with pytest.raises(openai.APIError, match="generation failed.*injected fault in"):
            for _ in stream:
                chunks += 1
        assert chunks >= 1 and len(calls) >= 3
        reply = client.completions.create(
            model="test-model", prompt="four five", max_tokens=5, extra_body={"ignore_eos": True}
        )
        assert reply.usage.completion_tokens == 5
        assert httpx.get(url + "/health/ready").status_code == 200
        metrics = llm.get_scheduling_metrics()
        assert (metrics["failed"], metrics["completed"]) == (1, 1)
    assert_no_leaks(llm)


def test_an_engine_that_stops_on_an_error_fails_health_and_stops_the_server(llm, monkeypatch):
    # The failed server answers for 5 s here before it exits, so that its 503s can be looked at.
    monkeypatch.setattr(serving, "_FAULT_LINGER", 5.0)
    _once(GenerationSession, "residents", monkeypatch)  # outside the step: the engine stops
    with running(llm) as handle:
        client = _client(handle.url)
        stream = _stream(client, 200)
        with pytest.raises(openai.APIError, match="internal error"):
            for _ in stream:
                pass
        for path in ("/health", "/health/ready"):
            response = httpx.get(handle.url + path)
            assert response.status_code == 503
            assert response.json()["status"] == "failed"
            assert "injected fault in residents" in response.json()["error"]
        with pytest.raises(openai.APIStatusError, match="internal error") as refused:
            client.completions.create(model="test-model", prompt="four", max_tokens=2)
        assert refused.value.status_code == 503
        assert refused.value.response.headers["retry-after"]
        handle.thread.join(timeout=30)
        assert handle.exit_status == [1]
    metrics = llm.get_scheduling_metrics()
    assert (metrics["submitted"], metrics["failed"], metrics["cancelled"]) == (1, 1, 0)

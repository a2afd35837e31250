"""The server on the blocking path: one generation slot and a bounded wait queue."""

import json
import threading
import time

import httpx
import pytest

from inflight import LLM

from server_harness import serve

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def blocking_llm(tiny_dirs):
    llm = LLM(tiny_dirs["llama"], max_model_len=512)
    yield llm
    llm.close()


def _long(url, results, max_tokens=400):
    body = {"messages": MESSAGES, "max_tokens": max_tokens, "ignore_eos": True}
    results.append(httpx.post(url + "/v1/chat/completions", json=body, timeout=120).status_code)


def test_one_slot_a_bounded_queue_then_429(blocking_llm):
    with serve(blocking_llm, max_queued_requests=1, queue_timeout=60) as (url, client):
        health = httpx.get(url + "/health").json()
        assert health["scheduling"] is None
        assert health["capabilities"]["in_flight_batching"] is False
        assert health["capabilities"]["max_num_seqs"] == 1
        results = []
        threads = [threading.Thread(target=_long, args=(url, results)) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while not (client.gate.active == 1 and client.gate.waiting == 1):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        r = httpx.post(url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        for t in threads:
            t.join(timeout=120)
        assert results == [200, 200]


def test_queue_timeout_is_a_429(blocking_llm):
    with serve(blocking_llm, max_queued_requests=2, queue_timeout=0.2) as (url, client):
        results = []
        first = threading.Thread(target=_long, args=(url, results, 450))
        first.start()
        deadline = time.monotonic() + 10
        while client.gate.active == 0:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        r = httpx.post(url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
        assert r.status_code == 429 and "timed out" in r.json()["error"]["message"]
        first.join(timeout=120)
        assert results == [200]


def test_shutdown_drains_accepted_requests(tiny_dirs):
    llm = LLM(
        tiny_dirs["qwen2"], max_model_len=512, enable_in_flight_batching=True, max_batch_size=2
    )
    results = []
    with serve(llm, lifespan="on") as (url, client):
        threads = [threading.Thread(target=_long, args=(url, results, 200)) for _ in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while client.gate.active < 3:
            assert time.monotonic() < deadline
            time.sleep(0.005)
    # Leaving the block stopped the server: every accepted request still completed.
    for t in threads:
        t.join(timeout=120)
    assert results == [200, 200, 200]
    assert llm.get_scheduling_metrics()["completed"] == 3
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate("x")


def test_context_cache_in_health_metrics_and_usage(tiny_dirs):
    from prometheus_client.parser import text_string_to_metric_families

    llm = LLM(
        tiny_dirs["qwen3"],
        max_model_len=512,
        enable_in_flight_batching=True,
        max_batch_size=2,
        enable_context_reuse=True,
        block_size=8,
    )
    with serve(llm) as (url, _):
        body = {"prompt": list(range(10, 90)), "max_tokens": 2, "ignore_eos": True}
        httpx.post(url + "/v1/completions", json=body).raise_for_status()
        second = httpx.post(url + "/v1/completions", json=body).json()
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 72
        health = httpx.get(url + "/health").json()
        assert health["capabilities"]["context_reuse"] is True
        assert health["context_cache"]["hit_tokens"] == 72
        families = {
            f.name for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)
        }
        assert {"inflight_context_cache_hit_tokens", "inflight_context_cache_hit_ratio"} <= families
        # Streamed, the usage chunk counts the hits as the whole reply does.
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + "/v1/completions", json=streamed) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
        assert json.loads(events[-1])["usage"]["prompt_tokens_details"]["cached_tokens"] == 72
        chat = {
            "messages": [{"role": "user", "content": "hello " * 40}],
            "max_tokens": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for _ in range(2):
            with httpx.stream("POST", url + "/v1/chat/completions", json=chat) as r:
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
        assert json.loads(events[-1])["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    llm.close()

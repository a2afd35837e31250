"""The OpenAI API over a real uvicorn server, driven by the official `openai` client."""

import json
import re
import threading
import time

import httpx
import openai
import pytest
import websockets.sync.client
from prometheus_client.parser import text_string_to_metric_families

from inflight import SamplingParams

from server_harness import held_streams, serve

pytestmark = pytest.mark.slow

MODEL = "test-model"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(server_llm):
    with serve(server_llm, max_queued_requests=4) as (url, client):
        yield url, client


@pytest.fixture
def oa(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def _idle(llm, timeout=10):
    deadline = time.monotonic() + timeout
    while llm.get_scheduling_metrics()["resident"] or llm.get_scheduling_metrics()["queued"]:
        assert time.monotonic() < deadline, "engine did not go idle"
        time.sleep(0.02)


def test_greedy_chat_equals_python_api(oa, server_llm):
    expected = server_llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=24))[0]
    raw = oa.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24
    )
    # `refusal` sent as null, as OpenAI and vLLM send it (openai-node's type requires it).
    assert raw.http_response.json()["choices"][0]["message"]["refusal"] is None
    # `system_fingerprint` sent as null, as vLLM sends it (Cerebras's SDK requires the key).
    assert "system_fingerprint" in raw.http_response.json()
    assert raw.http_response.json()["system_fingerprint"] is None
    reply = raw.parse()
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].finish_reason == expected.finish_reason
    assert reply.usage.prompt_tokens == expected.prompt_tokens
    assert reply.usage.completion_tokens == len(expected.token_ids)
    stream = oa.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_sse_sequence_is_role_content_finish_usage_done(server):
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "temperature": 0,
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", server[0] + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = chunks[1:-2]
    assert content and all("content" in c["choices"][0]["delta"] for c in content)
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
    assert len({c["id"] for c in chunks}) == 1


def test_logprobs_agree_with_python_api(oa, server_llm):
    expected = server_llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=8, logprobs=3))[0]
    reply = oa.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert [c.token for c in content] == [e.token for e in expected.logprobs]
    for got, want in zip(content, expected.logprobs, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert [t.token for t in got.top_logprobs] == [t.token for t in want.top]
        assert got.bytes == list(want.bytes)


def test_chat_logprobs_carry_a_null_refusal_whole_and_streamed(handle):
    # OpenAI sends the key; clients whose types come from its spec (Effect's) require it.
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "logprobs": True}
    url = handle.url + "/v1/chat/completions"
    whole = httpx.post(url, json=body, timeout=60).json()["choices"][0]["logprobs"]
    assert whole["refusal"] is None and len(whole["content"]) >= 1
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
    streamed = [c["choices"][0]["logprobs"] for c in map(json.loads, lines) if c["choices"]]
    scored = [lp for lp in streamed if lp is not None]
    assert scored and all(lp["refusal"] is None and lp["content"] for lp in scored)


_ROWS = ("tokens", "token_logprobs", "top_logprobs")


def test_completions_score_prompts_like_an_eval_harness(oa, server_llm):
    prompt = "The quick brown fox jumps over the lazy dog"
    reply = oa.completions.create(
        model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    choice = reply.choices[0]
    assert choice.text == prompt
    ids = server_llm.tokenizer.encode(prompt)
    scored = server_llm.generate(
        {"prompt_token_ids": ids}, SamplingParams(max_tokens=0, prompt_logprobs=1)
    )[0]
    assert choice.logprobs.token_logprobs[0] is None
    want = [e.logprob for e in scored.prompt_logprobs[1:]]
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-5)
    assert len(choice.logprobs.tokens) == len(ids)
    # Each entry of top_logprobs holds its token beside the likeliest (up to logprobs + 1), as
    # OpenAI's and vLLM's do: a client may look the scored token up there.
    for token, logprob, top in zip(*(getattr(choice.logprobs, f) for f in _ROWS), strict=True):
        if logprob is None:
            assert top is None
            continue
        assert top[token] == logprob and 1 <= len(top) <= 2
    sampled = oa.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, logprobs=0, temperature=1.5, seed=3
    ).choices[0]
    for token, logprob, top in zip(*(getattr(sampled.logprobs, f) for f in _ROWS), strict=True):
        assert top == {token: logprob}
    # Streamed, the same rows: the echo carries the prompt's scores (they come with the
    # prompt's output), and the text offsets run on over the chunks, as vLLM's do.
    # Every chunk of a choice carries a logprobs object, its finish chunk's empty (LMQL reads
    # each chunk's `tokens`).
    scoring = dict(model=MODEL, prompt=prompt, logprobs=1, temperature=0)
    for echo, max_tokens in ((True, 0), (True, 3), (False, 5)):
        asked = dict(scoring, echo=echo, max_tokens=max_tokens)
        whole = oa.completions.create(**asked).choices[0].logprobs
        streamed: dict[str, list] = {f: [] for f in (*_ROWS, "text_offset")}
        finishes = 0
        for chunk in oa.completions.create(**asked, stream=True):
            for c in chunk.choices:
                assert c.logprobs is not None
                finishes += c.finish_reason is not None
                for f in streamed:
                    streamed[f] += getattr(c.logprobs, f)
        assert finishes == 1
        assert streamed["tokens"] == whole.tokens
        assert streamed["text_offset"] == whole.text_offset
        assert streamed["token_logprobs"] == pytest.approx(whole.token_logprobs, abs=1e-5)
        assert [t and set(t) for t in streamed["top_logprobs"]] == [
            t and set(t) for t in whole.top_logprobs
        ]
    # Token-id prompts and several prompts in one request.
    many = oa.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=3, temperature=0)
    assert sorted(c.index for c in many.choices) == [0, 1]
    assert many.usage.prompt_tokens == len(ids) + 3


def test_models_lists_the_served_model(oa, server_llm):
    models = oa.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_the_model_answers_to_each_of_its_served_names(server_llm):
    """vLLM's `--served-model-name a b`: a request may name either, replies carry the first, the
    list shows both, and any other name is a 404 naming them."""
    with serve(server_llm, name="smol", aliases=("gpt-4.1",)) as (url, _):
        oa = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        assert [m.id for m in oa.models.list().data] == ["smol", "gpt-4.1"]
        assert oa.models.retrieve("gpt-4.1").id == "gpt-4.1"
        reply = oa.chat.completions.create(model="gpt-4.1", messages=MESSAGES, max_tokens=2)
        assert reply.model == "smol" and reply.choices[0].message.content
        with pytest.raises(openai.NotFoundError, match="served: 'smol', 'gpt-4.1'") as info:
            oa.completions.create(model="gpt-5", prompt="Hi", max_tokens=2)
        assert info.value.code == "model_not_found"  # OpenAI's code for it


def test_client_disconnect_cancels_inside_the_engine(server, server_llm):
    _idle(server_llm)
    url = server[0]
    cancelled = server_llm.get_scheduling_metrics()["cancelled"]
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
    # The connection is closed: the request must leave its seat within 2 s.
    deadline = time.monotonic() + 2
    while httpx.get(url + "/health").json()["scheduling"]["cancelled"] == cancelled:
        assert time.monotonic() < deadline, "disconnect did not cancel within 2 s"
        time.sleep(0.05)
    _idle(server_llm)
    assert server_llm.kv_cache_usage()[0] == 0


def test_non_streaming_disconnect_cancels_too(server, server_llm):
    _idle(server_llm)
    url = server[0]
    cancelled = server_llm.get_scheduling_metrics()["cancelled"]
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/chat/completions", json=body, timeout=1.0)
    deadline = time.monotonic() + 3
    while server_llm.get_scheduling_metrics()["cancelled"] == cancelled:
        assert time.monotonic() < deadline, "disconnect did not cancel"
        time.sleep(0.05)
    _idle(server_llm)
    assert server_llm.kv_cache_usage()[0] == 0


def test_429_with_retry_after_when_leases_run_out(server_llm):
    _idle(server_llm)
    with serve(server_llm, max_queued_requests=0) as (url, _):
        body = {
            "model": MODEL,
            "messages": MESSAGES,
            "max_tokens": 150,
            "stream": True,
            "ignore_eos": True,
        }
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        # batch 4 + queue 0 = four leases.
        with (
            held_streams(url, "/v1/chat/completions", body, 4) as opened,
            pytest.raises(openai.RateLimitError) as info,
        ):
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        assert opened == [200] * 4
        assert info.value.response.headers["retry-after"] == "1"
        assert info.value.body["type"] == "server_overloaded"
        # The held streams' leases come back once their cancels land; a client that honours
        # Retry-After is then served.
        _idle(server_llm)
        ok = client.with_options(max_retries=2).chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2
        )
        assert ok.choices[0].message.content is not None
    _idle(server_llm)


def test_health_counts_mid_flight_joins_and_metrics_parse(server, server_llm):
    url = server[0]
    before = httpx.get(url + "/health").json()
    assert before["capabilities"]["in_flight_batching"] is True
    assert before["capabilities"]["max_num_seqs"] == 4
    oa = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    # A founder that cannot finish before the others arrive (no timing assumptions): its first
    # token means it is generating, and the joiners are sent while it still runs.
    founder = oa.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=256,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(founder)
    while not next(chunks).choices[0].delta.content:
        pass
    threads = [
        threading.Thread(
            target=oa.chat.completions.create,
            kwargs=dict(model=MODEL, messages=MESSAGES, max_tokens=10 + 5 * i, temperature=0),
        )
        for i in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason == "length") == 1
    after = httpx.get(url + "/health").json()["scheduling"]
    assert after["completed"] - before["scheduling"]["completed"] == 4
    assert after["admitted_mid_flight"] > before["scheduling"]["admitted_mid_flight"]
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
    for name in (
        "inflight_requests",
        "inflight_time_to_first_token_seconds",
        "inflight_inter_token_latency_seconds",
        "inflight_request_queue_seconds",
        "inflight_kv_blocks_used",
        "inflight_engine_admitted_mid_flight",
    ):
        assert name in families, name
    completed = [
        s.value
        for s in families["inflight_requests"].samples
        if s.name == "inflight_requests_total" and s.labels == {"outcome": "completed"}
    ]
    assert completed and completed[0] >= 4


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"messages": MESSAGES, "foo": 1}, 400, "foo"),
        ({"messages": []}, 400, "messages"),
        ({"messages": MESSAGES, "n": 9}, 400, "n"),
        ({"messages": MESSAGES, "temperature": 3}, 400, "temperature"),
        ({"messages": MESSAGES, "top_p": 0}, 400, "top_p"),
        ({"messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens"),
        ({"messages": MESSAGES, "presence_penalty": 2.5}, 400, "presence_penalty"),
        ({"messages": MESSAGES, "frequency_penalty": -3}, 400, "frequency_penalty"),
        ({"messages": MESSAGES, "repetition_penalty": 0}, 400, "repetition_penalty"),
        (
            {
                "messages": MESSAGES,
                "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}},
            },
            400,
            "response_format",
        ),
        ({"messages": MESSAGES, "structured_outputs": {"regex": "["}}, 400, "structured_outputs"),
        ({"messages": MESSAGES, "structured_outputs": {"yaml": "x"}}, 400, "structured_outputs"),
        ({"messages": MESSAGES, "model": "gpt-4"}, 404, "model"),
        ({"messages": MESSAGES, "priority": 1}, 400, "priority"),  # under fcfs
        # A malformed part of a type read here: its field, not "type 'text' is not supported".
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            400,
            "messages.0.content.0.text",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": "x", "detail": "max"}}
                        ],
                    }
                ]
            },
            400,
            "messages.0.content.0.image_url.detail",
        ),
        # Bounds on what one request may ask for, each named.
        ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        ({"messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),
        ({"messages": MESSAGES, "stop": ["s"] * 33}, 400, "stop"),
        ({"messages": MESSAGES, "stop": "x" * 513}, 400, "stop"),
        ({"messages": MESSAGES, "stop_token_ids": list(range(257))}, 400, "stop_token_ids"),
        ({"messages": MESSAGES, "logit_bias": {str(i): 1 for i in range(1025)}}, 400, "logit_bias"),
    ],
)
def test_errors_use_the_openai_body(server, body, status, param):
    r = httpx.post(server[0] + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    # The status, as vLLM's, but where OpenAI names a code that clients act on.
    assert error["code"] == ("model_not_found" if status == 404 else status) and error["message"]
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param)


def test_a_context_overflow_is_worded_as_openais_and_vllms(server):
    """A 400 with OpenAI's code `context_length_exceeded` (the SDK's BadRequestError,
    LangChain's context-overflow error; the seed's server answered a long prompt with 413,
    which the SDK raises as a bare APIStatusError), its `param` the field the client sent, and
    OpenAI's and vLLM's words: litellm and any-llm match the opening, Crush's library the
    numbers after "resulted in" or "requested"."""
    long = [{"role": "user", "content": "word " * 600}]
    opening = "This model's maximum context length is 512 tokens (max_model_len). However, "
    for route, body, param, words in (
        ("chat/completions", {"messages": long}, "messages", r"your prompt resulted in \d+ "),
        ("completions", {"prompt": "word " * 600}, "prompt", r"your prompt resulted in \d+ "),
        (
            "chat/completions",
            {"messages": MESSAGES, "max_tokens": 600},
            "max_tokens",
            r"you requested 6\d\d tokens \(\d+ in the prompt, 600 in the completion\)",
        ),
        (
            "chat/completions",
            {"messages": MESSAGES, "max_completion_tokens": 600},
            "max_completion_tokens",
            "you requested",
        ),
        ("completions", {"prompt": "Hi", "max_tokens": 600}, "max_tokens", "you requested"),
        ("chat/completions", {"messages": MESSAGES, "max_tokens": 10**9}, "max_tokens", "1000"),
    ):
        r = httpx.post(f"{server[0]}/v1/{route}", json=body, timeout=30)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["message"].startswith(opening) and re.search(words, error["message"])
        assert (error["type"], error["param"], error["code"]) == (
            "invalid_request_error", param, "context_length_exceeded",
        )  # fmt: skip
    client = openai.OpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=long, max_tokens=4)
    assert info.value.code == "context_length_exceeded"
    assert "where at most 511 leave room for a token of output" in info.value.message


def test_max_completion_tokens_wins_over_max_tokens_and_names_it(oa):
    """vLLM's reading of both fields: the current one counts, the deprecated one is named back
    in the ignored-fields header."""
    raw = oa.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, max_completion_tokens=3, temperature=0
    )
    assert raw.headers["x-inflight-ignored-fields"] == "max_tokens"
    assert raw.parse().usage.completion_tokens <= 3


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stop": 5}, "stop"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        # The member the value has (a named choice) names what it lacks.
        ({"tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name"),
        ({"guided_json": 7}, "guided_json"),
    ],
)
def test_a_field_of_several_types_is_named_without_pydantics_member_names(server, extra, param):
    """pydantic names the member of a union a value failed (`stop.constrained-str`): the error
    names the field as OpenAI does."""
    r = httpx.post(
        server[0] + "/v1/chat/completions", json={"messages": MESSAGES, **extra}, timeout=30
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param + ": ")


def test_an_endpoint_the_server_lacks_is_named_in_the_api_body(server, oa):
    with pytest.raises(openai.NotFoundError, match="POST /v1/embeddings"):
        oa.embeddings.create(model=MODEL, input="a")
    r = httpx.get(server[0] + "/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "GET /v1/chat/completions" in error["message"]
    r = httpx.post(server[0] + "/v1/messages/nothing", json={})
    assert r.status_code == 404
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"


@pytest.mark.parametrize(
    "path", ["/metrics", "/health", "/health/ready", "/v1/models", f"/v1/models/{MODEL}"]
)
def test_head_answers_where_get_does_with_its_headers_and_no_body(server, path):
    got = httpx.get(server[0] + path)
    head = httpx.head(server[0] + path)
    assert head.status_code == got.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == got.headers["content-type"]


def test_oversized_body_is_413(server_llm):
    with serve(server_llm, max_body_bytes=1000) as (url, _):
        r = httpx.post(
            url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x" * 2000}]},
        )
        assert r.status_code == 413 and r.json()["error"]["code"] == 413


def test_api_key(server_llm):
    with serve(server_llm, api_key="sekret") as (url, _):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "nope"}):
            r = httpx.get(url + "/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert r.headers["x-request-id"].startswith("req_")
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer sekret"}).is_success
        assert httpx.get(url + "/v1/models", headers={"x-api-key": "sekret"}).is_success
        # Every route but the health probes needs the key (metrics and the API docs too).
        for path in ("/metrics", "/openapi.json", "/docs", "/v1/no-such-route"):
            assert httpx.get(url + path).status_code == 401, path
        assert httpx.get(url + "/metrics", headers={"x-api-key": "sekret"}).is_success
        assert httpx.get(url + "/health").is_success  # open for load balancers
        assert httpx.get(url + "/health/ready").is_success
        r = httpx.post(url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1})
        assert r.status_code == 401
        client = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
        assert client.models.list().data[0].id == MODEL
        # The Responses API's WebSocket too: refused at the handshake without the key.
        socket_url = url.replace("http", "ws") + "/v1/responses"
        with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
            websockets.sync.client.connect(socket_url)
        assert refused.value.response.status_code == 403
        with websockets.sync.client.connect(
            socket_url, additional_headers={"Authorization": "Bearer sekret"}
        ) as socket:
            socket.send(
                json.dumps({"type": "response.create", "input": "Hi", "max_output_tokens": 1})
            )
            assert json.loads(socket.recv())["type"] == "response.created"


def test_every_response_names_its_request_and_echoes_the_clients_id(server, oa):
    reply = oa.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    first = reply._request_id
    assert first and first.startswith("req_")
    assert oa.models.list()._request_id not in (None, first)
    with pytest.raises(openai.NotFoundError) as missing:
        oa.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=1)
    assert missing.value.request_id.startswith("req_")
    # The client's own id comes back, as vLLM's does; one no header may carry is replaced.
    r = httpx.get(server[0] + "/v1/models", headers={"X-Request-Id": "trace-42"})
    assert r.headers["x-request-id"] == "trace-42" and "request-id" not in r.headers
    r = httpx.get(server[0] + "/v1/models", headers={"X-Request-Id": "x" * 500})
    assert r.headers["x-request-id"].startswith("req_")


def test_streams_are_read_on_the_event_loop(server_llm):
    """No thread per stream: the engine's channel wakes the server's event loop."""
    body = {"prompt": "Tell me a story.", "max_tokens": 100, "ignore_eos": True, "stream": True}
    with serve(server_llm) as (url, _):
        before = threading.active_count()
        with held_streams(url, "/v1/completions", body, 3):
            time.sleep(0.3)
            # Only the three client threads of `held_streams` are new.
            assert threading.active_count() == before + 3


def test_a_bad_response_format_and_n_are_refused_naming_the_field(server):
    url, _ = server
    for body, param in (
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_object", "strict": True}}, "response_format.strict"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}},
            "response_format.json_schema.x",
        ),
        ({"response_format": {"type": "regex", "value": 3}}, "response_format.value"),
        ({"n": 5}, "n"),
    ):
        r = httpx.post(url + "/v1/chat/completions", json={"messages": MESSAGES, **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
    assert "n (5) exceeds max_batch_size (4)" in r.json()["error"]["message"]


def test_penalties_apply_as_in_the_python_api(oa, server_llm):
    """OpenAI's presence and frequency penalties, and vLLM's repetition_penalty (extra body)."""
    penalties = dict(presence_penalty=0.5, frequency_penalty=0.8, repetition_penalty=1.3)
    expected = server_llm.chat(
        MESSAGES, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **penalties)
    )[0]
    plain = server_llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert expected.token_ids != plain[0].token_ids
    reply = oa.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        max_tokens=24,
        presence_penalty=0.5,
        frequency_penalty=0.8,
        extra_body={"repetition_penalty": 1.3, "ignore_eos": True},
    )
    assert reply.choices[0].message.content == expected.text


def test_min_tokens_and_a_kept_stop_string_apply_as_in_the_python_api(oa, server_llm):
    """vLLM's min_tokens and include_stop_str_in_output (extra body), chat and completions."""
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    free = server_llm.chat(chat, SamplingParams(temperature=0, max_tokens=200))[0]
    assert free.finish_reason == "stop"
    least = len(free.token_ids) + 6
    params = SamplingParams(temperature=0, max_tokens=least + 40, min_tokens=least)
    expected = server_llm.chat(chat, params)[0]
    assert len(expected.token_ids) > least
    reply = oa.chat.completions.create(
        model=MODEL,
        messages=chat,
        temperature=0,
        max_tokens=least + 40,
        extra_body={"min_tokens": least},
    )
    assert reply.choices[0].message.content == expected.text
    assert reply.usage.completion_tokens == len(expected.token_ids)
    prompt = "The three primary colors are"
    stop = server_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[
        0
    ].text.split()[2]
    kept = SamplingParams(
        temperature=0, max_tokens=12, stop=[stop], include_stop_str_in_output=True
    )
    expected = server_llm.generate(prompt, kept)[0]
    assert expected.text.endswith(stop)
    reply = oa.completions.create(
        model=MODEL,
        prompt=prompt,
        temperature=0,
        max_tokens=12,
        stop=[stop],
        extra_body={"include_stop_str_in_output": True},
    )
    assert reply.choices[0].text == expected.text and reply.choices[0].finish_reason == "stop"


def test_a_final_assistant_message_is_continued_as_in_the_python_api(oa, server_llm):
    """vLLM's continue_final_message with add_generation_prompt false (an assistant prefill)."""
    prefill = [*MESSAGES, {"role": "assistant", "content": "The capital of France"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    params = SamplingParams(temperature=0, max_tokens=12)
    expected = server_llm.chat(prefill, params, **options)[0]
    reply = oa.chat.completions.create(
        model=MODEL, messages=prefill, temperature=0, max_tokens=12, extra_body=options
    )
    assert reply.choices[0].message.content == expected.text
    assert reply.usage.prompt_tokens == expected.prompt_tokens
    opened = server_llm.chat(prefill, params)[0]  # a new reply after the closed message
    assert expected.prompt_tokens < opened.prompt_tokens


def test_token_ids_stop_reasons_and_usage_on_every_chunk(oa, server_llm):
    """vLLM's return_token_ids and stream_options.continuous_usage_stats, chat and
    completions, whole and streamed; stop_reason beside finish_reason."""
    params = SamplingParams(temperature=0, max_tokens=16)
    expected = server_llm.chat(MESSAGES, params)[0]
    prompt = list(server_llm.prepare(MESSAGES).prompt_token_ids)
    ids = {"return_token_ids": True}
    whole = oa.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=16, extra_body=ids
    )
    assert whole.prompt_token_ids == prompt
    assert whole.choices[0].token_ids == list(expected.token_ids)
    assert whole.choices[0].stop_reason == expected.stop_reason
    chunks = list(
        oa.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            temperature=0,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body=ids,
        )
    )
    assert chunks[0].prompt_token_ids == prompt
    streamed = [t for c in chunks if c.choices for t in getattr(c.choices[0], "token_ids", [])]
    assert streamed == list(expected.token_ids)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == len(expected.token_ids)
    assert all(c.usage.prompt_tokens == len(prompt) for c in chunks)
    # Completions: a stop string is the stop reason, whole and streamed.
    text = "The capital of France is"
    free = server_llm.generate(text, SamplingParams(temperature=0, max_tokens=12))[0]
    stop = free.text.split()[1]
    cut = server_llm.generate(text, SamplingParams(temperature=0, max_tokens=12, stop=[stop]))[0]
    reply = oa.completions.create(
        model=MODEL, prompt=text, temperature=0, max_tokens=12, stop=[stop], extra_body=ids
    )
    (choice,) = reply.choices
    assert choice.stop_reason == stop and choice.token_ids == list(cut.token_ids)
    assert choice.prompt_token_ids == list(server_llm.prepare(text).prompt_token_ids)
    chunks = list(
        oa.completions.create(
            model=MODEL,
            prompt=text,
            temperature=0,
            max_tokens=12,
            stop=[stop],
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body=ids,
        )
    )
    assert chunks[0].choices[0].prompt_token_ids == choice.prompt_token_ids
    streamed = [t for c in chunks if c.choices for t in getattr(c.choices[0], "token_ids", [])]
    assert streamed == list(cut.token_ids)
    last = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
    assert last.choices[0].stop_reason == stop and last.usage.completion_tokens == len(streamed)


def test_n_choices_whole_and_streamed(oa):
    params = dict(model=MODEL, messages=MESSAGES, max_tokens=12, n=3, temperature=1.0, seed=5)
    whole = oa.chat.completions.create(**params)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    texts = [c.message.content for c in whole.choices]
    assert len(set(texts)) > 1
    single = oa.chat.completions.create(**{**params, "n": 1})
    assert whole.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counted once
    assert whole.usage.completion_tokens > single.usage.completion_tokens
    streamed = {0: "", 1: "", 2: ""}
    finished = set()
    for chunk in oa.chat.completions.create(**params, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert [streamed[i] for i in range(3)] == texts and finished == {0, 1, 2}


def test_a_streamed_chat_opens_with_its_first_token_not_on_arrival(server, server_llm):
    """The role chunk goes out with the first output, as vLLM's does: clients that time the
    first chunk (Artificial Analysis's benchmark) take it for the first token. A request queued
    behind a full batch gets nothing until it runs."""
    url, _ = server
    _idle(server_llm)
    # Four replies that outlast the wait below (the context is 512 tokens).
    hold = {"model": MODEL, "messages": MESSAGES, "max_tokens": 400, "ignore_eos": True}
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "stream": True}
    arrivals: list[tuple[float, dict]] = []

    def queued() -> None:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append((time.monotonic(), json.loads(line[6:])))

    thread = threading.Thread(target=queued)
    with held_streams(url, "/v1/chat/completions", {**hold, "stream": True}, 4) as opened:
        assert opened == [200] * 4  # the batch of 4 full
        thread.start()
        time.sleep(0.5)
        assert arrivals == []
        released = time.monotonic()
    thread.join(timeout=60)
    at, first = arrivals[0]
    assert at > released and first["choices"][0]["delta"]["role"] == "assistant"
    assert arrivals[-1][1]["choices"][0]["finish_reason"] == "length"
    _idle(server_llm)


def test_n_completions_of_several_prompts(oa):
    out = oa.completions.create(
        model=MODEL, prompt=["One, two,", "Red, green,"], max_tokens=6, n=2, temperature=0
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text  # greedy: both sequences alike
    assert out.choices[2].text == out.choices[3].text != out.choices[0].text
    streamed = {}
    for chunk in oa.completions.create(
        model=MODEL,
        prompt=["One, two,", "Red, green,"],
        max_tokens=6,
        n=2,
        temperature=0,
        stream=True,
    ):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(4)] == [c.text for c in out.choices]


def test_a_prompt_list_too_big_ever_is_a_400_naming_the_limit_and_one_within_it_runs(server_llm):
    # batch 4 + queue 4: eight sequences at once. Nine could never fit: retrying is no use.
    _idle(server_llm)
    with serve(server_llm, max_queued_requests=4) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt=["Hi"] * 9, max_tokens=2)
        assert info.value.body["param"] == "prompt"
        assert "9 sequences" in info.value.body["message"]
        assert "8 (a batch of 4 + max_queued_requests 4)" in info.value.body["message"]
        with pytest.raises(openai.BadRequestError):  # prompts x n
            client.completions.create(model=MODEL, prompt=["Hi"] * 3, n=3, max_tokens=2)
        # Eight on an idle server: four generate, four wait their turn in the engine.
        whole = client.completions.create(model=MODEL, prompt=["Hi"] * 8, max_tokens=2)
        assert sorted(c.index for c in whole.choices) == list(range(8))
        assert all(c.finish_reason == "length" for c in whole.choices)
    _idle(server_llm)


def test_a_prompt_list_that_fits_but_not_now_is_a_429_and_none_of_it_runs(server_llm):
    _idle(server_llm)
    with serve(server_llm, max_queued_requests=2) as (url, _):
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 150, "stream": True}
        body["ignore_eos"] = True
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        submitted = server_llm.get_scheduling_metrics()["submitted"]
        # Three of six leases held: a list of four fits the pool, not the room left.
        with (
            held_streams(url, "/v1/chat/completions", body, 3) as opened,
            pytest.raises(openai.RateLimitError) as info,
        ):
            client.completions.create(model=MODEL, prompt=["Hi"] * 4, max_tokens=2)
        assert opened == [200] * 3
        assert info.value.response.headers["retry-after"] == "1"
        assert server_llm.get_scheduling_metrics()["submitted"] == submitted + 3
    _idle(server_llm)


def test_the_default_queue_takes_a_hundred_concurrent_streams(server_llm):
    # `inflight serve`'s default queue (the LLM's): requests wait their turn, none is refused.
    _idle(server_llm)
    with serve(server_llm) as (url, _):
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "stream": True}
        statuses: list[int] = []
        texts: list[str] = []

        def stream() -> None:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
                statuses.append(r.status_code)
                texts.append("".join(r.iter_lines()))

        threads = [threading.Thread(target=stream) for _ in range(100)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        assert statuses == [200] * 100
        assert all(text.endswith("data: [DONE]") for text in texts)
    _idle(server_llm)


def test_documented_fields_without_meaning_are_accepted_and_named_in_a_header(oa):
    reply = oa.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=2,
        store=False,
        metadata={"run": "7"},
        service_tier="auto",
        safety_identifier="user-1",
        prediction={"type": "content", "content": "Paris"},
        verbosity="low",
        prompt_cache_key="geography",  # served: the context cache keys prefixes by content
        user="someone",
    )
    assert reply.http_response.status_code == 200
    ignored = reply.http_response.headers["x-inflight-ignored-fields"]
    assert ignored.split(", ") == [
        "store",
        "metadata",
        "service_tier",
        "safety_identifier",
        "prediction",
        "verbosity",
        "user",
    ]
    assert reply.parse().choices[0].finish_reason == "length"
    plain = oa.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=1
    )
    assert "x-inflight-ignored-fields" not in plain.http_response.headers
    # This model's template has no thinking switch: the effort is accepted, and named.
    effort = oa.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=1, reasoning_effort="low"
    )
    assert effort.http_response.headers["x-inflight-ignored-fields"] == "reasoning_effort"
    # Open WebUI's chat controls for Ollama and llama.cpp, as it sends them (0.12.4, its
    # advanced params set): served, each named.
    controls = {
        "repeat_penalty": 1.1, "repeat_last_n": 64, "mirostat": 0, "mirostat_eta": 0.1,
        "mirostat_tau": 5.0, "tfs_z": 1, "num_ctx": 2048, "num_batch": 512, "num_keep": 24,
        "num_thread": 4, "num_gpu": 1, "num_predict": 40, "use_mmap": True, "use_mlock": False,
        "keep_alive": "5m", "format": "json", "think": False,
    }  # fmt: skip
    webui = oa.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=1, extra_body=controls
    )
    named = webui.http_response.headers["x-inflight-ignored-fields"].split(", ")
    assert sorted(named) == sorted(controls)  # `think` too: this template has no switch
    # A name in no API stays a 400, and so does a feature not served.
    with pytest.raises(openai.BadRequestError) as info:
        oa.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=1, extra_body={"stor": False}
        )
    assert "stor" in str(info.value)
    with pytest.raises(openai.BadRequestError) as info:
        oa.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=1, web_search_options={}
        )
    assert info.value.body["param"] == "web_search_options"
    # xAI's live search, which grok-cli sends to any server: off, it is named as ignored; on, it
    # is a feature not served.
    off = oa.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=1,
        extra_body={"search_parameters": {"mode": "off"}},
    )
    assert off.http_response.headers["x-inflight-ignored-fields"] == "search_parameters"
    for search in ({"mode": "auto"}, {}):
        with pytest.raises(openai.BadRequestError) as info:
            oa.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                max_tokens=1,
                extra_body={"search_parameters": search},
            )
        assert info.value.body["param"] == "search_parameters"
    # vLLM's own fields, which a client built for vLLM may send at their defaults: served as
    # without them (`request_id` named as ignored); any other value a 400 naming the field.
    defaults = {
        "use_beam_search": False,
        "length_penalty": 1.0,
        "bad_words": [],
        "spaces_between_special_tokens": True,
        "include_reasoning": True,
        "echo": False,
        "add_special_tokens": False,
        "request_id": "trace-7",
    }
    greedy = dict(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
    sent = oa.chat.completions.with_raw_response.create(**greedy, extra_body=defaults)
    assert sent.http_response.headers["x-inflight-ignored-fields"] == "request_id"
    plain = oa.chat.completions.create(**greedy)
    assert sent.parse().choices[0].message.content == plain.choices[0].message.content
    for field, value in (
        ("use_beam_search", True),
        ("include_reasoning", False),
        ("truncate_prompt_tokens", 8),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            oa.chat.completions.create(**greedy, extra_body={field: value})
        assert info.value.body["param"] == field
        assert info.value.body["message"].startswith(f"{field} is not supported (only ")
    with pytest.raises(openai.BadRequestError) as info:
        oa.completions.create(model=MODEL, prompt="Hi", extra_body={"allowed_token_ids": [1]})
    assert info.value.body["param"] == "allowed_token_ids"
    # Stream options without a stream, as OpenAI and vLLM refuse them.
    for create in (oa.chat.completions.create, oa.completions.create):
        with pytest.raises(openai.BadRequestError) as info:
            create(
                model=MODEL,
                max_tokens=1,
                stream_options={"include_usage": True},
                **(
                    {"messages": MESSAGES}
                    if create == oa.chat.completions.create
                    else {"prompt": "Hi"}
                ),
            )
        assert info.value.body["param"] == "stream_options"


WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def test_a_returned_message_sent_back_whole_and_a_clients_own_keys_are_read_as_without_them(
    oa, server_llm
):
    """OpenAI Swarm sends each reply back as the SDK returned it (`refusal`, `annotations`,
    ...) with its own `sender`, and `tool_name` on tool results, LiteLLM a part's
    `cache_control`: OpenAI ignores what it does not read; a refusal sent back without content
    is the assistant's text."""
    plain = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Say it again."},
    ]
    returned = {
        "refusal": None, "annotations": [], "audio": None, "function_call": None,
        "tool_calls": None, "sender": "Agent A",
    }  # fmt: skip
    # LiteLLM keeps Anthropic's cache_control on the parts it sends.
    part = {"type": "text", "text": plain[2]["content"], "cache_control": {"type": "ephemeral"}}
    sent = [plain[0], {**plain[1], **returned}, {"role": "user", "content": [part], "sender": None}]
    params = SamplingParams(temperature=0, max_tokens=12)
    expected = server_llm.chat(plain, params)[0].text
    reply = oa.chat.completions.create(model=MODEL, messages=sent, temperature=0, max_tokens=12)
    assert reply.choices[0].message.content == expected
    refused = "I can't help with that."
    with_refusal = [plain[0], {"role": "assistant", "content": None, "refusal": refused}, plain[2]]
    expected = server_llm.chat(
        [plain[0], {"role": "assistant", "content": refused}, plain[2]], params
    )[0].text
    reply = oa.chat.completions.create(
        model=MODEL, messages=with_refusal, temperature=0, max_tokens=12
    )
    assert reply.choices[0].message.content == expected


def test_legacy_functions_are_served_as_one_function_call(oa):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    request = dict(
        model=MODEL,
        messages=question,
        temperature=0,
        max_tokens=40,
        functions=[WEATHER],
        function_call={"name": "get_weather"},
    )
    reply = oa.chat.completions.create(**request)
    choice = reply.choices[0]
    assert choice.finish_reason == "function_call"
    assert choice.message.tool_calls is None
    call = choice.message.function_call
    assert call.name == "get_weather"
    assert set(json.loads(call.arguments)) == {"city"}
    streamed = oa.chat.completions.create(**request, stream=True)
    deltas = [c.choices[0] for c in streamed if c.choices]
    calls = [d.delta.function_call for d in deltas if d.delta.function_call]
    assert calls[0].name == "get_weather"
    assert "".join(c.arguments or "" for c in calls) == call.arguments
    assert deltas[-1].finish_reason == "function_call"
    # The legacy history: the assistant's function_call, then the function's result.
    answer = oa.chat.completions.create(
        model=MODEL,
        messages=[
            *question,
            {"role": "assistant", "content": None, "function_call": call.model_dump()},
            {"role": "function", "name": "get_weather", "content": "Sunny, 21 C"},
        ],
        temperature=0,
        max_tokens=8,
        functions=[WEATHER],
        function_call="none",
    )
    assert answer.choices[0].message.content and answer.choices[0].message.function_call is None
    with pytest.raises(openai.BadRequestError) as info:
        oa.chat.completions.create(
            model=MODEL,
            messages=question,
            max_tokens=1,
            functions=[WEATHER],
            tools=[{"type": "function", "function": WEATHER}],
        )
    assert info.value.body["param"] == "functions"


def test_speech_asked_of_a_text_model_is_a_400_naming_the_model(handle):
    response = httpx.post(
        handle.url + "/v1/audio/speech", json={"input": "hi", "voice": "alloy"}, timeout=30
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "model" and "text-to-speech" in error["message"]

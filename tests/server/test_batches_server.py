"""OpenAI's Files and Batch APIs and Anthropic's Message Batches API over a real server, driven
by the official clients: a batch's requests are answered by the server's own routes (the same
greedy text as the endpoint gives them directly), bad input is named by its line, a cancel
keeps what finished and stops the rest, and a shutdown never waits on a batch's queue."""

import asyncio
import json
import time

import anthropic
import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion
from openai.types.responses import Response

from inflight.server import batches as batches_module
from inflight.server.errors import ServerError
from inflight.server.files import FileStore
from inflight.server.routes.batches import _form

from server_harness import running

pytestmark = pytest.mark.slow

MODEL = "test-model"
QUESTIONS = ["Name a primary color.", "What is 2 + 2?", "Say hello."]
CHAT = "/v1/chat/completions"


def _chat(question, max_tokens=8, **extra):
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


def _jsonl(lines):
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)


def _line(custom_id, body, url=CHAT):
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def _batch(oa, lines, endpoint=CHAT):
    uploaded = oa.files.create(file=("input.jsonl", _jsonl(lines).encode()), purpose="batch")
    return oa.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")


def _settled(poll, done, timeout=60):
    deadline = time.monotonic() + timeout
    while True:
        got = poll()
        if done(got):
            return got
        assert time.monotonic() < deadline, f"still {got}"
        time.sleep(0.05)


def _ended(oa, batch_id):
    ended = ("completed", "failed", "expired", "cancelled")
    return _settled(lambda: oa.batches.retrieve(batch_id), lambda b: b.status in ended)


def _read(oa, file_id):
    return [json.loads(line) for line in oa.files.content(file_id).text.splitlines()]


def _idle(url):
    """Wait until the engine holds no request (a cancelled batch left nothing running)."""
    _settled(lambda: httpx.get(url + "/health").json()["scheduling"]["resident"], lambda n: n == 0)


def test_a_batch_is_answered_as_each_endpoint_answers_its_requests(oa):
    direct = [oa.chat.completions.create(**_chat(q)) for q in QUESTIONS]
    lines = [_line(f"q{i}", _chat(q)) for i, q in enumerate(QUESTIONS)]
    lines.append(_line("unknown-model", {**_chat("Hi"), "model": "gpt-none"}))
    lines.append(_line("streamed", _chat("Hi", stream=True)))
    created = _batch(oa, lines)
    assert created.status == "validating" and created.id.startswith("batch_")
    assert created.usage.total_tokens == 0  # OpenAI's usage, counted as requests are answered
    done = _ended(oa, created.id)
    assert done.status == "completed" and done.endpoint == CHAT and done.model == MODEL
    assert done.request_counts.model_dump() == {"total": 5, "completed": 3, "failed": 2}
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    assert done.expires_at == done.created_at + 24 * 3600
    output = _read(oa, done.output_file_id)
    assert [line["custom_id"] for line in output] == ["q0", "q1", "q2"]
    for line, expected in zip(output, direct, strict=True):
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert line["id"].startswith("batch_req_") and line["response"]["request_id"]
        reply = ChatCompletion.model_validate(line["response"]["body"])
        assert reply.choices[0].message.content == expected.choices[0].message.content
        # (Its prompt's blocks may now come from the context cache: compare the counts.)
        assert reply.usage.prompt_tokens == expected.usage.prompt_tokens
        assert reply.usage.completion_tokens == expected.usage.completion_tokens
    # The batch's usage: the tokens of its answered requests (as litellm and aibrix read it).
    used = [ChatCompletion.model_validate(line["response"]["body"]).usage for line in output]
    assert done.usage.input_tokens == sum(u.prompt_tokens for u in used)
    assert done.usage.output_tokens == sum(u.completion_tokens for u in used)
    assert done.usage.input_tokens_details.cached_tokens == sum(
        u.prompt_tokens_details.cached_tokens for u in used
    )
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens
    errors = {e["custom_id"]: e["response"] for e in _read(oa, done.error_file_id)}
    assert errors["unknown-model"]["status_code"] == 404  # the route's own answer
    assert errors["unknown-model"]["body"]["error"]["param"] == "model"
    assert errors["streamed"]["status_code"] == 400
    assert errors["streamed"]["body"]["error"]["param"] == "stream"
    output_file = oa.files.retrieve(done.output_file_id)
    assert output_file.purpose == "batch_output" and output_file.filename.endswith(".jsonl")


def test_completions_and_responses_batches_equal_their_endpoints(oa):
    prompt = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8}
    direct = oa.completions.create(**prompt, temperature=0)
    done = _ended(
        oa,
        _batch(
            oa, [_line("c", {**prompt, "temperature": 0}, "/v1/completions")], "/v1/completions"
        ).id,
    )
    [line] = _read(oa, done.output_file_id)
    assert Completion.model_validate(line["response"]["body"]).choices[0].text == (
        direct.choices[0].text
    )
    asked = {"model": MODEL, "input": QUESTIONS[0], "max_output_tokens": 16, "temperature": 0}
    direct = oa.responses.create(**asked)
    done = _ended(oa, _batch(oa, [_line("r", asked, "/v1/responses")], "/v1/responses").id)
    [line] = _read(oa, done.output_file_id)
    assert Response.model_validate(line["response"]["body"]).output_text == direct.output_text
    assert done.usage.output_tokens == direct.usage.output_tokens  # the Responses API's names
    assert done.usage.input_tokens == direct.usage.input_tokens


def test_bad_lines_fail_the_batch_naming_their_line_numbers(oa):
    good = _line("a", _chat("Hi"))
    lines = [
        good,
        "{not json",
        _line("a", _chat("Hi")),  # the custom_id of line 1
        _line("b", _chat("Hi"), url="/v1/completions"),
        {**_line("c", _chat("Hi")), "method": "GET"},
        {"custom_id": "d", "method": "POST", "url": CHAT},
    ]
    done = _ended(oa, _batch(oa, lines).id)
    assert done.status == "failed" and done.failed_at and done.output_file_id is None
    found = [(e.line, e.code, e.param) for e in done.errors.data]
    assert found == [
        (2, "invalid_json_line", None),
        (3, "duplicate_custom_id", "custom_id"),
        (4, "invalid_url", "url"),
        (5, "invalid_request", "method"),
        (6, "missing_required_parameter", "body"),
    ]
    assert "line 1" in done.errors.data[1].message  # where the id was first
    empty = _ended(oa, _batch(oa, []).id)
    assert empty.status == "failed" and empty.errors.data[0].code == "empty_file"


def test_requests_the_api_refuses_are_400s_and_404s_naming_what(oa):
    uploaded = oa.files.create(file=("in.jsonl", b"{}\n"), purpose="batch")
    with pytest.raises(openai.BadRequestError) as info:
        oa.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
        )
    assert info.value.body["param"] == "endpoint" and "/v1/chat/completions" in info.value.message
    with pytest.raises(openai.NotFoundError) as info:
        oa.batches.create(input_file_id="file-nope", endpoint=CHAT, completion_window="24h")
    assert info.value.body["param"] == "input_file_id" and "file-nope" in info.value.message
    data = oa.files.create(file=("notes.txt", b"notes"), purpose="user_data")
    with pytest.raises(openai.BadRequestError) as info:
        oa.batches.create(input_file_id=data.id, endpoint=CHAT, completion_window="24h")
    assert "purpose 'batch'" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        oa.files.create(file=("train.jsonl", b"{}\n"), purpose="fine-tune")
    assert info.value.body["param"] == "purpose" and "fine-tuning" in info.value.message
    for call, name in (
        (lambda: oa.batches.retrieve("batch_nope"), "batch_nope"),
        (lambda: oa.batches.cancel("batch_nope"), "batch_nope"),
        (lambda: oa.files.retrieve("file-gone"), "file-gone"),
        (lambda: oa.files.content("file-gone"), "file-gone"),
    ):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert name in info.value.message
    assert oa.files.delete(data.id).deleted
    with pytest.raises(openai.NotFoundError):
        oa.files.retrieve(data.id)


def test_files_are_kept_listed_and_bounded(oa, handle):
    content = b'{"x": 1}\r\n\xff binary kept as sent\n'
    made = [oa.files.create(file=(f"f{i}.jsonl", content), purpose="batch") for i in range(3)]
    first = made[0]
    assert first.id.startswith("file-") and first.object == "file" and first.bytes == len(content)
    assert first.purpose == "batch" and first.filename == "f0.jsonl"
    assert first.expires_at == first.created_at + 30 * 24 * 3600  # OpenAI's default for batch
    assert oa.files.content(first.id).content == content
    kept = oa.files.create(
        file=("k.txt", b"k"),
        purpose="user_data",
        expires_after={"anchor": "created_at", "seconds": 3600},
    )
    assert kept.expires_at == kept.created_at + 3600
    # Paged two at a time, newest first: the client follows `after` to the end.
    ids = [f.id for f in oa.files.list(purpose="batch", limit=2)]
    assert ids[:3] == [f.id for f in reversed(made)]
    page = oa.files.list(purpose="batch", limit=2, order="asc", after=made[0].id)
    assert [f.id for f in page.data][:2] == [made[1].id, made[2].id]
    store = handle.server.config.app.state.files
    capacity, store.capacity = store.capacity, store.used + 10
    try:
        with pytest.raises(openai.APIStatusError) as info:
            oa.files.create(file=("big.jsonl", b"x" * 11), purpose="batch")
        assert info.value.status_code == 413 and str(store.capacity) in info.value.message
    finally:
        store.capacity = capacity


def test_a_batch_file_past_the_body_limit_is_uploaded(oa):
    # A batch input file larger than the 8 MiB that bounds other bodies (OpenAI takes 200 MB),
    # sent as bespokelabs-curator sends it: bytes, which the SDK names "upload".
    line = json.dumps(_line("x", _chat("a" * 1000))).encode() + b"\n"
    content = line * (9 * 1024 * 1024 // len(line) + 1)
    uploaded = oa.files.create(file=content, purpose="batch")
    assert uploaded.bytes == len(content) and uploaded.filename == "upload"
    assert oa.files.content(uploaded.id).content == content
    oa.files.delete(uploaded.id)


def test_anthropics_files_api_is_refused_by_name(claude, oa):
    # Anthropic's Files API shares the paths (its SDKs' beta.files, litellm's Anthropic
    # files): answered with OpenAI's file objects, litellm failed reading one.
    kept = oa.files.create(file=("k.txt", b"k"), purpose="user_data")
    for call in (
        lambda: claude.beta.files.upload(file=("notes.txt", b"notes", "text/plain")),
        claude.beta.files.list,
        lambda: claude.beta.files.retrieve_metadata(kept.id),
    ):
        with pytest.raises(anthropic.BadRequestError) as info:
            call()
        assert info.value.body["error"]["type"] == "invalid_request_error"
        assert "Anthropic's Files API is not served" in info.value.message
    assert oa.files.delete(kept.id).deleted


def test_the_file_store_counts_what_it_holds():
    store = FileStore(capacity=10)
    a = store.add(b"12345", "a", "batch")
    with pytest.raises(ServerError) as info:
        store.add(b"123456", "b", "batch")
    assert info.value.status == 413 and "10-byte" in info.value.message
    store.add(b"1234567890", "out", "batch_output", written=True)  # a batch's output always fits
    store.delete(a.id)
    assert store.used == 10


def test_multipart_forms_are_split_at_their_boundaries():
    parts = (
        b'--XX\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b'--XX\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n'
        b"Content-Type: application/octet-stream\r\n\r\nline 1\r\nline 2\r\n--XX--\r\n"
    )
    expected = {"purpose": (None, b"batch"), "file": ("a.jsonl", b"line 1\r\nline 2")}
    for preamble in (b"", b"\r\n", b"a preamble\r\n"):  # RFC 2046 allows one
        assert _form("multipart/form-data; boundary=XX", preamble + parts) == expected
    for unreadable in (b"no boundary here", parts[:-8], parts.replace(b"\r\n\r\n", b"\r\n")):
        with pytest.raises(ServerError, match="could not be read"):
            _form("multipart/form-data; boundary=XX", unreadable)
    with pytest.raises(ServerError, match="no boundary"):
        _form("multipart/form-data", parts)


def test_a_cancelled_batch_keeps_what_finished_and_the_server_serves_on(oa, handle):
    long = _chat("Tell a long story.", max_tokens=300, ignore_eos=True)
    lines = [_line("short", _chat("Hi", max_tokens=2))]
    lines += [_line(f"long{i}", long) for i in range(11)]
    created = _batch(oa, lines)
    _settled(lambda: oa.batches.retrieve(created.id), lambda b: b.request_counts.completed >= 1)
    # The batch keeps the engine's batch (4) full, and no more: nothing waits in its queue.
    health = _settled(
        lambda: httpx.get(handle.url + "/health").json(),
        lambda h: h["scheduling"]["resident"] == 4,
    )
    assert health["active_requests"] == 4 and health["queued_requests"] == 0
    cancelling = oa.batches.cancel(created.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = _ended(oa, created.id)
    assert done.status == "cancelled" and done.cancelled_at
    counts = done.request_counts
    assert counts.total == 12 and counts.failed == 0 and 1 <= counts.completed < 12
    output = _read(oa, done.output_file_id)
    assert len(output) == counts.completed and output[0]["custom_id"] == "short"
    assert done.error_file_id is None  # the requests cancelled have no answer
    assert oa.batches.cancel(created.id).status == "cancelled"  # ended: as it is
    _idle(handle.url)
    assert oa.chat.completions.create(**_chat("Hi", max_tokens=2)).choices[0].message.content


def test_a_batch_past_its_window_expires_with_its_requests_in_the_error_file(oa, monkeypatch):
    monkeypatch.setattr(batches_module, "WINDOW", 0)
    done = _ended(oa, _batch(oa, [_line("late", _chat("Hi"))]).id)
    assert done.status == "expired" and done.expired_at and done.output_file_id is None
    assert done.request_counts.failed == 1
    [line] = _read(oa, done.error_file_id)
    assert line["custom_id"] == "late" and line["response"] is None
    assert line["error"]["code"] == "batch_expired"


def test_batches_are_listed_newest_first_in_pages(oa):
    made = [_batch(oa, [_line("x", _chat("Hi", max_tokens=1))]).id for _ in range(3)]
    for batch_id in made:
        _ended(oa, batch_id)
    listed = [b.id for b in oa.batches.list(limit=1)]  # the client pages with `after`
    assert listed[:3] == list(reversed(made))
    page = oa.batches.list(limit=2, after=made[2])
    assert [b.id for b in page.data][:2] == [made[1], made[0]]


def _message(question, max_tokens=8, **extra):
    params = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,
        **extra,
    }
    return {k: v for k, v in params.items() if v is not None}


def _message_batch_ended(claude, batch_id):
    return _settled(
        lambda: claude.messages.batches.retrieve(batch_id),
        lambda b: b.processing_status == "ended",
    )


def test_a_message_batch_is_answered_as_messages_are(claude):
    # The 2.x client has no sampling arguments: they travel in the body.
    direct = [
        claude.messages.create(**_message(q, temperature=None), extra_body={"temperature": 0})
        for q in QUESTIONS[:2]
    ]
    requests = [{"custom_id": f"q{i}", "params": _message(q)} for i, q in enumerate(QUESTIONS[:2])]
    requests.append({"custom_id": "bad", "params": {**_message("Hi"), "max_tokens": -1}})
    created = claude.messages.batches.create(requests=requests)
    assert created.id.startswith("msgbatch_") and created.type == "message_batch"
    assert created.processing_status == "in_progress" and created.request_counts.processing == 3
    assert created.results_url is None
    done = _message_batch_ended(claude, created.id)
    assert done.ended_at and done.results_url.endswith(f"/v1/messages/batches/{done.id}/results")
    counts = done.request_counts
    assert (counts.succeeded, counts.errored, counts.processing, counts.canceled) == (2, 1, 0, 0)
    results = {r.custom_id: r.result for r in claude.messages.batches.results(done.id)}
    for i, expected in enumerate(direct):
        assert results[f"q{i}"].type == "succeeded"
        assert results[f"q{i}"].message.content == expected.content
        assert results[f"q{i}"].message.usage.output_tokens == expected.usage.output_tokens
    assert results["bad"].type == "errored"
    assert results["bad"].error.error.type == "invalid_request_error"
    assert claude.messages.batches.delete(done.id).type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError) as info:  # in Anthropic's error body
        claude.messages.batches.retrieve(done.id)
    assert info.value.body["type"] == "error" and done.id in info.value.message


def test_a_message_batch_is_cancelled_and_paged(claude, handle):
    long = _message("Tell a long story.", max_tokens=300, ignore_eos=True)
    requests = [{"custom_id": f"long{i}", "params": long} for i in range(8)]
    created = claude.messages.batches.create(requests=requests)
    with pytest.raises(anthropic.BadRequestError):  # still processing
        claude.messages.batches.delete(created.id)
    canceling = claude.messages.batches.cancel(created.id)
    assert canceling.processing_status in ("canceling", "ended")
    assert canceling.cancel_initiated_at is not None
    done = _message_batch_ended(claude, created.id)
    assert done.request_counts.canceled == 8  # none had finished
    kinds = {r.result.type for r in claude.messages.batches.results(done.id)}
    assert kinds == {"canceled"}
    _idle(handle.url)
    # Paged newest first, by after_id and before_id.
    made = [created.id]
    for _ in range(2):
        made.append(claude.messages.batches.create(requests=requests[:1]).id)
        claude.messages.batches.cancel(made[-1])
    listed = [b.id for b in claude.messages.batches.list(limit=1)]
    assert listed[:3] == list(reversed(made))
    page = claude.messages.batches.list(limit=1, before_id=made[1])
    assert [b.id for b in page.data] == [made[2]]
    with pytest.raises(anthropic.BadRequestError) as info:  # custom_ids are unique
        claude.messages.batches.create(requests=requests[:1] * 2)
    assert "requests.1.custom_id" in info.value.message
    _idle(handle.url)


def test_a_shutdown_runs_no_more_of_a_batch_and_never_waits_on_it(server_llm):
    with running(server_llm, api_key="key", shutdown_timeout=0.5) as server:
        oa = openai.OpenAI(base_url=server.url + "/v1", api_key="key", max_retries=0)
        long = _chat("Tell a long story.", max_tokens=300, ignore_eos=True)
        lines = [_line("short", _chat("Hi", max_tokens=2))]
        lines += [_line(f"long{i}", long) for i in range(11)]
        created = _batch(oa, lines)
        # Its requests pass the API key as the batch's creator did.
        _settled(lambda: oa.batches.retrieve(created.id), lambda b: b.request_counts.completed)
        started = time.monotonic()
        asyncio.run_coroutine_threadsafe(server.server.drain(), server.server._loop).result(30)
        server.thread.join(timeout=30)
        assert not server.thread.is_alive() and time.monotonic() - started < 15
        batch = server.server.config.app.state.batches.get(created.id, "openai")
        assert batch.status == "cancelled"
        answered = [line.custom_id for line in batch.lines if line.status_code is not None]
        assert answered == ["short"]
    _idle_llm(server_llm)


def _idle_llm(llm):
    metrics = llm.get_scheduling_metrics
    _settled(metrics, lambda m: not m["resident"] and not m["queued"])

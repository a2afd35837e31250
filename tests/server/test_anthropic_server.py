"""The Anthropic Messages API over a real uvicorn server, driven by the official client."""

import json
import re

import anthropic
import httpx
import pytest

from inflight import SamplingParams

from server_harness import held_streams, prompt_of, serve

pytestmark = pytest.mark.slow

# The 2.x client has no sampling arguments any more; they travel in the body.
GREEDY = {"extra_body": {"temperature": 0}}

MODEL = "test-model"
MESSAGES = [{"role": "user", "content": "Name a primary color."}]


@pytest.fixture(scope="module")
def server(server_llm):
    with serve(server_llm, max_queued_requests=4) as (url, _):
        yield url


@pytest.fixture
def client(server):
    return anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0)


def test_message_equals_python_api(client, server_llm):
    expected = server_llm.chat(
        [{"role": "system", "content": "Be brief."}, *MESSAGES],
        SamplingParams(temperature=0, max_tokens=20),
    )[0]
    message = client.messages.create(
        model=MODEL, system="Be brief.", messages=MESSAGES, max_tokens=20, **GREEDY
    )
    assert message.content[0].type == "text"
    assert message.content[0].text == expected.text
    assert (
        message.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[expected.finish_reason]
    )
    assert prompt_of(message.usage) == expected.prompt_tokens
    # The Python call just ran the same prompt: the server reads from the context cache what
    # a second Python call does.
    again = server_llm.chat(
        [{"role": "system", "content": "Be brief."}, *MESSAGES],
        SamplingParams(temperature=0, max_tokens=1),
    )[0]
    assert message.usage.cache_read_input_tokens == again.cached_tokens > 0
    assert message.usage.output_tokens == len(expected.token_ids)


def test_stop_sequence_is_reported(client, server_llm):
    free = server_llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=30))[0]
    word = free.text.split()[1]
    message = client.messages.create(
        model=MODEL, messages=MESSAGES, max_tokens=30, stop_sequences=[word], **GREEDY
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == word
    assert message.content[0].text == free.text[: free.text.index(word)]


def test_vllm_length_controls_apply_as_in_the_python_api(client, server_llm):
    # ignore_eos and min_tokens, which benchmarks (aiperf) send to every endpoint.
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    free = server_llm.chat(chat, SamplingParams(temperature=0, max_tokens=200))[0]
    assert free.finish_reason == "stop"
    least = len(free.token_ids) + 4
    for extra in ({"min_tokens": least}, {"ignore_eos": True}):
        params = SamplingParams(temperature=0, max_tokens=least + 30, **extra)
        expected = server_llm.chat(chat, params)[0]
        message = client.messages.create(
            model=MODEL,
            messages=chat,
            max_tokens=least + 30,
            extra_body={"temperature": 0, **extra},
        )
        assert message.content[0].text == expected.text
        assert message.usage.output_tokens == len(expected.token_ids) >= least


def test_redacted_thinking_sent_back_is_left_out_of_the_prompt(client):
    """Clients must send Anthropic's encrypted thinking back as it came (the AI SDK, replayed
    Claude conversations): accepted, and, unreadable here, rendered as nothing."""

    def history(*blocks):
        return [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [*blocks, {"type": "text", "text": "hello"}]},
            {"role": "user", "content": "again"},
        ]

    redacted = {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix"}
    with_it = client.messages.create(
        model=MODEL, max_tokens=6, messages=history(redacted), **GREEDY
    )
    without = client.messages.create(model=MODEL, max_tokens=6, messages=history(), **GREEDY)
    assert prompt_of(with_it.usage) == prompt_of(without.usage)
    assert with_it.content[0].text == without.content[0].text


def test_a_final_assistant_message_is_continued(client, server_llm):
    # The API's prefill: the reply goes on from the assistant's text, which it does not repeat.
    prefill = [*MESSAGES, {"role": "assistant", "content": "My favourite primary color is"}]
    expected = server_llm.chat(
        prefill,
        SamplingParams(temperature=0, max_tokens=12),
        add_generation_prompt=False,
        continue_final_message=True,
    )[0]
    message = client.messages.create(model=MODEL, messages=prefill, max_tokens=12, **GREEDY)
    assert message.content[0].text == expected.text
    assert prompt_of(message.usage) == expected.prompt_tokens
    counted = client.messages.count_tokens(model=MODEL, messages=prefill)
    assert counted.input_tokens == expected.prompt_tokens
    # As the API refuses it: a prefill ending with whitespace.
    spaced = [*MESSAGES, {"role": "assistant", "content": "My favourite color is "}]
    with pytest.raises(anthropic.BadRequestError, match="trailing whitespace"):
        client.messages.create(model=MODEL, messages=spaced, max_tokens=4, **GREEDY)


def test_stream_event_order(client, server_llm):
    expected = server_llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=12))[0]
    with client.messages.stream(model=MODEL, messages=MESSAGES, max_tokens=12, **GREEDY) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[1] == "content_block_start"
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[2:-3]) <= {"text", "content_block_delta", "ping"}
    assert final.content[0].text == expected.text
    assert final.usage.output_tokens == len(expected.token_ids)
    # message_delta's usage is the final one, input and cache reads too (langchain reads only
    # it): the same as the whole message's for the same prompt, now cached alike.
    assert prompt_of(final.usage) == expected.prompt_tokens
    whole = client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=12, **GREEDY)
    assert final.usage == whole.usage
    with client.messages.stream(model=MODEL, messages=MESSAGES, max_tokens=12, **GREEDY) as stream:
        events = list(stream)
    start = events[0].message.usage
    delta = next(e for e in events if e.type == "message_delta").usage
    assert delta.model_dump(exclude_none=True) == whole.usage.model_dump(exclude_none=True)
    # message_start gives the same split (LangChain.js reads the cache reads only there).
    assert (start.input_tokens, start.cache_read_input_tokens) == (
        whole.usage.input_tokens,
        whole.usage.cache_read_input_tokens,
    )


def test_count_tokens(client, server_llm):
    counted = client.messages.count_tokens(model=MODEL, messages=MESSAGES, system="Be brief.")
    rendered = server_llm.prepare([{"role": "system", "content": "Be brief."}, *MESSAGES])
    assert counted.input_tokens == len(rendered.prompt_token_ids)


def test_errors_use_the_anthropic_body(server):
    r = httpx.post(server + "/v1/messages", json={"model": MODEL, "messages": MESSAGES})
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    # A block's field named once, though its type's tag is the same word.
    block = {"role": "user", "content": [{"type": "text", "text": 5}]}
    r = httpx.post(
        server + "/v1/messages", json={"model": MODEL, "messages": [block], "max_tokens": 5}
    )
    assert r.json()["error"]["message"].startswith("messages.0.content.0.text: ")
    r = httpx.post(
        server + "/v1/messages", json={"model": "claude-x", "messages": MESSAGES, "max_tokens": 5}
    )
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(
        server + "/v1/messages",
        json={
            "model": MODEL,
            "max_tokens": 5,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
                        }
                    ],
                }
            ],
        },
    )
    assert r.status_code == 400 and "takes no image input" in r.json()["error"]["message"]
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "stop_sequences": ["x"] * 33}
    r = httpx.post(server + "/v1/messages", json=body)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "stop_sequences" in message and "32" in message


def test_a_prompt_too_long_is_worded_as_anthropics(client):
    """A 400 reading "prompt is too long: N tokens > M maximum", as Anthropic's, which Claude
    Code and LangChain's Anthropic model match to compact a conversation (the seed's server
    answered 413, Anthropic's word for a body too large); count_tokens refuses it alike."""
    long = [{"role": "user", "content": "word " * 600}]
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, messages=long, max_tokens=4)
    error = info.value.body["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("prompt is too long: ")
    assert error["message"].endswith(" tokens > 511 maximum")
    assert int(error["message"].split()[4]) > 511
    with pytest.raises(anthropic.BadRequestError, match="prompt is too long"):
        client.messages.count_tokens(model=MODEL, messages=long)
    # With max_tokens past the room left, Anthropic's words, whose numbers Claude Code reads to
    # retry with a max_tokens that fits.
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=600)
    message = info.value.body["error"]["message"]
    found = re.fullmatch(
        r"input length and `max_tokens` exceed context limit: (\d+) \+ 600 > 512, decrease "
        r"input length or `max_tokens` and try again",
        message,
    )
    assert found and 0 < int(found[1]) < 512, message


def test_every_response_names_its_request_in_anthropics_header(client, server):
    reply = client.messages.create(model=MODEL, max_tokens=1, messages=MESSAGES)
    assert reply._request_id and reply._request_id.startswith("req_")
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=MODEL, max_tokens=1, messages=[])
    assert refused.value.request_id.startswith("req_")
    r = httpx.post(server + "/v1/messages", json={}, headers={"X-Request-Id": "trace-7"})
    assert r.headers["request-id"] == r.headers["x-request-id"] == "trace-7"


def test_overload_is_529(server_llm):
    with serve(server_llm, max_queued_requests=0) as (url, _):
        # The leases are shared by both APIs; OpenAI's `ignore_eos` keeps the holders from
        # ending early on a sampled EOS.
        body = {"messages": MESSAGES, "max_tokens": 300, "stream": True, "ignore_eos": True}
        with held_streams(url, "/v1/chat/completions", body, 4):  # batch 4 + queue 0 = 4 leases
            c = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
            with pytest.raises(anthropic.APIStatusError) as info:
                c.messages.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        assert info.value.status_code == 529
        assert info.value.body["error"]["type"] == "overloaded_error"


def test_output_config_constrains_the_reply_and_parse_reads_it(client):
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    question = [{"role": "user", "content": "Name a city in France."}]
    parsed = client.messages.parse(
        model=MODEL, max_tokens=60, messages=question, output_format=City, **GREEDY
    )
    assert isinstance(parsed.parsed_output, City)
    schema = {
        "type": "object",
        "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    }
    message = client.messages.create(
        model=MODEL,
        max_tokens=30,
        messages=MESSAGES,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        **GREEDY,
    )
    assert json.loads(message.content[0].text)["color"] in {"red", "green", "blue"}
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(
            model=MODEL,
            max_tokens=30,
            messages=MESSAGES,
            output_config={"format": {"type": "json_schema", "schema": schema}},
            extra_body={"output_format": {"type": "json_schema", "schema": schema}},
        )
    # A forced tool call is the whole reply: the format beside it is accepted and named.
    raw = client.messages.with_raw_response.create(
        model=MODEL,
        max_tokens=30,
        messages=MESSAGES,
        tools=[{"name": "pick", "description": "Pick a color", "input_schema": schema}],
        tool_choice={"type": "tool", "name": "pick"},
        output_config={"format": {"type": "json_schema", "schema": schema}},
        **GREEDY,
    )
    assert raw.http_response.headers["x-inflight-ignored-fields"] == "output_config.format"
    (call,) = raw.parse().content
    assert call.type == "tool_use" and call.input["color"] in {"red", "green", "blue"}


def test_a_system_message_in_the_conversation_is_rendered_where_it_stands(client, server_llm):
    # Claude Code's form: instructions added after a user turn, and its context edits.
    conversation = [
        {"role": "user", "content": "Name a primary color."},
        {"role": "system", "content": [{"type": "text", "text": "Answer in one word."}]},
    ]
    expected = server_llm.chat(
        [{"role": "system", "content": "Be brief."}, conversation[0],
         {"role": "system", "content": "Answer in one word."}],
        SamplingParams(temperature=0, max_tokens=8),
    )[0]  # fmt: skip
    raw = client.messages.with_raw_response.create(
        model=MODEL,
        system="Be brief.",
        max_tokens=8,
        messages=conversation,
        extra_body={
            "temperature": 0,
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        },
    )
    # Claude Code's edit keeps all thinking: applied, it changes nothing, and is not ignored.
    assert "x-inflight-ignored-fields" not in raw.http_response.headers
    assert raw.http_response.json()["context_management"] == {"applied_edits": []}
    message = raw.parse()
    assert message.content[0].text == expected.text
    assert prompt_of(message.usage) == expected.prompt_tokens


def test_documented_fields_without_meaning_are_accepted_and_named(client):
    raw = client.messages.with_raw_response.create(
        model=MODEL,
        max_tokens=2,
        messages=MESSAGES,
        metadata={"user_id": "u1"},
        service_tier="auto",
        cache_control={"type": "ephemeral"},  # served: the context cache, by content
        thinking={"type": "enabled", "budget_tokens": 1024},  # no switch in this template
    )
    assert raw.http_response.status_code == 200
    assert raw.http_response.headers["x-inflight-ignored-fields"] == (
        "metadata, service_tier, thinking"
    )
    # The beta API's billing fields and server-side fallbacks (for a model that declines on
    # policy, which this server's never does).
    raw = client.beta.messages.with_raw_response.create(
        model=MODEL,
        max_tokens=2,
        messages=MESSAGES,
        billing_policy={"type": "billing_policy", "bill_to": "self"},
        fallbacks="default",
        fallback_credit_token="token",
    )
    assert raw.http_response.status_code == 200
    assert raw.http_response.headers["x-inflight-ignored-fields"] == (
        "billing_policy, fallback_credit_token, fallbacks"
    )
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(
            model=MODEL, max_tokens=2, messages=MESSAGES, extra_body={"bogus": True}
        )


def continue_raw(url, previous, **fields):
    """A continue of `previous` sent by hand (the SDKs' helpers recover from its rejections)."""
    body = {
        "model": MODEL,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "And then?"}],
        "thread": {"type": "continue", "previous_message_id": previous},
        **fields,
    }
    return httpx.post(url + "/v1/messages", json=body)


def test_a_message_thread_holds_the_conversation_between_turns(client, server):
    thread = client.beta.messages.thread(model=MODEL, max_tokens=12, system="Be brief.", **GREEDY)
    first = thread.send({"role": "user", "content": "Name a primary color."})
    second = thread.send({"role": "user", "content": "Name another."})
    # The second turn was served from the whole conversation, which the server rebuilt...
    whole = [
        *MESSAGES,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": "Name another."},
    ]
    counted = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=whole)
    assert prompt_of(second.usage) == counted.input_tokens
    # ... as a continue of the first reply, which cannot be continued again.
    r = continue_raw(server, first.id)
    assert r.status_code == 400
    assert r.json()["error"]["details"] == {"error_code": "thread_already_continued"}
    assert continue_raw(server, second.id).status_code == 200


def test_a_streamed_thread_turn_is_kept_once_its_stream_is_whole(client, server):
    thread = client.beta.messages.thread(model=MODEL, max_tokens=12, **GREEDY)
    with thread.stream({"role": "user", "content": "Name a primary color."}) as stream:
        first = stream.get_final_message()
    second = thread.send({"role": "user", "content": "Name another."})
    whole = [
        *MESSAGES,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": "Name another."},
    ]
    assert (
        prompt_of(second.usage)
        == client.messages.count_tokens(model=MODEL, messages=whole).input_tokens
    )


def test_the_tool_runner_continues_its_thread_with_the_tool_results(client, server):
    calls = []

    @anthropic.beta_tool
    def get_weather(city: str) -> str:
        """The weather in a city.

        Args:
            city: the city's name
        """
        calls.append(city)
        return "sunny"

    runner = client.beta.messages.tool_runner(
        model=MODEL,
        max_tokens=40,
        max_iterations=2,
        tools=[get_weather],
        tool_choice={"type": "any"},
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        **GREEDY,
    )
    replies = list(runner)
    # tool_choice any: each reply calls the tool, and the runner answers each call.
    assert [r.stop_reason for r in replies] == ["tool_use", "tool_use"] and len(calls) == 2
    # The second request continued the first reply's thread, the tool's result its message.
    assert continue_raw(server, replies[0].id).json()["error"]["details"] == {
        "error_code": "thread_already_continued"
    }


def test_thread_rejections_carry_the_apis_error_codes(server):
    r = continue_raw(server, "msg_unknown")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert r.json()["error"]["details"] == {"error_code": "thread_not_found"}
    created = httpx.post(
        server + "/v1/messages",
        json={"model": MODEL, "max_tokens": 4, "messages": MESSAGES, "thread": {"type": "create"}},
    ).json()
    r = continue_raw(server, created["id"], system="Other.")
    assert r.status_code == 400 and "leave system out" in r.json()["error"]["message"]
    assert continue_raw(server, created["id"]).status_code == 200  # the refusal kept it open


def test_models_read_as_the_anthropic_models_api(client):
    listed = client.models.list()
    (model,) = listed.data
    assert model.id == MODEL and model.type == "model" and model.display_name == MODEL
    assert model.created_at.year >= 2026 and model.max_input_tokens == model.max_tokens == 511
    assert listed.has_more is False and listed.first_id == listed.last_id == MODEL
    assert client.models.retrieve(MODEL).created_at == model.created_at

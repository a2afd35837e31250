"""Structured outputs over HTTP with the official `openai` client: `response_format`, vLLM's
`structured_outputs` (and its older `guided_*` fields) and SGLang's `regex` and `ebnf`, on chat
and completions, streamed and not; bad constraints are 400s."""

import json
import re

import httpx
import jsonschema
import openai
import pytest

from server_harness import serve

pytestmark = pytest.mark.slow

MODEL = "test-model"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
    },
    "required": ["city", "population"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Give the largest city of France as JSON."}]
# additionalProperties left unsaid, as in most schemas people write.
OPEN_SCHEMA = {k: v for k, v in SCHEMA.items() if k != "additionalProperties"}


@pytest.fixture(scope="module")
def server(server_llm):
    with serve(server_llm, max_queued_requests=4) as (url, _):
        yield url


@pytest.fixture
def oa(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def test_json_schema_chat_streamed_and_whole(oa):
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    whole = oa.chat.completions.create(
        model=MODEL, messages=ASK, response_format=response_format, temperature=0, max_tokens=64
    )
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole.choices[0].message.content), SCHEMA)
    stream = oa.chat.completions.create(
        model=MODEL,
        messages=ASK,
        response_format=response_format,
        temperature=0,
        max_tokens=64,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content
    obj = oa.chat.completions.create(
        model=MODEL,
        messages=ASK,
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=128,
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_hugging_face_inference_client_and_tgi_formats_keep_their_schema(oa, server, monkeypatch):
    """huggingface_hub's InferenceClient sends a json_schema format as TGI's grammar, {"type":
    "json_object", "value": schema}: the schema holds (it was read as any JSON object), as it
    does in TGI's {"type": "json", ...} and llama.cpp's {"type": "json_object", "schema": ...};
    TGI's regex format too. Greedy, each gives the reply of OpenAI's json_schema format."""
    import huggingface_hub
    from huggingface_hub import InferenceClient

    # HF_HUB_OFFLINE blocks the client's every request; this one goes to the test's server.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    json_schema = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    want = oa.chat.completions.create(
        model=MODEL, messages=ASK, response_format=json_schema, temperature=0, max_tokens=64
    )
    want_text = want.choices[0].message.content
    jsonschema.validate(json.loads(want_text), SCHEMA)
    hf = InferenceClient(base_url=server + "/v1", api_key="unused")
    reply = hf.chat_completion(
        model=MODEL, messages=ASK, response_format=json_schema, temperature=0, max_tokens=64
    )
    assert reply.choices[0].message.content == want_text
    for response_format in (
        {"type": "json", "value": SCHEMA},
        {"type": "json_object", "schema": SCHEMA},
    ):
        body = {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 64}
        r = httpx.post(
            server + "/v1/chat/completions", json=body | {"response_format": response_format}
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want_text
    phone = oa.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "My phone number?"}],
        max_tokens=16,
        temperature=0.8,
        extra_body={"response_format": {"type": "regex", "value": "[0-9]{3}-[0-9]{4}"}},
    )
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", phone.choices[0].message.content)


def test_a_schema_that_leaves_additional_properties_unsaid_gets_only_its_own(oa):
    """As OpenAI and vLLM serve such schemas: no keys of the model's own, which JSON Schema's
    default would allow."""
    ask = [{"role": "user", "content": "Describe Paris as JSON: its name, population, mayor."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "c", "schema": OPEN_SCHEMA}}
    chat = oa.chat.completions.create(
        model=MODEL, messages=ask, response_format=response_format, temperature=0, max_tokens=64
    )
    completion = oa.completions.create(
        model=MODEL,
        prompt="Paris as JSON, with its name, population, mayor and area:",
        max_tokens=64,
        temperature=0,
        extra_body={"structured_outputs": {"json": OPEN_SCHEMA}},
    )
    for choice, text in [
        (chat.choices[0], chat.choices[0].message.content),
        (completion.choices[0], completion.choices[0].text),
    ]:
        assert choice.finish_reason == "stop", text
        assert json.loads(text).keys() == set(SCHEMA["properties"])


def test_structured_outputs_field_on_completions(oa):
    regex = oa.completions.create(
        model=MODEL,
        prompt="My phone number is",
        max_tokens=16,
        temperature=0.8,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}},
    )
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", regex.choices[0].text)
    choice = oa.completions.create(
        model=MODEL,
        prompt="Is Paris in France? Answer:",
        max_tokens=4,
        stream=True,
        extra_body={"structured_outputs": {"choice": [" yes", " no"]}},
    )
    assert "".join(c.choices[0].text for c in choice if c.choices) in (" yes", " no")


def test_sglang_regex_and_ebnf_fields(oa):
    """As outlines' SGLang model sends them (extra_body), the grammar in Lark with an inlined
    start rule, as outlines writes its grammars."""
    regex = oa.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "A phone number?"}],
        max_tokens=16,
        temperature=0.8,
        extra_body={"regex": "\\([0-9]{3}\\) [0-9]{3}-[0-9]{4}"},
    )
    assert re.fullmatch(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", regex.choices[0].message.content)
    grammar = '\n?start: sum\n?sum: NUMBER "+" NUMBER\nNUMBER: /[0-9]{1,3}/\n'
    stream = oa.completions.create(
        model=MODEL,
        prompt="An addition:",
        max_tokens=16,
        temperature=0.8,
        stream=True,
        extra_body={"ebnf": grammar},
    )
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert re.fullmatch("[0-9]{1,3}[+][0-9]{1,3}", text), text


def test_vllms_older_guided_fields(oa):
    """vLLM's `guided_*` fields, each one constraint; as guidance's vLLM model sends them, a
    grammar in `guided_grammar` and again in `structured_outputs`, with a backend's name."""
    grammar = '\n?start: sum\n?sum: NUMBER "+" NUMBER\nNUMBER: /[0-9]{1,3}/\n'
    both = oa.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "An addition?"}],
        max_tokens=16,
        temperature=0.8,
        extra_body={
            "guided_decoding_backend": "guidance",
            "guided_grammar": grammar,
            "structured_outputs": {"grammar": grammar},
        },
    )
    assert re.fullmatch("[0-9]{1,3}[+][0-9]{1,3}", both.choices[0].message.content)
    city = oa.chat.completions.create(
        model=MODEL,
        messages=ASK,
        temperature=0,
        max_tokens=64,
        extra_body={"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"},
    )
    jsonschema.validate(json.loads(city.choices[0].message.content), SCHEMA)
    phone = oa.completions.create(
        model=MODEL,
        prompt="My phone number is",
        max_tokens=16,
        temperature=0.8,
        extra_body={"guided_regex": "[0-9]{3}-[0-9]{4}"},
    )
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", phone.choices[0].text)
    answer = oa.completions.create(
        model=MODEL,
        prompt="Is Paris in France? Answer:",
        max_tokens=4,
        extra_body={"guided_choice": [" yes", " no"]},
    )
    assert answer.choices[0].text in (" yes", " no")


@pytest.mark.parametrize(
    ("extra", "param", "needle"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}}},
            "response_format",
            "does not compile",
        ),
        ({"structured_outputs": {"regex": r"[^\s\S]"}}, "structured_outputs", "no string"),
        ({"structured_outputs": {"grammar": "start: nothing_here"}}, "structured_outputs", ""),
        ({"ebnf": "start: nothing_here"}, "ebnf", "does not compile"),
        ({"regex": ""}, "regex", "non-empty"),
        ({"structured_outputs": {"regex": "a"}, "regex": "b"}, "regex", "one output constraint"),
        ({"response_format": {"type": "json_object"}, "ebnf": "start: x"}, "ebnf", "not response"),
        ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "guided_regex", "one output"),
        ({"guided_choice": []}, "guided_choice", "a list of strings"),
        ({"guided_json": "{not json"}, "guided_json", ""),
        (
            {"guided_regex": "a", "guided_decoding_backend": "mine"},
            "guided_decoding_backend",
            "one",
        ),
    ],
)
def test_a_bad_constraint_is_a_400_and_nothing_is_queued(server, server_llm, extra, param, needle):
    submitted = server_llm.get_scheduling_metrics()["submitted"]
    r = httpx.post(
        server + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **extra}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"]
    assert server_llm.get_scheduling_metrics()["submitted"] == submitted

"""vLLM's /tokenize and /detokenize over a real server: a prompt's ids are the tokenizer's, a
conversation's the prompt a chat completion of it runs, and ids come back as their text."""

import httpx
import openai
import pytest
from test_tools_server import TOOLS

from server_harness import serve

pytestmark = pytest.mark.slow

MODEL = "test-model"
TEXT = "The capital of France is Paris."
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def server(server_llm):
    with serve(server_llm, tool_call_parser="hermes") as (url, _):
        yield url


def _post(server, path, **body):
    return httpx.post(f"{server}/{path}", json={"model": MODEL, **body})


def test_a_prompt_is_tokenized_as_the_tokenizer_does(server, server_llm):
    tokenizer = server_llm.tokenizer
    r = _post(server, "tokenize", prompt=TEXT)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode(TEXT) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == server_llm.max_model_len and body["token_strs"] is None
    # As `vllm bench serve` asks: no special tokens, and the pieces as the vocabulary has them.
    bare = _post(server, "tokenize", prompt=TEXT, add_special_tokens=False, return_token_strs=True)
    ids = bare.json()["tokens"]
    assert ids == tokenizer.encode(TEXT, add_special_tokens=False)
    assert bare.json()["token_strs"][1] == "Ġcapital"
    assert "".join(bare.json()["token_strs"]).replace("Ġ", " ") == TEXT
    back = _post(server, "detokenize", tokens=ids[:4])
    assert back.status_code == 200 and back.json() == {"prompt": tokenizer.decode(ids[:4])}
    assert _post(server, "detokenize", tokens=ids).json()["prompt"] == TEXT


def test_messages_are_tokenized_as_a_chat_completion_runs_them(server, server_llm):
    r = _post(server, "tokenize", messages=MESSAGES)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == list(server_llm.prepare(MESSAGES).prompt_token_ids)
    oa = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    kwargs = {"enable_thinking": False}
    with_tools = _post(
        server, "tokenize", messages=MESSAGES, tools=TOOLS, chat_template_kwargs=kwargs
    )
    reply = oa.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=1,
        extra_body={"chat_template_kwargs": kwargs},
    )
    assert with_tools.json()["count"] == reply.usage.prompt_tokens
    assert with_tools.json()["count"] > r.json()["count"]  # the tools are in the prompt
    prefill = [*MESSAGES, {"role": "assistant", "content": "Paris"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    continued = _post(server, "tokenize", messages=prefill, **options)
    assert continued.json()["tokens"] == list(
        server_llm.prepare(prefill, **options).prompt_token_ids
    )
    assert continued.json()["tokens"][: r.json()["count"]] == r.json()["tokens"]


@pytest.mark.parametrize(
    ("path", "body", "param", "named"),
    [
        ("tokenize", {"prompt": TEXT, "messages": MESSAGES}, "prompt", "one of them"),
        ("tokenize", {}, "prompt", "one of them"),
        ("tokenize", {"prompt": TEXT, "tools": TOOLS}, "tools", "messages only"),
        (
            "tokenize",
            {"messages": MESSAGES, "add_special_tokens": True},
            "add_special_tokens",
            "not supported",
        ),
        (
            "tokenize",
            {"messages": MESSAGES, "continue_final_message": True},
            "continue_final_message",
            "add_generation_prompt",
        ),
        ("tokenize", {"prompt": TEXT, "add_special_token": False}, "add_special_token", "unknown"),
        ("detokenize", {"tokens": [1, 10**9]}, "tokens", "1000000000"),
        ("detokenize", {"tokens": [-1]}, "tokens.0", "greater than or equal"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(server, path, body, param, named):
    r = _post(server, path, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and named in error["message"], error


def test_an_unknown_model_is_a_404(server):
    r = httpx.post(f"{server}/tokenize", json={"model": "other", "prompt": TEXT})
    assert r.status_code == 404 and "other" in r.json()["error"]["message"]

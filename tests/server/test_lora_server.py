"""LoRA adapters over HTTP: a request picks one by `model`, adapters load and unload at run
time, and each one's greedy output is transformers + peft's."""

import httpx
import openai
import pytest
import torch

from inflight import LLM, SamplingParams

from server_harness import serve
from tiny_models import make_lora_adapter

PROMPT = list(range(5, 40))
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


@pytest.fixture(scope="module")
def setup(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    refs = {
        name: make_lora_adapter(tiny_dirs["llama"], root / name, seed, r=8, target_modules=TARGETS)
        for seed, name in enumerate(["sql", "poetry"])
    }
    llm = LLM(
        tiny_dirs["llama"],
        enable_in_flight_batching=True,
        max_batch_size=4,
        max_model_len=256,
        quantization="none",
        enable_lora=True,
        max_loras=2,
        lora_modules={"sql": root / "sql"},
    )
    with serve(llm, name="base") as (url, _):
        yield url, root, refs, llm
    llm.close()


def _peft_answer(llm, reference, lora_name, n=8):
    """The text the server should send: the tokens of transformers + peft's greedy run (checked
    through the Python API, whose detokenizer is the server's) as text."""
    seq = list(PROMPT)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(reference(torch.tensor([seq])).logits[0, -1].argmax()))
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    ours = llm.generate({"prompt_token_ids": PROMPT}, params, lora_name=lora_name)[0]
    assert list(ours.token_ids) == seq[len(PROMPT) :]
    return ours.text


def _text(client, model):
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    return out.choices[0].text


def test_models_list_the_adapters_with_their_base(setup):
    url, *_ = setup
    data = httpx.get(url + "/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in data] == [("base", None), ("sql", "base")]
    # Each one alone (`client.models.retrieve`); a name served by no model is a 404.
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    assert [client.models.retrieve(m["id"]).model_dump(exclude_unset=True) for m in data] == data
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("meta-llama/Llama-3.1-8B")
    assert "'meta-llama/Llama-3.1-8B' is not served here" in missing.value.body["message"]


def test_an_adapter_answers_as_peft_does_and_the_base_as_itself(setup):
    url, _, refs, llm = setup
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    sql = _text(client, "sql")
    assert sql == _peft_answer(llm, refs["sql"], "sql")
    base = llm.generate(
        {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    )[0]
    assert _text(client, "base") == base.text != sql
    chat = client.chat.completions.create(
        model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert chat.model == "sql" and chat.choices[0].message.content is not None


def test_load_use_unload_then_404(setup):
    url, root, refs, llm = setup
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="'poetry' is not served here"):
        _text(client, "poetry")
    r = httpx.post(
        url + "/v1/load_lora_adapter",
        json={"lora_name": "poetry", "lora_path": str(root / "poetry")},
    )
    assert r.status_code == 200, r.text
    assert _text(client, "poetry") == _peft_answer(llm, refs["poetry"], "poetry")
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "poetry"})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError) as info:
        _text(client, "poetry")
    assert "served: 'base', 'sql'" in str(info.value)
    assert (
        httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "poetry"}).status_code == 404
    )


def test_bad_loads_are_400_with_the_reason(setup, tmp_path):
    url, root, *_ = setup
    missing = httpx.post(
        url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)}
    )
    assert missing.status_code == 400 and "adapter_config.json" in missing.text
    taken = httpx.post(
        url + "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(root / "sql")}
    )
    assert taken.status_code == 400 and "already served" in taken.text


def test_loading_an_adapter_without_lora_is_400_naming_the_flag(tiny_dirs, tmp_path):
    """A server started without --enable-lora answers POST /v1/load_lora_adapter with a 400
    whose message names --enable-lora, and goes on serving its base model alone."""
    adapter = tmp_path / "sql"
    make_lora_adapter(tiny_dirs["llama"], adapter, 0, r=8, target_modules=TARGETS)
    with LLM(tiny_dirs["llama"], max_model_len=128) as llm, serve(llm, name="base") as (url, _):
        r = httpx.post(
            url + "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(adapter)}
        )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert "--enable-lora" in error["message"]
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["base"]

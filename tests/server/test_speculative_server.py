"""Speculative decoding over HTTP: `--speculative-config` as vLLM takes it, the same greedy text
as without it through the openai client, its counters in /health and /metrics, and the
per-request opt-out."""

import httpx
import openai
import pytest

from inflight import LLM, SamplingParams

from server_harness import serve

CODE = (
    "Rename the variables of this code:\n"
    "def f(a, b):\n    c = a + b\n    d = c * 2\n    return d\n\n"
    "def g(x):\n    return f(x, x) + f(x, 1)\n\nThe code with new names:\n"
)


@pytest.fixture(scope="module")
def setup():
    llm = LLM(
        enable_in_flight_batching=True,
        max_batch_size=4,
        max_model_len=512,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
    )
    with serve(llm, name="smol") as (url, _):
        yield url, llm
    llm.close()


def test_greedy_text_is_the_plain_text_and_the_counters_show_it(setup):
    url, llm = setup
    plain = (
        llm.generate([CODE], SamplingParams(temperature=0, max_tokens=48, speculative=False))[0]
        .outputs[0]
        .text
    )
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    reply = client.completions.create(model="smol", prompt=CODE, temperature=0, max_tokens=48)
    assert reply.choices[0].text == plain
    health = httpx.get(url + "/health").json()
    spec = health["speculative_decoding"]
    assert spec["accepted_tokens"] > 0 and 0 < spec["acceptance_rate"] <= 1
    assert health["scheduling"]["spec_decode_accepted_tokens"] == spec["accepted_tokens"]
    metrics = httpx.get(url + "/metrics").text
    assert f"inflight_spec_decode_accepted_tokens_total {float(spec['accepted_tokens'])}" in metrics
    assert "inflight_spec_decode_mean_accepted_length" in metrics
    assert "inflight_spec_decode_fallback_rows_total" in metrics


def test_a_request_may_opt_out_over_http(setup):
    url, llm = setup
    before = llm.get_speculative_metrics()["verifications"]
    r = httpx.post(
        url + "/v1/completions",
        json={
            "model": "smol",
            "prompt": CODE,
            "max_tokens": 32,
            "temperature": 0,
            "speculative": False,
        },
        timeout=60,  # httpx's 5 s default, not the subject here: a loaded 2-core box ran past it
    )
    assert r.status_code == 200
    assert llm.get_speculative_metrics()["verifications"] == before


def test_the_cli_takes_vllms_json_and_refuses_a_bad_one():
    from inflight.server.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(
        ["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    )
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--speculative-config", "ngram"])
    with pytest.raises(ValueError, match="speculative method must be 'ngram'"):
        LLM(speculative_config={"method": "eagle", "num_speculative_tokens": 3})

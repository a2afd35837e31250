"""Structured outputs under in-flight batching on the embedded model: constrained requests join
running batches beside free ones, and neither disturbs the other."""

import json

import jsonschema
import pytest

from inflight import LLM, SamplingParams
from inflight.protocol.request import StructuredOutputs

from helpers import assert_no_leaks

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 110},
        "height_m": {"type": "number", "minimum": 0.5, "maximum": 2.5},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
PROMPTS = [
    "Describe a user of our system as JSON.",
    "The capital of France is",
    "Write a short poem about the sea.",
    "List three fruits:",
]


@pytest.fixture(scope="module")
def llm8():
    instance = LLM(enable_in_flight_batching=True, max_batch_size=8, max_model_len=1024)
    yield instance
    instance.close()


def _free(i):
    if i % 2 == 0:
        return SamplingParams(max_tokens=24, temperature=0)
    return SamplingParams(max_tokens=24, temperature=1.0, seed=i)


@pytest.mark.slow
def test_constrained_joiners_beside_free_rows(llm8):
    constrained = SamplingParams(
        max_tokens=256, temperature=1.0, structured_outputs=StructuredOutputs(json=PERSON)
    )
    prompts, params = [], []
    for i in range(8):  # free, constrained, free, constrained, ...: every constrained one joins
        prompts += [PROMPTS[i % 4], [{"role": "user", "content": PROMPTS[0]}]]
        params += [_free(i), constrained]
    before = llm8.get_scheduling_metrics()
    outputs = llm8.generate(prompts, params)
    after = llm8.get_scheduling_metrics()
    assert after["admitted_mid_flight"] - before["admitted_mid_flight"] == 15
    for out in outputs[1::2]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)
    for prompt, p, out in zip(prompts[::2], params[::2], outputs[::2], strict=True):
        alone = llm8.generate(prompt, p)[0]  # the same request with the batch to itself
        assert out.token_ids == alone.token_ids, prompt
    assert_no_leaks(llm8)


@pytest.mark.slow
def test_choice_and_regex_on_the_embedded_model(llm8):
    outputs = llm8.generate(
        ["Is the sky blue? Answer:", "Call me at"],
        [
            SamplingParams(temperature=0, structured_outputs={"choice": ["yes", "no"]}),
            SamplingParams(temperature=0, structured_outputs={"regex": r"[0-9]{3}-[0-9]{4}"}),
        ],
    )
    assert outputs[0].text in ("yes", "no") and outputs[0].finish_reason == "stop"
    assert len(outputs[1].text) == 8 and outputs[1].text[3] == "-"

"""Structured outputs in the runtime: only strings of the constraint's language, per row, in
batches that rows join and leave, with every other sampling feature."""

import json
import re

import jsonschema
import pytest

from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.outputs import materialize
from inflight.protocol.request import (
    GenerationRequest,
    RequestFieldError,
    SamplingParams,
    StructuredOutputs,
)
from inflight.runtime.runtime import Runtime

from helpers import assert_no_leaks

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3},
        "home": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "pets", "home"],
    "additionalProperties": False,
}
GRAMMAR = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/'


@pytest.fixture(scope="module")
def runtime(tiny_dirs):
    config = DeploymentOptions(max_batch_size=8, max_model_len=512, max_num_tokens=64)
    return Runtime(tiny_dirs["qwen2"], config)


def _run(runtime, constraint, seed, max_tokens=160, prompt=(5, 6, 7), **params):
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0,
        seed=seed,
        structured_outputs=constraint,
        **params,
    )
    return runtime.handle_request(GenerationRequest(list(prompt), params)).result()


def test_json_schema_outputs_validate(runtime):
    for seed in range(4):
        out = _run(runtime, StructuredOutputs(json=SCHEMA), seed)
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    # Any object: random weights write keys past max_tokens in about seven runs of eight;
    # every completed one parses.
    objects = [_run(runtime, {"json_object": True}, seed) for seed in range(16)]
    completed = [json.loads(o.text) for o in objects if o.finish_reason == "stop"]
    assert completed and all(isinstance(o, dict) for o in completed)
    assert_no_leaks(runtime)


@pytest.mark.parametrize(
    ("constraint", "member"),
    [
        ({"regex": "[0-9]{3}-[a-z]{2,4}"}, lambda s: re.fullmatch("[0-9]{3}-[a-z]{2,4}", s)),
        ({"choice": ["red", "green", "blue"]}, lambda s: s in ("red", "green", "blue")),
        ({"grammar": GRAMMAR}, lambda s: re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", s)),
    ],
    ids=["regex", "choice", "grammar"],
)
def test_outputs_are_strings_of_the_language(runtime, constraint, member):
    for seed in range(6):
        out = _run(runtime, constraint, seed)
        assert out.finish_reason == "stop" and member(out.text), out.text


def test_a_constrained_row_is_the_same_alone_and_in_a_changing_batch(runtime):
    """Its mask is its own: rows that join and leave around it change nothing."""
    constrained = [
        GenerationRequest(
            [9, 10 + i],
            SamplingParams(
                max_tokens=120, temperature=1.0, seed=i, structured_outputs={"json": SCHEMA}
            ),
        )
        for i in range(3)
    ]
    free = [
        GenerationRequest(
            list(range(20, 60 + 10 * i)), SamplingParams(max_tokens=10 + 7 * i, temperature=0)
        )
        for i in range(4)
    ]
    alone = [runtime.handle_request(r).result() for r in constrained + free]
    session = runtime.new_session()
    order = [free[0], constrained[0], free[1], free[2], constrained[1], free[3], constrained[2]]
    refs, outputs, step = {}, {}, 0
    while order or session.residents():
        if order and step % 2 == 0:
            request = order.pop(0)
            refs[session.admit(request).ref] = request
        for ref, snapshot in session.step().finished.items():
            outputs[id(refs.pop(ref))] = materialize([snapshot])
        step += 1
    session.finish()
    batched = [outputs[id(r)] for r in constrained + free]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    assert_no_leaks(runtime)


def test_with_stop_strings_logprobs_chunked_prefill_and_the_cache(runtime):
    long_prompt = [5 + i % 200 for i in range(150)]  # prefilled in chunks of <= 64 tokens
    plain = _run(runtime, {"json": SCHEMA}, 3, prompt=long_prompt, logprobs=2)
    assert plain.finish_reason == "stop"
    assert [e.token_id for e in plain.logprobs] == list(plain.token_ids)
    again = _run(runtime, {"json": SCHEMA}, 3, prompt=long_prompt, logprobs=2)
    assert again.cached_tokens > 0 and again.token_ids == plain.token_ids
    cut = plain.text[: plain.text.index('"age"')]
    stopped = _run(runtime, {"json": SCHEMA}, 3, prompt=long_prompt, stop=['"age"'])
    assert stopped.text == cut and stopped.stop_reason == '"age"'
    assert_no_leaks(runtime)


def test_overlapped_steps_give_the_same_constrained_outputs(tiny_dirs, runtime):
    overlapped = Runtime(
        tiny_dirs["qwen2"],
        DeploymentOptions(max_batch_size=8, max_model_len=512, max_num_tokens=64, overlap=True),
    )
    requests = [
        GenerationRequest([7, 8], SamplingParams(max_tokens=30, temperature=0)),
        GenerationRequest(
            [7, 9],
            SamplingParams(
                max_tokens=80, temperature=1.0, seed=4, structured_outputs={"json": SCHEMA}
            ),
        ),
        GenerationRequest([7, 10], SamplingParams(max_tokens=40, temperature=0.7, seed=2)),
    ]
    want = [runtime.handle_request(r).result().token_ids for r in requests]
    session = overlapped.new_session()
    refs = {session.admit(r).ref: i for i, r in enumerate(requests)}
    got = {}
    while session.residents():
        for ref, snapshot in session.step().finished.items():
            got[refs[ref]] = snapshot.token_ids
    session.finish()
    assert [tuple(got[i]) for i in range(3)] == want
    assert_no_leaks(overlapped)


@pytest.mark.parametrize(
    ("constraint", "needle"),
    [
        ({"json": {"type": "foo"}}, "json does not compile"),
        ({"json": "{not json"}, "json does not compile"),
        ({"regex": "[a-"}, "regex does not compile"),
        ({"grammar": "start: undefined_rule"}, "grammar does not compile"),
        ({"regex": r"[^\s\S]"}, "regex does not compile: it matches no string"),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_when_checked(runtime, constraint, needle):
    request = GenerationRequest([5], SamplingParams(structured_outputs=constraint))
    with pytest.raises(RequestFieldError, match=needle) as refused:
        runtime.check(request)
    assert refused.value.field == "structured_outputs"
    assert_no_leaks(runtime)


@pytest.mark.parametrize(
    "spec",
    [{}, {"json": {}, "regex": "a"}, {"choice": []}, {"regex": ""}, {"yaml": "x"}],
)
def test_a_malformed_constraint_is_a_value_error(spec):
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs=spec)

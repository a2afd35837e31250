"""BatchCompatibility: every request field is compared or explicitly exempt."""

import pytest

from inflight.engine.compatibility import (
    BATCH_FIELDS,
    OPTION_RULED_FIELDS,
    PAYLOAD_FIELDS,
    BatchCompatibility,
    request_fields,
)
from inflight.protocol.options import OPTION_FIELDS
from inflight.protocol.request import GenerationRequest, SamplingParams
from inflight.runtime.deployment import PER_ROW_FIELDS

DIFFERENT = {
    "params.temperature": {"temperature": 0.11},
    "params.top_p": {"top_p": 0.5},
    "params.top_k": {"top_k": 5},
    "params.min_p": {"min_p": 0.1},
    "params.presence_penalty": {"presence_penalty": 0.5},
    "params.frequency_penalty": {"frequency_penalty": -0.5},
    "params.repetition_penalty": {"repetition_penalty": 1.2},
    "params.seed": {"seed": 7},
    "params.max_tokens": {"max_tokens": 9},
    "params.logprobs": {"logprobs": 2},
    "params.prompt_logprobs": {"prompt_logprobs": 1},
    "params.skip_special_tokens": {"skip_special_tokens": False},
    "params.ignore_eos": {"ignore_eos": True},
    "params.reuse_context": {"reuse_context": False},
    "params.cache_generated_tokens": {"cache_generated_tokens": False},
    "params.structured_outputs": {"structured_outputs": {"choice": ["yes", "no"]}},
    "params.n": {"n": 2},
    "params.speculative": {"speculative": False},
}


def _request(params=None, **kw):
    return GenerationRequest([1, 2, 3], SamplingParams(**(params or {})), **kw)


def test_every_field_is_in_exactly_one_list():
    lists = [PAYLOAD_FIELDS, set(BATCH_FIELDS), OPTION_RULED_FIELDS]
    assert set().union(*lists) == request_fields(), "a request field is in no list"
    assert sum(len(x) for x in lists) == len(request_fields()), "a field is in two lists"


def test_identical_requests_are_compatible():
    assert BatchCompatibility().compatible(_request(), _request())


@pytest.mark.parametrize("name", [f for f in BATCH_FIELDS if f.startswith("params.")])
def test_each_compared_sampling_field_blocks_and_is_named(name):
    compat = BatchCompatibility()
    a, b = _request(), _request(DIFFERENT[name])
    assert compat.first_difference(a, b) == name
    assert compat.first_difference(b, a) == name  # symmetric
    assert compat.compatible(b, b)  # reflexive


def test_request_level_compared_fields_block():
    compat = BatchCompatibility()
    assert compat.first_difference(_request(), _request(lora_name="x")) == "lora_name"


def test_seed_values_do_not_block_but_having_a_seed_does():
    compat = BatchCompatibility()
    assert compat.compatible(_request({"seed": 1}), _request({"seed": 2}))
    assert not compat.compatible(_request({"seed": 1}), _request())


def test_payload_never_blocks():
    compat = BatchCompatibility()
    a = GenerationRequest([1, 2], SamplingParams(stop=["x"], logit_bias={1: 2.0}))
    b = GenerationRequest([3, 4, 5], SamplingParams(stop_token_ids=[7]))
    assert compat.compatible(a, b)


def test_fields_the_runtime_applies_per_row_are_exempt():
    compat = BatchCompatibility(PER_ROW_FIELDS)
    assert compat.compared == (
        "lora_name",
        "save_system_prompt_kv_cache",
        "speech",
        "generate_audio",
        "diffusion",
    )
    for change in DIFFERENT.values():
        assert compat.compatible(_request(), _request(change))


def test_unknown_per_row_field_is_an_error():
    with pytest.raises(ValueError, match="params.nope"):
        BatchCompatibility(frozenset({"params.nope"}))


def test_every_request_option_is_compared_or_ruled_by_the_options_table():
    """An option no runtime serves is refused when checked (the options table), never compared
    as well; every other option is compared unless the runtime applies it per row."""
    assert OPTION_RULED_FIELDS <= OPTION_FIELDS
    assert not OPTION_RULED_FIELDS & set(BATCH_FIELDS)
    assert OPTION_RULED_FIELDS | set(BATCH_FIELDS) >= OPTION_FIELDS

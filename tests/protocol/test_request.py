"""SamplingParams validation: bad values raise ValueError naming the field."""

import pytest

from inflight.protocol.request import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"frequency_penalty": float("inf")}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"seed": "x"}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {i: 1 for i in range(1025)}}, "logit_bias"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=[7], logit_bias={"3": -5})
    assert p.stop == ("###",) and p.stop_token_ids == (7,) and p.logit_bias == {3: -5.0}
    assert SamplingParams(temperature=0).greedy

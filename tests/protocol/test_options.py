"""The options table: one place says what a runtime that does not serve an option tells."""

import pytest

from inflight.protocol.options import OPTION_FIELDS, REQUEST_OPTIONS, check_runtime_serves
from inflight.protocol.request import (
    AudioReply,
    DiffusionParams,
    GenerationRequest,
    RequestFieldError,
    SpeechParams,
)

ASKING = {
    "lora_name": "adapter",
    "generate_audio": AudioReply("ethan"),
    "save_system_prompt_kv_cache": True,
    "past_trajectory": [1],
    "speech": SpeechParams(voice="vivian"),
    "diffusion": DiffusionParams(max_denoising_steps=8),
}


def test_every_option_of_a_request_is_in_the_table():
    assert set(ASKING) == OPTION_FIELDS
    plain = GenerationRequest([1])
    assert all(getattr(plain, o.field) == o.default for o in REQUEST_OPTIONS)
    check_runtime_serves(plain, frozenset())


@pytest.mark.parametrize("option", REQUEST_OPTIONS, ids=lambda o: o.field)
def test_an_option_not_served_is_refused_naming_it_and_its_alternative(option):
    request = GenerationRequest([1], **{option.field: ASKING[option.field]})
    with pytest.raises(RequestFieldError) as refused:
        check_runtime_serves(request, frozenset())
    assert refused.value.field == option.field
    message = str(refused.value)
    assert message.startswith(option.what) and option.alternative in message
    check_runtime_serves(request, frozenset({option.field}))

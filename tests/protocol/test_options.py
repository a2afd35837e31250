"""The options table: one place says where each request option is served or refused."""

import pytest

from inflight.engine import EngineConfig, RequestEngine
from inflight.protocol.options import (
    OPTION_FIELDS,
    REQUEST_OPTIONS,
    UnderIFB,
    check_runtime_serves,
    submit_refusal,
)
from inflight.protocol.request import GenerationRequest, RequestFieldError

from fake_execution import FakeFactory

ASKING = {
    "lora_name": "adapter",
    "generate_audio": True,
    "save_system_prompt_kv_cache": True,
    "past_trajectory": [1],
}


def test_every_option_of_a_request_is_in_the_table():
    assert set(ASKING) == OPTION_FIELDS
    plain = GenerationRequest([1])
    assert all(getattr(plain, o.field) == o.default for o in REQUEST_OPTIONS)


@pytest.mark.parametrize("option", REQUEST_OPTIONS, ids=lambda o: o.field)
def test_each_option_is_refused_or_waits_where_the_table_says(option):
    request = GenerationRequest([1], **{option.field: ASKING[option.field]})
    engine = RequestEngine(FakeFactory(), EngineConfig(idle_wait=0.01))
    try:
        if option.under_ifb is UnderIFB.REFUSED:
            with pytest.raises(ValueError) as refused:
                engine.submit(request)
            assert option.what in str(refused.value)
            assert option.ifb_alternative in str(refused.value)
            assert submit_refusal(request).startswith(option.what)
        else:
            assert submit_refusal(request) is None
    finally:
        engine.shutdown()
    if option.runtime_alternative is None:
        check_runtime_serves(request, frozenset())
    else:
        with pytest.raises(RequestFieldError, match="not supported by this runtime") as caught:
            check_runtime_serves(request, frozenset())
        assert caught.value.field == option.field
        assert option.runtime_alternative in str(caught.value)

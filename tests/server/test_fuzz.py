"""Schema fuzzing: whatever the body, the server answers with a status below 500."""

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_harness import serve

pytestmark = pytest.mark.slow

MODEL = "test-model"

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)
names = st.one_of(st.sampled_from(["get_weather", "get_time"]), st.text(max_size=6))
tool_call = st.fixed_dictionaries(
    {
        "id": st.one_of(st.text(max_size=6), values),
        "function": st.fixed_dictionaries(
            {"name": names, "arguments": st.one_of(st.just('{"city": "Paris"}'), values)}
        ),
    },
    optional={"type": st.one_of(st.just("function"), values)},
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant", "tool", "nobody", 3]),
        "content": st.one_of(st.text(max_size=30), values),
    },
    optional={
        "tool_calls": st.one_of(st.lists(tool_call, max_size=2), values),
        "tool_call_id": st.one_of(st.text(max_size=6), values),
    },
)
tool = st.fixed_dictionaries(
    {
        "type": st.one_of(st.just("function"), values),
        "function": st.fixed_dictionaries(
            {"name": names},
            optional={
                "parameters": st.one_of(
                    st.just({"type": "object", "properties": {"city": {"type": "string"}}}),
                    values,
                ),
                "description": values,
            },
        ),
    }
)
tool_choice = st.one_of(
    st.sampled_from(["none", "auto", "required"]),
    st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": names})}
    ),
    values,
)
# Always a small (or invalid) limit: a valid body then generates a few tokens at most.
small_tokens = st.one_of(st.integers(min_value=-2, max_value=4), st.text(max_size=2))
common = {
    "model": st.one_of(st.just(MODEL), st.text(max_size=5), st.none()),
    "temperature": st.one_of(st.none(), st.floats(min_value=-1, max_value=3), st.text(max_size=3)),
    "top_p": st.one_of(st.none(), st.floats(min_value=-0.5, max_value=1.5)),
    "top_k": st.one_of(st.none(), st.integers(min_value=-3, max_value=100)),
    "stop": st.one_of(st.none(), st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3)),
    "seed": st.one_of(st.none(), st.integers(min_value=-(2**70), max_value=2**70)),
    "logit_bias": st.one_of(st.none(), st.dictionaries(st.text(max_size=6), values, max_size=3)),
    "n": st.one_of(st.none(), st.integers(min_value=-1, max_value=3)),
    "stream": st.one_of(st.booleans(), values),
    "extra_field": values,
}
chat_body = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(message, max_size=3), values), "max_tokens": small_tokens},
    optional={
        **common,
        "logprobs": values,
        "top_logprobs": values,
        "max_completion_tokens": small_tokens,
        "response_format": values,
        "tools": st.one_of(st.lists(tool, max_size=2), values),
        "tool_choice": tool_choice,
        "parallel_tool_calls": values,
        "chat_template_kwargs": values,
    },
)
completion_body = st.fixed_dictionaries(
    {
        "prompt": st.one_of(
            st.text(max_size=30), st.lists(st.integers(-5, 60000), max_size=6), values
        )
    },
    optional={**common, "echo": values, "logprobs": values, "suffix": values},
)


@pytest.fixture(scope="module")
def url(server_llm):
    # With both parsers, so that replies go through them too.
    with serve(
        server_llm, max_queued_requests=8, tool_call_parser="hermes", reasoning_parser="qwen3"
    ) as (base, _):
        yield base


def _post(url, path, body):
    try:
        r = httpx.post(url + path, json=body, timeout=120)
    except (TypeError, ValueError):  # not JSON-serialisable (NaN is allowed): nothing to send
        return
    assert r.status_code < 500, (body, r.status_code, r.text)
    if r.status_code >= 400:
        assert r.json()["error"]["message"]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=chat_body)
def test_chat_completions_never_500(url, body):
    body.pop("stream", None)  # streamed bodies fuzz the same validation; keep runs short
    _post(url, "/v1/chat/completions", body)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=completion_body)
def test_completions_never_500(url, body):
    body.pop("stream", None)
    _post(url, "/v1/completions", body)

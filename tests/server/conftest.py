"""Fixtures of the server tests: a real server on the session's `server_llm` for a module
(`handle`), and the official clients on it. Modules that serve with options of their own
define their own `oa`."""

import anthropic
import openai
import pytest

from server_harness import running


@pytest.fixture(scope="module")
def handle(server_llm):
    with running(server_llm) as handle:
        yield handle


@pytest.fixture
def oa(handle):
    return openai.OpenAI(base_url=handle.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def claude(handle):
    return anthropic.Anthropic(base_url=handle.url, api_key="unused", max_retries=0)

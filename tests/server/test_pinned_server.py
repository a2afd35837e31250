"""Pinned system prompts over a real server: the body field `save_system_prompt_kv_cache` on
chat completions, completions and Anthropic messages (the official clients' `extra_body`), the
pins listed and unpinned over HTTP, counted in `/metrics`, the bound's refusal a 400; and
`--warmup-prompts`, during which `/health/ready` answers 503 with its progress."""

import json
import threading
import time

import anthropic
import httpx
import openai
import pytest

from inflight import LLM

from server_harness import serve

pytestmark = pytest.mark.slow

MODEL = "test-model"
SYSTEM = "You are a careful assistant who answers in one short sentence. " * 4
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."}]
PIN = {"save_system_prompt_kv_cache": True}


@pytest.fixture(scope="module")
def llm(tiny_dirs):
    options = dict(quantization="none", enable_in_flight_batching=True, max_batch_size=4)
    with LLM(tiny_dirs["llama"], max_model_len=512, max_pinned_prefix_tokens=320, **options) as llm:
        yield llm


def test_the_field_pins_on_every_api_and_the_pins_are_listed_and_unpinned(llm):
    with serve(llm) as (url, _):
        oa = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        oa.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, extra_body=PIN)
        pins = httpx.get(url + "/v1/pinned_prefixes").json()["data"]
        assert len(pins) == 1 and pins[0]["tokens"] >= 64
        # The same system prompt through Anthropic's messages: the same pin, now hit.
        client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        client.messages.create(
            model=MODEL, system=SYSTEM, messages=CHAT[1:], max_tokens=2, extra_body=PIN
        )
        text = "Reference: " + " ".join(f"item {i}" for i in range(10))
        oa.completions.create(model=MODEL, prompt=text, max_tokens=2, extra_body=PIN)
        pins = httpx.get(url + "/v1/pinned_prefixes").json()["data"]
        assert len(pins) == 2 and pins[0]["hit_tokens"] == pins[0]["tokens"]
        scraped = httpx.get(url + "/metrics").text
        blocks = sum(pin["tokens"] for pin in pins) // 16
        assert f"inflight_context_cache_pinned_blocks {blocks}.0" in scraped
        assert "inflight_context_cache_pinned_prefixes 2.0" in scraped
        for pin in pins:
            assert httpx.delete(url + f"/v1/pinned_prefixes/{pin['id']}").status_code == 200
        gone = httpx.delete(url + f"/v1/pinned_prefixes/{pins[0]['id']}")
        assert gone.status_code == 404 and "no pinned prefix" in gone.json()["error"]["message"]
        assert httpx.get(url + "/v1/pinned_prefixes").json()["data"] == []
        # Past the bound (320 tokens): a 400 naming it.
        long = [{"role": "system", "content": SYSTEM * 2}, CHAT[1]]
        with pytest.raises(openai.BadRequestError, match="max_pinned_prefix_tokens"):
            oa.chat.completions.create(model=MODEL, messages=long, max_tokens=2, extra_body=PIN)


def test_ready_waits_for_the_warm_up(llm, monkeypatch):
    """The server listens while it warms up; /health/ready is 503 with the progress until
    both prompts are pinned, then 200."""
    gate = threading.Event()
    warm_up = LLM.warm_up

    def gated(self, prompts, progress=None):
        gate.wait(30)
        return warm_up(self, prompts, progress)

    monkeypatch.setattr(LLM, "warm_up", gated)
    prompts = [CHAT, "Reference: " + " ".join(f"entry {i}" for i in range(10))]
    with serve(llm, warmup_prompts=prompts) as (url, _):
        waiting = httpx.get(url + "/health/ready")
        assert waiting.status_code == 503
        assert waiting.json() == {"status": "warming_up", "done": 0, "total": 2}
        gate.set()
        deadline = time.monotonic() + 30
        while httpx.get(url + "/health/ready").status_code != 200:
            assert time.monotonic() < deadline, "the warm-up did not finish"
            time.sleep(0.05)
        pins = httpx.get(url + "/v1/pinned_prefixes").json()["data"]
        assert len(pins) == 2
        for pin in pins:
            httpx.delete(url + f"/v1/pinned_prefixes/{pin['id']}")


def test_a_warm_up_file_is_read_and_a_bad_one_stops_the_start(tmp_path, tiny_dirs):
    from inflight.server.cli import main
    from inflight.server.warmup import read_warmup_prompts

    good = tmp_path / "warm.json"
    good.write_text(json.dumps([CHAT, "a text prompt"]))
    assert read_warmup_prompts(good) == [CHAT, "a text prompt"]
    for text, problem in (("{", "Expecting"), ('{"a": 1}', "a JSON list"), ("[3]", "a JSON list")):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(ValueError, match=problem):
            read_warmup_prompts(bad)
    # A conversation without a system message cannot pin one: refused before serving.
    no_system = tmp_path / "no_system.json"
    no_system.write_text(json.dumps([CHAT[1:]]))
    argv = ["serve", str(tiny_dirs["llama"]), "--warmup-prompts", str(no_system)]
    assert main([*argv, "--max-model-len", "256", "--quantization", "none"]) == 2

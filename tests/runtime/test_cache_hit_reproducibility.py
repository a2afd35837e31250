"""A request's tokens and logprobs do not depend on whether its prompt's prefix came from the
context cache (DESIGN invariant 10, across cache hits): the same seeded and greedy chats, first
computed whole (the cache bypassed), then hitting it, bit for bit, in the default quantization
(the GGUF's Q4_1 layers in the 4-bit kernel) and in float32, under in-flight batching."""

from dataclasses import replace
from functools import partial

import pytest

from inflight import LLM, SamplingParams

from helpers import assert_no_leaks

# Chat prompts of 35 and 33 tokens: 3 and 1 computed after the 32 cached ones on a hit.
WORD = [{"role": "user", "content": "Write a random word."}]
SHORT = [{"role": "user", "content": "Random word."}]
PARAMS = {
    "seeded": SamplingParams(temperature=1.0, seed=1234, max_tokens=32, logprobs=2),
    "greedy": SamplingParams(temperature=0.0, max_tokens=32, logprobs=2),
}


@pytest.fixture(scope="module", params=["auto", "none"])
def cached_llm(request):
    """The default model under in-flight batching with the context cache on, by quantization."""
    if request.param == "auto":
        yield request.getfixturevalue("ifb_llm")
        return
    instance = LLM(
        enable_in_flight_batching=True, max_batch_size=4, max_model_len=1024, quantization="none"
    )
    yield instance
    instance.close()


def _cold_then_hit(run, params, cached):
    """`run(params)` computed whole (its blocks published for the next run), then reading its
    first `cached` tokens from the cache."""
    cold = run(replace(params, reuse_context=False))[0]
    hit = run(params)[0]
    assert cold.cached_tokens == 0 and hit.cached_tokens == cached
    assert hit.outputs[0].token_ids == cold.outputs[0].token_ids
    assert hit.outputs[0].logprobs == cold.outputs[0].logprobs


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(PARAMS))
@pytest.mark.parametrize("messages", [WORD, SHORT], ids=["3 new", "1 new"])
def test_a_cache_hit_gives_the_tokens_of_the_whole_prompt(cached_llm, kind, messages):
    _cold_then_hit(partial(cached_llm.chat, messages), PARAMS[kind], cached=32)
    assert_no_leaks(cached_llm)


@pytest.mark.slow
def test_a_next_turn_reads_the_blocks_the_reply_decoded(cached_llm):
    """A prompt holding a reply after its chat reads the KV blocks the reply's decode steps wrote
    (4 blocks: the chat's 35 tokens and 29 of the reply's 32), where computed whole it takes
    them as prefill rows."""
    tok = cached_llm.tokenizer
    chat = tok.encode(tok.apply_chat_template(WORD), add_special_tokens=False)
    params = replace(PARAMS["greedy"], ignore_eos=True)
    reply = cached_llm.generate({"prompt_token_ids": chat}, params)[0].outputs[0].token_ids
    turn = [*chat, *reply, *tok.encode("\nAnother one:", add_special_tokens=False)]
    _cold_then_hit(partial(cached_llm.generate, {"prompt_token_ids": turn}), params, cached=64)
    assert_no_leaks(cached_llm)

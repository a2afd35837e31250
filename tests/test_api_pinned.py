"""Pinned system prompts (`save_system_prompt_kv_cache`) and warm-up prompts through `LLM`, on a
tiny random Llama: a pinned prefix outlives a workload that evicts every other block, later
requests with it prefill only their own tokens, the bound on pins refuses with a message,
`unpin` lets go, and greedy output is the same with and without the pin."""

import random

import pytest

from inflight import LLM, SamplingParams

SYSTEM = "You are a careful assistant who answers in one short sentence. " * 4
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."}]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
# A pool of 48 blocks of 16 tokens: the filler's 300-token prompts evict everything unpinned.
OPTIONS = dict(
    quantization="none",
    enable_in_flight_batching=True,
    max_batch_size=4,
    max_model_len=512,
    num_kv_blocks=48,
    max_pinned_prefix_tokens=256,
)


def _evict_everything(llm: LLM, seed: int = 0) -> None:
    rng = random.Random(seed)
    for _ in range(4):
        prompt = [rng.randrange(3, 300) for _ in range(300)]
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2))


def _system_tokens(llm: LLM) -> int:
    """Tokens of the system turn, as the template renders it alone (in full blocks)."""
    text = llm.tokenizer.apply_chat_template(CHAT[:1], add_generation_prompt=False)
    return len(llm.tokenizer.encode(text, add_special_tokens=False)) // 16 * 16


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "not pinned"])
def test_a_pinned_system_prompt_outlives_a_workload_that_evicts_the_rest(tiny_dirs, pinned):
    """The same workload on two LLMs, one pinning the system prompt: afterwards a new question
    under that system prompt finds all of its full blocks in the cache with the pin (and the
    hit is counted as a pinned one), none without; its greedy tokens are the same either
    way."""
    with LLM(tiny_dirs["llama"], **OPTIONS) as llm:
        first = llm.chat(CHAT, GREEDY, save_system_prompt_kv_cache=pinned)[0]
        assert first.cached_tokens == 0
        _evict_everything(llm)
        assert llm.get_context_cache_metrics()["evictions"] > 0
        later = [CHAT[0], {"role": "user", "content": "Name a fruit."}]
        again = llm.chat(later, GREEDY)[0]
        system = _system_tokens(llm)
        assert system >= 64
        assert again.cached_tokens == (system if pinned else 0)
        metrics = llm.get_context_cache_metrics()
        assert metrics["pinned_hit_tokens"] == (system if pinned else 0)
        assert metrics["pinned_prefixes"] == int(pinned)
        (pin,) = llm.pinned_prefixes() if pinned else [{"tokens": system, "hit_tokens": system}]
        assert (pin["tokens"], pin["hit_tokens"]) == (system, system)
        outputs = (first.token_ids, again.token_ids)
    with LLM(tiny_dirs["llama"], **{**OPTIONS, "enable_context_reuse": False}) as fresh:
        assert outputs == tuple(fresh.chat(c, GREEDY)[0].token_ids for c in (CHAT, later))


def test_a_pinned_request_joins_a_running_batch_and_unpin_lets_go(tiny_dirs):
    with LLM(tiny_dirs["llama"], **OPTIONS) as llm:
        long = llm.generate_stream(
            {"prompt_token_ids": list(range(3, 40))},
            SamplingParams(max_tokens=200, ignore_eos=True),
        )
        next(iter(long))  # it is generating
        llm.chat(CHAT, GREEDY, save_system_prompt_kv_cache=True)
        assert llm.get_scheduling_metrics()["admitted_mid_flight"] >= 1
        (pin,) = llm.pinned_prefixes()
        # Pinning it again takes nothing more.
        llm.chat(CHAT, GREEDY, save_system_prompt_kv_cache=True)
        assert llm.pinned_prefixes() == [{**pin, "hit_tokens": pin["tokens"]}]
        long.cancel()
        llm.unpin(pin["id"])
        assert llm.pinned_prefixes() == []
        with pytest.raises(ValueError, match="no pinned prefix has id"):
            llm.unpin(pin["id"])
        _evict_everything(llm)
        assert llm.get_context_cache_metrics()["pinned_blocks"] == 0
        assert llm.chat(CHAT, GREEDY)[0].cached_tokens == 0


def test_the_bound_on_pins_refuses_naming_it(tiny_dirs):
    """A system prompt longer than the bound is refused when prepared; one that fits alone
    but not beside the pins held is refused at admission, naming how to make room; after an
    unpin it is served."""
    with LLM(tiny_dirs["llama"], **{**OPTIONS, "max_pinned_prefix_tokens": 160}) as llm:
        with pytest.raises(ValueError, match=r"exceed max_pinned_prefix_tokens.*160 tokens"):
            llm.chat(CHAT, GREEDY, save_system_prompt_kv_cache=True)
        prompts = [" ".join(f"{word} {i}" for i in range(15)) for word in ("apple", "pear")]
        llm.generate(prompts[0], GREEDY, save_system_prompt_kv_cache=True)
        with pytest.raises(ValueError, match=r"would pass max_pinned_prefix_tokens.*unpin"):
            llm.generate(prompts[1], GREEDY, save_system_prompt_kv_cache=True)
        llm.unpin(llm.pinned_prefixes()[0]["id"])
        llm.generate(prompts[1], GREEDY, save_system_prompt_kv_cache=True)
        assert len(llm.pinned_prefixes()) == 1
        with pytest.raises(ValueError, match="opens with no system message"):
            llm.chat(CHAT[1:], GREEDY, save_system_prompt_kv_cache=True)


@pytest.mark.parametrize("ifb", [True, False], ids=["in-flight", "blocking"])
def test_warm_up_prompts_are_pinned_before_the_llm_returns(tiny_dirs, ifb):
    text = "Reference: " + " ".join(f"item {i}" for i in range(10))
    options = {**OPTIONS, "enable_in_flight_batching": ifb, "max_pinned_prefix_tokens": 320}
    with LLM(tiny_dirs["llama"], warmup_prompts=[CHAT, text], **options) as llm:
        pins = llm.pinned_prefixes()
        assert [pin["tokens"] for pin in pins][0] == _system_tokens(llm)
        assert len(pins) == 2 and pins[1]["tokens"] >= 32
        _evict_everything(llm)
        assert llm.generate(text + " and more", GREEDY)[0].cached_tokens == pins[1]["tokens"]

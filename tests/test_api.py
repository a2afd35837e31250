"""The Python API on the blocking path, on the embedded default model."""

import json

import pytest

from inflight import LLM, SamplingParams
from inflight.engine import RequestCancelled

from helpers import assert_no_leaks, wait_for_outcome

GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.mark.slow
def test_generate_string_list_and_chat(llm):
    tok = llm.tokenizer
    one = llm.generate("The capital of France is", GREEDY)
    assert len(one) == 1 and one[0].text and one[0].finish_reason in ("stop", "length")
    assert one[0].prompt_tokens == len(tok.encode("The capital of France is"))
    many = llm.generate(["The capital of France is", "1, 2, 3,"], GREEDY)
    assert many[0].token_ids == one[0].token_ids
    assert len(many) == 2 and many[1].text != many[0].text
    messages = [{"role": "user", "content": "Name a color."}]
    chat = llm.chat(messages, GREEDY)
    rendered = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    same = llm.generate({"prompt_token_ids": rendered}, GREEDY)
    assert chat[0].token_ids == same[0].token_ids
    assert chat[0].prompt_tokens == len(rendered)
    assert llm.generate([messages], GREEDY)[0].token_ids == chat[0].token_ids
    assert_no_leaks(llm)


@pytest.mark.slow
def test_stream_concatenates_to_the_same_text(llm):
    params = SamplingParams(temperature=0, max_tokens=30, logprobs=1)
    full = llm.generate("Once upon a time", params)[0]
    deltas = list(llm.generate_stream("Once upon a time", params))
    assert "".join(d.text for d in deltas) == full.text
    assert tuple(t for d in deltas for t in d.token_ids) == full.token_ids
    assert deltas[-1].finished and deltas[-1].finish_reason == full.finish_reason
    assert not any(d.finished for d in deltas[:-1])
    assert [e.token_id for d in deltas for e in (d.logprobs or ())] == list(full.token_ids)


@pytest.mark.slow
def test_closing_a_stream_cancels_and_frees(llm):
    stream = llm.generate_stream(
        "Tell me a long story.", SamplingParams(max_tokens=200, ignore_eos=True)
    )
    next(stream)
    next(stream)
    stream.close()
    # The engine retires the cancelled request at its next step, freeing its KV first.
    wait_for_outcome(stream)
    with pytest.raises(RequestCancelled):
        stream.get()
    assert_no_leaks(llm)
    assert llm.generate("Hi", SamplingParams(max_tokens=2))[0].token_ids


@pytest.mark.slow
def test_stop_string_spanning_tokens_in_generation(llm):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    free = llm.generate("The three primary colors are", params)[0]
    tok = llm.tokenizer
    pieces = [tok.decode([t]) for t in free.token_ids]
    # A stop string made of the end of one token and the start of the next.
    i = next(i for i in range(3, len(pieces) - 1) if len(pieces[i]) > 1 and len(pieces[i + 1]) > 1)
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    cut = free.text.index(stop)
    stopped = llm.generate(
        "The three primary colors are",
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]),
    )[0]
    assert stopped.text == free.text[:cut]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop


@pytest.mark.slow
def test_min_tokens_holds_off_eos_and_stop_strings(llm):
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    free = llm.chat(chat, SamplingParams(temperature=0, max_tokens=200))[0]
    assert free.finish_reason == "stop" and free.stop_reason is None  # it ends with EOS
    least = len(free.token_ids) + 8
    # What the first `least` tokens must be: the greedy ones with EOS biased out.
    no_eos = {t: -100 for t in llm.tokenizer.eos_token_ids}
    ref = llm.chat(chat, SamplingParams(temperature=0, max_tokens=least, logit_bias=no_eos))[0]
    held = llm.chat(chat, SamplingParams(temperature=0, max_tokens=400, min_tokens=least))[0]
    assert held.token_ids[:least] == ref.token_ids and len(held.token_ids) > least
    # A stop string in the text of those tokens ends nothing before them.
    word = free.text.split()[1]
    stopped = llm.chat(
        chat, SamplingParams(temperature=0, max_tokens=400, min_tokens=least, stop=[word])
    )[0]
    assert len(stopped.token_ids) > least and stopped.text.startswith(ref.text)
    assert stopped.text.count(word) == ref.text.count(word)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda llm: llm.generate(""), "prompt is empty"),
        (lambda llm: llm.generate("word " * 1100, SamplingParams(max_tokens=4)), "max_model_len"),
        (lambda llm: llm.generate("hi", SamplingParams(max_tokens=0)), "max_tokens"),
        (lambda llm: llm.generate("hi", SamplingParams(top_p=1.5)), "top_p"),
        (lambda llm: llm.generate("hi", SamplingParams(temperature=-1)), "temperature"),
        (lambda llm: llm.generate("hi", SamplingParams(max_tokens=2, min_tokens=3)), "min_tokens"),
        (
            lambda llm: llm.generate(
                "hi", SamplingParams(min_tokens=3, structured_outputs={"regex": "a+"})
            ),
            "min_tokens with structured_outputs",
        ),
        (lambda llm: llm.generate(42), "prompts"),
        (lambda llm: llm.chat([]), "messages"),
        (lambda llm: llm.generate(["a", "b"], [GREEDY]), "SamplingParams"),
    ],
)
def test_bad_input_raises_value_error_and_llm_stays_usable(llm, call, needle):
    with pytest.raises(ValueError, match=needle):
        call(llm)
    assert_no_leaks(llm)
    assert llm.generate("Hi", SamplingParams(max_tokens=1))[0].token_ids


def test_unknown_architecture_and_missing_path(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"]}))
    with pytest.raises(ValueError, match="FooForCausalLM"):
        LLM(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        LLM(tmp_path / "nope.gguf")
    with pytest.raises(ValueError, match="max_batch_size"):
        LLM(tmp_path, max_batch_size=0)
    with pytest.raises(
        ValueError, match="quantization must be one of auto, none, int8, q4, fp8, got 'q3'"
    ):
        LLM(tmp_path, quantization="q3")


def test_closed_llm_refuses(tiny_dirs):
    llm = LLM(tiny_dirs["llama"], max_model_len=64)
    assert llm.generate("hi", SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids
    llm.close()
    llm.close()
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate("hi")

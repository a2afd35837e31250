"""The default model's tokenizer, built from GGUF metadata, against transformers' reading of it."""

import pytest
from transformers import AutoTokenizer

from inflight.model.checkpoints.loader import default_model_path, open_checkpoint

TEXTS = [
    "Hello world",
    "  leading spaces and\ttabs\nnewlines\n\n",
    "café, naïve, 日本語, emoji 🎉",
    "<|im_start|>user\nhi<|im_end|>",
    "def f(x):\n    return x ** 2  # comment",
]


@pytest.fixture(scope="module")
def ours():
    return open_checkpoint().tokenizer


@pytest.fixture(scope="module")
def theirs():
    path = default_model_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_encoding_matches_transformers(ours, theirs, text):
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(
        text, add_special_tokens=False
    )
    ids = ours.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=False) == text


def test_digits_split_one_by_one_like_llama_cpp(ours):
    # llama.cpp's "smollm" pre-tokenizer isolates every digit.
    ids = ours.encode("2024", add_special_tokens=False)
    assert [ours.decode([i]) for i in ids] == ["2", "0", "2", "4"]


def test_chat_template_matches_transformers(ours, theirs):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
    ]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_special_tokens(ours):
    assert ours.eos_token_ids == [2]
    assert ours.decode(ours.encode("<|im_end|>x", add_special_tokens=False)) == "x"
    assert ours.token_bytes(ours.encode(" caf", add_special_tokens=False)[0]) == b" caf"

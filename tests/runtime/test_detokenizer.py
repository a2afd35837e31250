"""Incremental detokenization and stop strings on the default model's tokenizer."""

import pytest

from inflight.model.checkpoints.loader import open_checkpoint
from inflight.runtime.host.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok():
    return open_checkpoint().tokenizer


def _feed(tok, text, stop=(), include_stop=False, prompt="Say:"):
    prompt_ids = tuple(tok.encode(prompt))
    detok = IncrementalDetokenizer(tok, prompt_ids, True, tuple(stop), include_stop)
    pieces, matched = [], None
    for t in tok.encode(text, add_special_tokens=False):
        piece, matched = detok.add(t)
        pieces.append(piece)
        if matched:
            break
    if not matched:
        pieces.append(detok.flush())
    return pieces, matched


def test_multibyte_utf8_is_released_whole(tok):
    text = " 日本語とemoji 🎉 café"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # some characters span several byte tokens
    pieces, _ = _feed(tok, text)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_leading_space_of_the_first_token_survives(tok):
    pieces, _ = _feed(tok, " Hello there")
    assert "".join(pieces) == " Hello there"


def test_stop_string_spanning_tokens_trims_and_holds_back(tok):
    text = "The answer is 42. END OF ANSWER and more text"
    pieces, matched = _feed(tok, text, stop=["END OF"])
    assert matched == "END OF"
    assert "".join(pieces) == "The answer is 42. "
    # Nothing of the stop string was ever released.
    assert all("END" not in p for p in pieces)


def test_stop_string_included_when_asked(tok):
    pieces, matched = _feed(tok, "alpha beta gamma delta", stop=["gamma"], include_stop=True)
    assert matched == "gamma" and "".join(pieces) == "alpha beta gamma"


def test_text_that_only_looks_like_a_stop_prefix_is_released(tok):
    pieces, matched = _feed(tok, "an ENDLESS road", stop=["END OF"])
    assert matched is None and "".join(pieces) == "an ENDLESS road"


def test_earliest_of_several_stop_strings_wins(tok):
    pieces, matched = _feed(tok, "one two three four", stop=["four", "two"])
    assert matched == "two" and "".join(pieces) == "one "


def test_a_stop_string_matches_only_once_stops_are_on(tok):
    prompt_ids = tuple(tok.encode("Say:"))
    detok = IncrementalDetokenizer(tok, prompt_ids, True, ("cat",), False)
    ids = tok.encode(" a cat and a cat sat", add_special_tokens=False)
    texts, matched = [], None
    for i, t in enumerate(ids):
        # Stops come on after the first cat's token: the first one never matches.
        piece, matched = detok.add(t, stops=i > 2)
        texts.append(piece)
        if matched:
            break
    assert matched == "cat" and "".join(texts) == " a cat and a "

"""A Qwen2-style byte-level BPE tokenizer from `vocab.json` + `merges.txt` (+ the added tokens of
`tokenizer_config.json`), for Hugging Face directories that ship no `tokenizer.json` (Qwen3-TTS,
many Qwen2-tokenizer repos). Assembled with the `tokenizers` library to be the tokenizer a
`tokenizer.json` of the same checkpoint would hold: NFC, Qwen2's split, byte-level BPE, no BOS."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

# How Qwen2 splits text before BPE (GGUF files' `qwen2` pre-tokenizer too: gguf_tokenizer).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_ADDED_TOKEN_FLAGS = ("lstrip", "rstrip", "normalized", "single_word")


def bpe_files_tokenizer(
    vocab_file: Path, merges_file: Path, added_tokens_decoder: dict[str, dict[str, Any]]
) -> BackendTokenizer:
    """The byte-level BPE of `vocab_file` (token -> id) and `merges_file` (one "left right"
    merge a line, most important first, after an optional "#version" line), with Qwen2's
    normalizer, pre-tokenizer and decoder, and each entry of `added_tokens_decoder`
    (tokenizer_config.json's {"id": {"content", "special", "lstrip", ...}}) at exactly its id."""
    vocab = json.loads(vocab_file.read_text(encoding="utf-8"))
    merges = _merges(merges_file)
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    # One at a time, in id order: a token new to the vocabulary takes the next free id, so the
    # ids hold only where the added tokens follow the vocabulary without gaps.
    for key, entry in sorted(added_tokens_decoder.items(), key=lambda item: int(item[0])):
        content, special = entry["content"], bool(entry.get("special", False))
        flags = {k: bool(entry[k]) for k in _ADDED_TOKEN_FLAGS if k in entry}
        token = AddedToken(content, special=special, **flags)
        if special:
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])
        got = backend.token_to_id(content)
        if got != int(key):
            raise ValueError(
                f"added token {content!r} of tokenizer_config.json has id {key} but would get "
                f"id {got}: added tokens must follow the {len(vocab)} tokens of "
                f"{vocab_file.name} without gaps"
            )
    return backend


def _merges(merges_file: Path) -> list[tuple[str, str]]:
    merges = []
    for number, line in enumerate(merges_file.read_text(encoding="utf-8").split("\n"), 1):
        line = line.rstrip("\r")
        if not line or (number == 1 and line.startswith("#version")):
            continue
        pair = line.split(" ")
        if len(pair) != 2:
            raise ValueError(f"{merges_file}:{number}: a merge is two tokens, got {line!r}")
        merges.append((pair[0], pair[1]))
    return merges

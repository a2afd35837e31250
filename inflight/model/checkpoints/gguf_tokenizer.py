"""The tokenizer of a GGUF file, assembled with the `tokenizers` library from its vocabulary,
merges or scores, token types and special tokens: byte-level BPE (`gpt2`) or SentencePiece BPE
(`llama`)."""

from __future__ import annotations

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from inflight.model.checkpoints.bpe_files import QWEN2_SPLIT
from inflight.model.checkpoints.tokenizer import SpecialTokens, Tokenizer
from inflight.model.registry import GGUFMetadata

# How text is split before BPE, by `tokenizer.ggml.pre` (the pre-tokenizer llama.cpp applies).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    "default": [_GPT2_SPLIT],
    "gpt-2": [_GPT2_SPLIT],
    "smollm": [r"\p{N}", _GPT2_SPLIT],
    "llama-bpe": [_LLAMA3_SPLIT],
    "llama3": [_LLAMA3_SPLIT],
    "qwen2": [QWEN2_SPLIT],
}

# `tokenizer.ggml.token_type` of control and of user-defined tokens.
_CONTROL, _USER_DEFINED = 3, 4


def gguf_tokenizer(gguf: GGUFMetadata) -> Tokenizer:
    """The tokenizer a GGUF file describes: its vocabulary, merges (or scores), token types and
    special tokens, and its chat template."""
    kind = gguf.field("tokenizer.ggml.model")
    tokens: list[str] = gguf.field("tokenizer.ggml.tokens")
    types = gguf.field("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        backend = _byte_level_bpe(gguf, tokens)
        add_bos_default = False
    elif kind == "llama":
        backend = _sentencepiece_bpe(gguf, tokens)
        add_bos_default = True
    else:
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}; supported: gpt2, llama")
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == _CONTROL
        ]
    )
    backend.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == _USER_DEFINED
        ]
    )

    def token(key: str) -> str | None:
        index = gguf.field(f"tokenizer.ggml.{key}")
        return None if index is None else tokens[index]

    bos = token("bos_token_id")
    if gguf.field("tokenizer.ggml.add_bos_token", add_bos_default) and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tokens.index(bos))],
        )
    eos_ids = [
        index
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
        if (index := gguf.field(f"tokenizer.ggml.{key}")) is not None
    ]
    return Tokenizer(
        backend,
        SpecialTokens(bos=bos, eos=token("eos_token_id"), eos_ids=list(dict.fromkeys(eos_ids))),
        chat_template=gguf.field("tokenizer.chat_template"),
        byte_level=kind == "gpt2",
    )


def _byte_level_bpe(gguf: GGUFMetadata, tokens: list[str]) -> BackendTokenizer:
    pre = gguf.field("tokenizer.ggml.pre", "default")
    if pre not in _PRE_SPLITS:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer {pre!r}; supported: {', '.join(_PRE_SPLITS)}"
        )
    merges = [tuple(m.split(" ", 1)) for m in gguf.field("tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = BackendTokenizer(
        models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in ("llama-bpe", "llama3"))
    )
    splits = [
        pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in _PRE_SPLITS[pre]
    ]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(gguf: GGUFMetadata, tokens: list[str]) -> BackendTokenizer:
    scores = gguf.field("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    # A SentencePiece BPE vocabulary lists no merges: a token t = l + r with both halves in the
    # vocabulary is a merge, and merges apply in the order of the merged token's score.
    candidates = []
    for merged, score in zip(tokens, scores, strict=True):
        for cut in range(1, len(merged)):
            left, right = merged[:cut], merged[cut:]
            if left in vocab and right in vocab:
                candidates.append((-score, vocab[left], vocab[right], left, right))
    merges = [(left, right) for *_, left, right in sorted(candidates)]
    unk = gguf.field("tokenizer.ggml.unknown_token_id")
    backend = BackendTokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=None if unk is None else tokens[unk],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = gguf.field("tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Prepend("\u2581")] if prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    decode = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        decode.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(decode)
    return backend

"""Fill in the middle: a completion's `suffix` framed by the model's FIM markers.

Code models trained to fill in the middle read the code before the gap and the code after it
between three markers of their vocabulary and write the gap; editors' autocomplete (Continue,
Tabby, llama.vscode) sends them as `prompt` and `suffix` on /v1/completions. The prompt here
is prefix-suffix-middle (PSM), in whichever family's markers the vocabulary holds as single
tokens; a model with none of them refuses a suffix by name.
"""

from __future__ import annotations

from typing import Any

from inflight.protocol.tokenizer import Tokenizer
from inflight.server.errors import ServerError

# (before the prefix, before the suffix, before the middle), by model family.
FIM_MARKERS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, Qwen3-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, StarCoder2, Granite code
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)


def fim_markers(tokenizer: Tokenizer) -> tuple[int, int, int] | None:
    """The token ids of the first family of markers the vocabulary holds whole, or None."""
    for markers in FIM_MARKERS:
        ids = [tokenizer.encode(m, add_special_tokens=False) for m in markers]
        whole = zip(ids, markers, strict=True)
        if all(len(i) == 1 and tokenizer.token_str(i[0]) == m for i, m in whole):
            return ids[0][0], ids[1][0], ids[2][0]
    return None


def infill_prompts(
    prompts: list[str | dict[str, Any]], suffix: str, echo: bool, tokenizer: Tokenizer
) -> list[dict[str, Any]]:
    """A completion's prompts, each the prefix of a gap that ends where `suffix` begins, as
    token ids; a 400 naming the field for token-id prompts and for echo (OpenAI's API refuses it
    beside a suffix), and naming `suffix` where the model has no markers."""
    if echo:
        raise ServerError(400, "echo cannot be used with suffix", "echo")
    if not all(isinstance(p, str) for p in prompts):
        raise ServerError(400, "suffix needs text prompts, not token ids", "prompt")
    markers = fim_markers(tokenizer)
    if markers is None:
        raise ServerError(
            400,
            "suffix (fill in the middle) needs a model whose vocabulary has FIM markers "
            f"({', '.join(' '.join(m) for m in FIM_MARKERS)}); this one has none",
            "suffix",
        )
    after = tokenizer.encode(suffix, add_special_tokens=False)
    return [{"prompt_token_ids": _framed(tokenizer, markers, str(p), after)} for p in prompts]


def _framed(
    tokenizer: Tokenizer, markers: tuple[int, int, int], prefix: str, after: list[int]
) -> list[int]:
    """The prompt asking for the text between `prefix` and the suffix's tokens `after`, the
    tokens the tokenizer puts in front of any text (a BOS) first."""
    pre, suf, mid = markers
    text = tokenizer.encode(prefix, add_special_tokens=False)
    # What the tokenizer puts in front of the text (a BOS), and nothing it appends.
    full = tokenizer.encode(prefix, add_special_tokens=True)
    starts = range(len(full) - len(text) + 1)
    lead = full[: next((k for k in starts if full[k : k + len(text)] == text), 0)]
    return [*lead, pre, *text, suf, *after, mid]

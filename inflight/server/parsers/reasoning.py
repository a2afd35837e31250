"""Reasoning between `<think>` and `</think>` (Qwen3, DeepSeek-R1 and their kin).

Two template styles exist: the model writes both tags, or the template ends the prompt with
`<think>` and the model writes only `</think>`. Whether the output starts inside the reasoning is
read from the prompt's end; an output that opens with `<think>` starts there too. Inside, a
missing `</think>` means the whole output is reasoning (it was cut off); outside, there is no
reasoning (thinking was turned off, e.g. `enable_thinking: false` closes the block in the prompt).
"""

from __future__ import annotations

from typing import Protocol

from inflight.server.parsers.markers import held_back

OPEN = "<think>"
CLOSE = "</think>"


class ReasoningSyntax(Protocol):
    """A way models mark their reasoning in a reply (`--reasoning-parser`)."""

    # Whether its markers are special tokens, which the reply's text must then keep.
    keeps_special_tokens: bool

    def thinks_from_prompt(self, prompt_tail: str) -> bool:
        """Whether a prompt ending in `prompt_tail` leaves the model inside its reasoning."""
        ...

    def split(self, text: str, final: bool, thinking: bool) -> tuple[str | None, str]:
        """(reasoning, content) of the output so far; reasoning is None when the output does
        not reason. Unless `final`, text that may still turn out to be a marker is left out."""
        ...


class ThinkTags:
    keeps_special_tokens = False

    def thinks_from_prompt(self, prompt_tail: str) -> bool:
        """Whether a prompt ending in `prompt_tail` leaves the model inside its reasoning."""
        return prompt_tail.rstrip().endswith(OPEN)

    def split(self, text: str, final: bool, thinking: bool) -> tuple[str | None, str]:
        """(reasoning, content) of the output so far; reasoning is None when the output does
        not reason. Unless `final`, text that may still turn out to be a tag is left out."""
        head = text.lstrip()
        if head.startswith(OPEN):
            text, thinking = head[len(OPEN) :], True
        elif not final and OPEN.startswith(head):
            return ("" if thinking else None), ""
        elif not thinking:
            return None, text
        end = text.find(CLOSE)
        if end < 0:
            reasoning = text if final else text[: len(text) - held_back(text, CLOSE)]
            return reasoning.strip(), ""
        return text[:end].strip(), text[end + len(CLOSE) :].lstrip()

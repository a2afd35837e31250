"""What the layers above the runtime ask of a tokenizer (torch-free): text to ids and back,
a token's bytes, and chat rendering. `model/checkpoints/tokenizer.py` implements it for Hugging
Face and GGUF checkpoints."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class Tokenizer(Protocol):
    chat_template: str | None  # the checkpoint's own chat template, if it has one
    eos_token_ids: list[int]  # every token that ends generation
    vocab_size: int  # ids 0 .. vocab_size - 1, added tokens included

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def token_str(self, token_id: int) -> str:
        """The token as its vocabulary spells it (byte-level pieces unmapped: "Ġworld")."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (a token may hold part of a UTF-8 character)."""
        ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render messages with the checkpoint's template, or `chat_template` in its place
        (ValueError naming what fails); `continue_final_message`: the text ends where the final
        message's does, open for the model to go on with it."""
        ...

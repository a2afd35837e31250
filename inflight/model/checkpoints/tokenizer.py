"""Text <-> token ids, the chat template, and the special tokens of a checkpoint.

Built on the `tokenizers` library directly: from `tokenizer.json` for a Hugging Face directory,
or assembled from a GGUF file's vocabulary, merges and token types (see `gguf_tokenizer.py`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property, lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer


def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@dataclass
class SpecialTokens:
    bos: str | None = None
    eos: str | None = None
    eos_ids: list[int] = field(default_factory=list)


class Tokenizer:
    def __init__(
        self,
        backend: BackendTokenizer,
        special: SpecialTokens,
        chat_template: str | None,
        byte_level: bool,
    ) -> None:
        self.backend = backend
        self.special = special
        self.chat_template = chat_template
        self.byte_level = byte_level
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = backend.token_to_id(special.bos) if special.bos else None
        self.eos_token_ids = list(special.eos_ids)
        self.special_ids = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The backend's post-processor adds BOS where the checkpoint asks for it.
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_str(self, token_id: int) -> str:
        return self.backend.id_to_token(token_id) or ""

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (a token may hold part of a UTF-8 character)."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self.special_ids:
            return piece.encode()
        if self.byte_level:
            inverse = self._byte_inverse
            if all(ch in inverse for ch in piece):
                return bytes(inverse[ch] for ch in piece)
            return piece.encode()
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()

    @cached_property
    def _byte_inverse(self) -> dict[str, int]:
        return {ch: b for b, ch in byte_alphabet().items()}

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render messages with the checkpoint's own chat template, or with `chat_template`
        (a template's text) in its place; `kwargs` (e.g. `tools`, `enable_thinking`) are
        variables of the template. `continue_final_message`: the text is cut where the final
        message's text ends (what the template closes its turn with dropped), found by a mark
        rendered after it."""
        source = chat_template or self.chat_template
        if not source:
            raise ValueError(
                "this model has no chat template; pass raw text to generate() instead of messages"
            )
        if continue_final_message:
            messages = _marked_final(messages)
        context = {"bos_token": self.special.bos or "", "eos_token": self.special.eos or ""}
        context |= kwargs
        try:
            text = _compile(source).render(
                context, messages=messages, add_generation_prompt=add_generation_prompt
            )
        except ValueError:
            raise
        except Exception as exc:
            # Whatever fails inside a template is the template's fault (or its variables'):
            # a caller that passed its own template or variables gets a ValueError saying so.
            raise ValueError(f"chat template: {exc}") from exc
        return _cut_at_mark(text) if continue_final_message else text


# Rendered after the final message's text to find where it ends. Its trailing space tells a
# template that trims the message (then the text before the mark is trimmed too) from one that
# keeps it as written.
_CONTINUE_MARK = "<|inflight-continue|> "


def _marked_final(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A copy of `messages` whose final message's text (its content, or its last text part)
    ends with the mark; ValueError where it has no text."""
    if not messages:
        raise ValueError("continue_final_message: the conversation is empty")
    final = dict(messages[-1])
    content = final.get("content")
    if isinstance(content, str):
        final["content"] = content + _CONTINUE_MARK
    else:
        parts = list(content) if isinstance(content, list | tuple) else []
        last = next((i for i in reversed(range(len(parts))) if "text" in parts[i]), None)
        if last is None:
            raise ValueError("continue_final_message: the final message has no text to continue")
        parts[last] = {**parts[last], "text": parts[last]["text"] + _CONTINUE_MARK}
        final["content"] = parts
    return [*messages[:-1], final]


def _cut_at_mark(text: str) -> str:
    at = text.rfind(_CONTINUE_MARK.strip())
    if at < 0:
        raise ValueError(
            "continue_final_message: the chat template does not render the final message's "
            "text, so it cannot be continued"
        )
    return text[:at] if text.startswith(_CONTINUE_MARK, at) else text[:at].rstrip()


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kw)


def _raise(message: str) -> None:
    raise ValueError(f"chat template: {message}")

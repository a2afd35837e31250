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
        **kwargs: Any,
    ) -> str:
        """Render messages with the checkpoint's own chat template, or with `chat_template`
        (a template's text) in its place; `kwargs` (e.g. `tools`, `enable_thinking`) are
        variables of the template."""
        source = chat_template or self.chat_template
        if not source:
            raise ValueError(
                "this model has no chat template; pass raw text to generate() instead of messages"
            )
        context = {"bos_token": self.special.bos or "", "eos_token": self.special.eos or ""}
        context |= kwargs
        try:
            return _compile(source).render(
                context, messages=messages, add_generation_prompt=add_generation_prompt
            )
        except ValueError:
            raise
        except Exception as exc:
            # Whatever fails inside a template is the template's fault (or its variables'):
            # a caller that passed its own template or variables gets a ValueError saying so.
            raise ValueError(f"chat template: {exc}") from exc


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

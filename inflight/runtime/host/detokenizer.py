"""Incremental detokenization with stop strings, one instance per resident."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from inflight.model.checkpoints.tokenizer import Tokenizer

# Prompt tokens fed to the decoder first, so the first generated token decodes in context
# (a SentencePiece decoder would otherwise strip its leading space).
_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """Turns tokens into text as they arrive.

    Bytes of a UTF-8 character split across tokens wait for the rest. With stop strings, text that
    could be the beginning of a stop string is held back until it is settled; on a match the text
    ends at the stop string (which is kept only with `include_stop`).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: tuple[int, ...],
        skip_special_tokens: bool,
        stop: tuple[str, ...] = (),
        include_stop: bool = False,
    ) -> None:
        self._backend = tokenizer.backend
        self._stream = DecodeStream(
            ids=list(prompt_ids[-_CONTEXT_TOKENS:]), skip_special_tokens=skip_special_tokens
        )
        self._stop = stop
        self._include_stop = include_stop
        self.text = ""  # everything decoded so far, cut at a stop string once one matched
        self._released = 0  # how much of `text` has been handed out

    def add(self, token_id: int, stops: bool = True) -> tuple[str, str | None]:
        """Feed one token; returns (text released now, the stop string matched or None).
        Without `stops` (below the request's min_tokens) no stop string matches here: one
        ending in a later token's text still does."""
        chunk = self._stream.step(self._backend, token_id)
        if not chunk:
            return "", None
        if not self._stop:  # nothing to hold back: this path runs for every row of every step
            self.text += chunk
            self._released = len(self.text)
            return chunk, None
        before = len(self.text)
        self.text += chunk
        matched = self._match_stop(before) if stops else None
        held = 0 if matched else self._held_back()
        return self._release(len(self.text) - held), matched

    def flush(self) -> str:
        """Release whatever was held back (the request ended without a stop string)."""
        return self._release(len(self.text))

    def _match_stop(self, before: int) -> str | None:
        """The earliest stop string that ends past the first `before` characters."""
        best: tuple[int, str] | None = None
        for stop in self._stop:
            at = self.text.find(stop, max(0, before - len(stop) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[: at + len(stop) if self._include_stop else at]
        return stop

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        held = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(self.text)), held, -1):
                if self.text.endswith(stop[:k]):
                    held = k
                    break
        return held

    def _release(self, end: int) -> str:
        end = max(end, self._released)
        out = self.text[self._released : end]
        self._released = end
        return out

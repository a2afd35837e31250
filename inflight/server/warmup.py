"""Warm-up prompts (`--warmup-prompts FILE`): prefilled and pinned in the context cache while
the server already listens; `/health/ready` answers 503 until they are done."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inflight.api import LLM

log = logging.getLogger("inflight.server")


def read_warmup_prompts(path: str | Path) -> list[Any]:
    """The prompts of a warm-up file: a JSON list of prompts (text) or chat conversations
    (lists of messages); a ValueError naming what is wrong."""
    try:
        prompts = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"--warmup-prompts {path}: {exc}") from exc
    if not isinstance(prompts, list) or not all(isinstance(p, str | list) for p in prompts):
        raise ValueError(
            f"--warmup-prompts {path}: expected a JSON list of prompts (strings) or chat "
            "conversations (lists of messages)"
        )
    return prompts


class WarmUp:
    """The warm-up of a server: `total` prompts, `done` of them pinned so far, `error` where
    one failed (the server then never reports ready)."""

    def __init__(self, prompts: list[Any]) -> None:
        self.prompts = prompts
        self.total = len(prompts)
        self.done = 0
        self.error: str | None = None
        self._thread: threading.Thread | None = None

    @property
    def finished(self) -> bool:
        return self.done == self.total

    def start(self, llm: LLM) -> None:
        """Warm up on a thread of its own; each prompt's pin is logged."""
        if not self.prompts:
            return
        self._thread = threading.Thread(target=self._run, args=(llm,), daemon=True)
        self._thread.start()

    def _run(self, llm: LLM) -> None:
        def progress(done: int, total: int) -> None:
            self.done = done
            log.info("warm-up: %d of %d prompts prefilled and pinned", done, total)

        try:
            llm.warm_up(self.prompts, progress)
        except Exception as exc:
            self.error = str(exc)
            log.error("warm-up failed: %s", exc)

"""Structured outputs with llguidance: grammars compiled per request, a matcher per resident,
and the bitmask of the tokens each constrained row may sample next (torch-free).

A request's constraint is compiled and validated when the request is checked (on the caller's
thread, before anything is queued; a bad schema or grammar is a `RequestFieldError` naming the
problem), the grammar text cached by constraint. Each resident that carries one gets its own
`LLMatcher` at seating; every step fills the mask rows of the constrained sampling rows only, and
the accepted token advances the matcher (`Constraints`, the per-row feature). llguidance is
imported on first use: a deployment that never sees a constraint never loads it.

A JSON schema compiles with its objects closed to undeclared properties unless it allows them
(`json_schemas.forbid_undeclared_properties`), as OpenAI and vLLM's default backends serve
schemas.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from inflight.model.checkpoints.tokenizer import Tokenizer
from inflight.protocol.outputs import FinishReason
from inflight.protocol.request import GenerationRequest, RequestFieldError, StructuredOutputs
from inflight.runtime.host.features import RowFailure, RowFeature
from inflight.runtime.host.json_schemas import forbid_undeclared_properties
from inflight.runtime.host.residents import Resident
from inflight.runtime.host.rows import ScheduledRow

log = logging.getLogger(__name__)

_GRAMMAR_CACHE_SIZE = 256
# A Lark grammar's start rule, also inlined (`?start:`, as outlines writes its grammars) or kept
# (`!start:`): llguidance's own test for Lark knows only `start:` and reads the rest as GBNF.
_LARK_START = re.compile(r"^\s*[?!]?start\s*:", re.MULTILINE)
# The characters of a URI reference (RFC 3986). A root `$id` of others is no base any `$ref`
# could resolve against: OpenAI ignores it, where llguidance refuses the schema (the `schema`
# package writes a title there, "Output Format", which griptape sends).
_URI_REFERENCE = re.compile(r"[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]*")
# Mask rows computed at once, on llguidance's own threads (while the device runs a forward).
_FILL_THREADS = min(8, os.cpu_count() or 1)


@functools.cache
def _llguidance() -> Any:
    import llguidance
    import llguidance.numpy  # noqa: F401  (fills bitmasks held in numpy arrays)

    return llguidance


def _grammar_source(spec: StructuredOutputs) -> tuple[str, str]:
    """(llguidance format, text) of a constraint: a hashable key of what it means (a JSON
    schema's key is the schema rewritten by `forbid_undeclared_properties`, what compiles)."""
    kind = spec.kind
    if kind == "json":
        try:
            schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
        except ValueError as exc:
            raise RequestFieldError(
                f"structured_outputs json does not compile: {exc}", "structured_outputs"
            ) from exc
        root_id = schema.get("$id") if isinstance(schema, dict) else None
        if isinstance(root_id, str) and not _URI_REFERENCE.fullmatch(root_id):
            schema = {key: value for key, value in schema.items() if key != "$id"}
        # Key order kept: the schema's property order is the output's.
        return "json", json.dumps(forbid_undeclared_properties(schema, strict=spec.strict))
    if kind == "json_object":
        return "json", '{"type": "object"}'
    if kind == "choice":
        return "choice", json.dumps(list(spec.choice or ()))
    if kind == "regex":
        return "regex", spec.regex or ""
    grammar = spec.grammar or ""
    return ("lark" if _LARK_START.search(grammar) else "grammar"), grammar


class GrammarCompiler:
    """Compiles constraints for one tokenizer; any thread may call it (the cache is locked)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logit width, which may exceed the vocabulary
        self._cache: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._lock = threading.Lock()

    @functools.cached_property
    def _ll_tokenizer(self) -> Any:
        llg = _llguidance()
        return llg.LLTokenizer(
            self._tokenizer.backend.to_str(),
            n_vocab=self.vocab_size,
            eos_token=self._tokenizer.eos_token_ids[0],
        )

    def compile(self, spec: StructuredOutputs) -> str:
        """The llguidance grammar of a constraint (a JSON schema's objects closed to undeclared
        properties first: `forbid_undeclared_properties`); RequestFieldError when it does not
        compile."""
        key = _grammar_source(spec)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            llg = _llguidance()
            tokenizer = self._ll_tokenizer
        try:
            kind, text = key
            if kind == "json":
                # Compact JSON: free whitespace lets a small model wander in blank lines.
                grammar = llg.LLMatcher.grammar_from_json_schema(
                    text, defaults={"whitespace_flexible": False}
                )
            else:
                grammar = llg.grammar_from(kind, text)
            error = llg.LLMatcher.validate_grammar(grammar, tokenizer)
        except (ValueError, TypeError) as exc:
            error = str(exc)
        if not error and not self._can_start(grammar):
            error = "it matches no string"
        if error:
            raise RequestFieldError(
                f"structured_outputs {spec.kind} does not compile: {error.strip()}",
                "structured_outputs",
            )
        with self._lock:
            self._cache[key] = grammar
            if len(self._cache) > _GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def _can_start(self, grammar: str) -> bool:
        """Whether the grammar's language holds a string: an empty one (the regex [^\\s\\S])
        validates, and its matcher starts stopped without accepting (nothing but EOS)."""
        matcher = self.matcher(grammar)
        self.fill([matcher], self.bitmask(1))  # the matcher settles its state computing a mask
        return matcher.is_accepting() or not matcher.is_stopped()

    def matcher(self, grammar: str) -> Any:
        """A fresh matcher of a compiled grammar, at the start of the output."""
        return _llguidance().LLMatcher(self._ll_tokenizer, grammar)

    def bitmask(self, rows: int) -> np.ndarray:
        """An int32 [rows, ceil(vocab / 32)] bitmask (bit i of word j: token 32 j + i)."""
        return np.zeros((rows, -(-self.vocab_size // 32)), dtype=np.int32)

    def fill(self, matchers: Sequence[Any], bitmask: np.ndarray) -> None:
        """Row i of `bitmask` := the tokens matchers[i] allows next (rows in parallel)."""
        llg = _llguidance()
        llg.numpy.fill_next_token_bitmask_par(
            self._executor, [(m, i) for i, m in enumerate(matchers)], bitmask
        )

    @functools.cached_property
    def _executor(self) -> Any:
        return _llguidance().LLExecutor(num_threads=_FILL_THREADS)


class Constraints(RowFeature):
    """Structured outputs as a per-row feature: a request's constraint compiles when it is
    checked, each of its residents gets a matcher at seating, each accepted token advances it,
    and a step's constrained sampling rows get the mask of what their matchers allow."""

    def __init__(self, grammars: GrammarCompiler, max_rows: int) -> None:
        self.grammars = grammars
        self.max_rows = max_rows
        self._bitmask: np.ndarray | None = None  # made on first use

    def check(self, request: GenerationRequest) -> None:
        spec = request.params.structured_outputs
        if spec is not None:
            self.grammars.compile(spec)

    def seat(self, resident: Resident, held: object) -> None:
        spec = resident.request.params.structured_outputs
        if spec is not None:  # compiled when checked: the cache holds it
            resident.features.matcher = self.grammars.matcher(self.grammars.compile(spec))

    def accept(self, resident: Resident, token: int) -> FinishReason | None:
        """STOP once the output is complete in the constraint's language (the mask then allows
        EOS alone, which need not be sampled)."""
        matcher = resident.features.matcher
        if matcher is None:
            return None
        if not matcher.consume_token(token):
            # The mask allows only what the matcher accepts, so this is a fault of ours: it
            # fails this request alone.
            error = matcher.get_error()
            log.error("structured outputs of %s: %s", resident.ref, error)
            raise RowFailure(f"its structured-outputs constraint rejected token {token}: {error}")
        return FinishReason.STOP if matcher.is_stopped() else None

    def masks(self, samplers: list[ScheduledRow]) -> tuple[list[int], np.ndarray] | None:
        """The constrained rows among a step's sampling rows (indices into `samplers`, a
        constrained row having no drafts) and the packed bitmask of what each may sample next;
        None when no row is constrained. A row whose matcher has stopped (its resident finished
        in the step before: its row is wasted) is left free."""
        constrained = [
            i
            for i, row in enumerate(samplers)
            if row.resident.features.matcher is not None
            and not row.resident.features.matcher.is_stopped()
        ]
        if not constrained:
            return None
        if self._bitmask is None:
            self._bitmask = self.grammars.bitmask(self.max_rows)
        bitmask = self._bitmask[: len(constrained)]
        self.grammars.fill([samplers[i].resident.features.matcher for i in constrained], bitmask)
        return constrained, bitmask

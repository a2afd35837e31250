"""Structured outputs with llguidance: grammars compiled per request, a matcher per resident,
and the bitmask of the tokens each constrained row may sample next (torch-free).

A request's constraint is compiled and validated when the request is checked (on the caller's
thread, before anything is queued; a bad schema or grammar is a `RequestFieldError` naming the
problem), the grammar text cached by constraint. Each resident that carries one gets its own
`LLMatcher` at seating; every step fills the mask rows of the constrained sampling rows only, and
the accepted token advances the matcher (`Constraints`, the per-row feature). llguidance is
imported on first use: a deployment that never sees a constraint never loads it.

A JSON schema compiles with its objects closed to undeclared properties unless it allows them
(`forbid_undeclared_properties`), as OpenAI and vLLM's default backends serve schemas.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from inflight.model.checkpoints.tokenizer import Tokenizer
from inflight.protocol.outputs import FinishReason
from inflight.protocol.request import GenerationRequest, RequestFieldError, StructuredOutputs
from inflight.runtime.host.features import RowFailure, RowFeature
from inflight.runtime.host.residents import Resident
from inflight.runtime.host.rows import ScheduledRow

log = logging.getLogger(__name__)

_GRAMMAR_CACHE_SIZE = 256
# Mask rows computed at once, on llguidance's own threads (while the device runs a forward).
_FILL_THREADS = min(8, os.cpu_count() or 1)


@functools.cache
def _llguidance() -> Any:
    import llguidance
    import llguidance.numpy  # noqa: F401  (fills bitmasks held in numpy arrays)

    return llguidance


# Keywords whose schemas describe other values than the instance (its members, its items) or
# define schemas: each is the whole schema of a value of its own.
_MEMBER_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_MEMBER_SCHEMAS = (
    "additionalProperties",
    "unevaluatedProperties",
    "items",
    "additionalItems",
    "unevaluatedItems",
    "contains",
)
_MEMBER_LISTS = ("prefixItems", "items")
# Keywords whose schemas apply to the instance itself: allOf's are parts of one schema, anyOf's
# and oneOf's alternatives.
_IN_PLACE = ("allOf", "anyOf", "oneOf")

# The members schemas declare, ("properties", name) or ("patternProperties", pattern); a dict as
# an ordered set, so that the properties a rewrite adds come in a reproducible order.
_Names = dict[tuple[str, str], None]


def forbid_undeclared_properties(schema: Any, *, strict: bool = False) -> Any:
    """A copy of a JSON schema whose objects take only the properties it declares, as OpenAI's
    structured outputs and vLLM's default backends do (the caller's schema is left as it was;
    the parts the copy does not change are shared). JSON Schema allows undeclared properties
    unless a schema says otherwise, and a model given that freedom may keep writing keys of its
    own (tool arguments that run on to the length limit).

    An object schema that states neither `additionalProperties` nor `unevaluatedProperties` is
    closed (`"additionalProperties": false`) where it declares `properties` or
    `patternProperties`; with `strict` (OpenAI's `strict: true`) also where it declares none but
    its type is "object", which then takes only `{}` (without `strict`, such a schema keeps
    meaning any object, as `json_object` does). Closed at every depth: the root, the schemas of
    properties, items and definitions, anyOf / oneOf alternatives. allOf members are parts of
    one schema, so they are left open and the schema holding them is closed with their
    properties, as an alternative is closed with the properties declared beside it (what
    `unevaluatedProperties: false` would say; llguidance does not implement it); `required`
    names count as declared. An explicit `additionalProperties` is honoured, and decides for the
    alternatives and parts under it too. A schema with a `$ref` among its parts is not closed:
    the properties it refers to are not known here (the definition is closed on its own). `not`,
    `if` / `then` / `else` and `dependentSchemas` are left as they are: llguidance refuses them.
    """
    return _rewrite(schema, strict, {}, part=False)


def _rewrite(schema: Any, strict: bool, beside: _Names | None, *, part: bool) -> Any:
    """`schema` rewritten; `beside`: the members declared on the same instance by the schemas
    around it (None: not known, or an explicit `additionalProperties` decides), `part`: an allOf
    member, not closed itself."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _MEMBER_MAPS:
        if isinstance(schema.get(key), dict):
            out[key] = {k: _rewrite(v, strict, {}, part=False) for k, v in schema[key].items()}
    for key in _MEMBER_SCHEMAS:
        if isinstance(schema.get(key), dict):
            out[key] = _rewrite(schema[key], strict, {}, part=False)
    for key in _MEMBER_LISTS:
        if isinstance(schema.get(key), list):
            out[key] = [_rewrite(s, strict, {}, part=False) for s in schema[key]]
    explicit = "additionalProperties" in schema or "unevaluatedProperties" in schema
    children = _in_place(schema)
    for key in dict.fromkeys(k for k, _, _ in children):
        out[key] = list(schema[key])
    # Beside a child: the schema's own members and its other children but the other
    # alternatives of the child's own anyOf / oneOf. Members a $ref brings are not known here,
    # and an explicit additionalProperties decides for the children too.
    settled = explicit or "$ref" in schema
    for key, i, child in children:
        others = [c for k, j, c in children if k != key or (key == "allOf" and j != i)]
        around = None if settled else _union(beside, _declared(schema), *map(_reachable, others))
        out[key][i] = _rewrite(child, strict, around, part=key == "allOf")
    if part or explicit or not _closes(schema, strict):
        return out
    allowed = _union(beside, _reachable(schema))
    if allowed is None:
        return out
    for key, name in allowed:
        members = out.get(key, {})
        if isinstance(members, dict) and name not in members:
            out[key] = {**members, name: {}}
    out["additionalProperties"] = False
    return out


def _in_place(schema: dict[str, Any]) -> list[tuple[str, int, dict[str, Any]]]:
    """The schemas applied to a schema's own instance: (keyword, index, schema)."""
    return [
        (key, i, child)
        for key in _IN_PLACE
        if isinstance(schema.get(key), list)
        for i, child in enumerate(schema[key])
        if isinstance(child, dict)
    ]


def _declared(schema: dict[str, Any]) -> _Names:
    """The members a schema names itself: properties, property patterns, required names."""
    names: _Names = {}
    for key in ("properties", "patternProperties"):
        if isinstance(schema.get(key), dict):
            names.update(dict.fromkeys((key, name) for name in schema[key]))
    if isinstance(schema.get("required"), list):
        required = [n for n in schema["required"] if isinstance(n, str)]
        names.update(dict.fromkeys(("properties", name) for name in required))
    return names


def _reachable(schema: dict[str, Any]) -> _Names | None:
    """The members a schema and the schemas applied with it declare; None when a $ref hides
    some."""
    if "$ref" in schema:
        return None
    return _union(_declared(schema), *(_reachable(child) for _, _, child in _in_place(schema)))


def _union(*names: _Names | None) -> _Names | None:
    """The members named, in order; None when some are not known."""
    union: _Names = {}
    for some in names:
        if some is None:
            return None
        union.update(some)
    return union


def _closes(schema: dict[str, Any], strict: bool) -> bool:
    """Whether a schema that does not state `additionalProperties` is an object schema to close:
    it (or an allOf part) declares properties, or under `strict`, its type is "object"."""
    if "properties" in schema or "patternProperties" in schema:
        return True
    parts = schema.get("allOf") if isinstance(schema.get("allOf"), list) else []
    if any(isinstance(part, dict) and _closes(part, False) for part in parts):
        return True
    types = schema.get("type")
    return strict and (types == "object" or isinstance(types, list) and "object" in types)


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
        # Key order kept: the schema's property order is the output's.
        return "json", json.dumps(forbid_undeclared_properties(schema, strict=spec.strict))
    if kind == "json_object":
        return "json", '{"type": "object"}'
    if kind == "choice":
        return "choice", json.dumps(list(spec.choice or ()))
    if kind == "regex":
        return "regex", spec.regex or ""
    return "grammar", spec.grammar or ""


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

"""Closing a JSON schema's objects to the properties it does not declare, as OpenAI's structured
outputs and vLLM's default backends serve schemas (JSON Schema's own default allows any
property); `structured.py` compiles every JSON schema through it."""

from __future__ import annotations

from typing import Any

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

"""JSON schemas compile with their objects closed to undeclared properties (as OpenAI and vLLM's
default backends serve them), unless a schema allows more: the rewrite, and the grammars
compiled from it."""

import copy
import json

import pytest
from tokenizers import Tokenizer as BackendTokenizer

from inflight.model.checkpoints.tokenizer import SpecialTokens, Tokenizer
from inflight.protocol.request import RequestFieldError, StructuredOutputs
from inflight.runtime.host.json_schemas import forbid_undeclared_properties
from inflight.runtime.host.structured import GrammarCompiler

from tiny_models import write_tokenizer

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
INT = {"type": "integer"}


def _closed(properties: dict, **rest) -> dict:
    return {"type": "object", "properties": properties, **rest, "additionalProperties": False}


def test_objects_that_declare_properties_are_closed_at_every_depth():
    schema = {
        "type": "object",
        "properties": {
            "home": {"type": "object", "properties": {"zip": {"type": "string"}}},
            "pets": {"type": "array", "items": {"type": "object", "properties": {"name": INT}}},
            "pair": {"type": "array", "prefixItems": [{"type": "object", "properties": {}}]},
            "tags": {"type": "object", "additionalProperties": CITY},
        },
    }
    assert forbid_undeclared_properties(schema) == _closed(
        {
            "home": _closed({"zip": {"type": "string"}}),
            "pets": {"type": "array", "items": _closed({"name": INT})},
            "pair": {"type": "array", "prefixItems": [_closed({})]},
            "tags": {
                "type": "object",
                "additionalProperties": _closed(CITY["properties"], required=["city"]),
            },
        }
    )


def test_definitions_are_closed_so_references_to_them_are():
    schema = {
        "$defs": {"Pet": {"type": "object", "properties": {"name": INT}}},
        "definitions": {"Toy": {"type": "object", "properties": {"kind": INT}}},
        "type": "object",
        "properties": {"pet": {"$ref": "#/$defs/Pet"}, "toy": {"$ref": "#/definitions/Toy"}},
    }
    rewritten = forbid_undeclared_properties(schema)
    assert rewritten["$defs"]["Pet"] == _closed({"name": INT})
    assert rewritten["definitions"]["Toy"] == _closed({"kind": INT})
    assert rewritten["properties"] == schema["properties"]  # the references are left as they are
    assert rewritten["additionalProperties"] is False


def test_alternatives_are_closed_each_with_the_properties_declared_beside_them():
    alternatives = {
        "anyOf": [
            {"type": "object", "properties": {"a": INT}},
            {"type": "object", "properties": {"b": INT}},
            {"type": "string"},
        ]
    }
    assert forbid_undeclared_properties(alternatives) == {
        "anyOf": [_closed({"a": INT}), _closed({"b": INT}), {"type": "string"}]
    }
    # A property the schema around them declares is the alternatives' too.
    tagged = {"type": "object", "properties": {"kind": INT}, "oneOf": [{"properties": {"a": INT}}]}
    assert forbid_undeclared_properties(tagged) == {
        "type": "object",
        "properties": {"kind": INT, "a": {}},
        "oneOf": [{"properties": {"a": INT, "kind": {}}, "additionalProperties": False}],
        "additionalProperties": False,
    }


def test_all_of_parts_stay_open_and_the_whole_is_closed_with_their_properties():
    schema = {"allOf": [{"properties": {"a": INT}}, {"properties": {"b": INT}, "required": ["b"]}]}
    assert forbid_undeclared_properties(schema) == {
        **schema,
        "properties": {"a": {}, "b": {}},
        "additionalProperties": False,
    }


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": INT}, "additionalProperties": True},
        {"type": "object", "properties": {"a": INT}, "additionalProperties": {"type": "string"}},
        {"type": "object", "properties": {"a": INT}, "unevaluatedProperties": False},
        {"type": "object", "additionalProperties": True, "anyOf": [{"properties": {"a": INT}}]},
        {"type": "object"},  # any object, as json_object
        {"title": "any value"},
        {"$ref": "#/$defs/A", "properties": {"b": INT}, "$defs": {"A": {"type": "string"}}},
        True,
    ],
    ids=[
        "true",
        "schema",
        "unevaluated",
        "alternatives-under-true",
        "object",
        "any",
        "ref",
        "bool",
    ],
)
def test_what_a_schema_allows_explicitly_or_cannot_tell_is_left_alone(schema):
    assert forbid_undeclared_properties(schema) == schema


def test_strict_closes_objects_that_declare_no_properties():
    schema = {"type": "object", "properties": {"options": {"type": ["object", "null"]}}}
    assert forbid_undeclared_properties(schema, strict=True) == _closed(
        {"options": {"type": ["object", "null"], "additionalProperties": False}}
    )
    assert forbid_undeclared_properties({"type": "object"}, strict=True) == {
        "type": "object",
        "additionalProperties": False,
    }


def test_the_callers_schema_is_not_changed():
    schema = {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": INT}}},
        "anyOf": [{"properties": {"c": INT}}],
        "allOf": [{"properties": {"d": INT}}],
        "$defs": {"E": {"type": "object", "properties": {"e": INT}}},
    }
    before = copy.deepcopy(schema)
    forbid_undeclared_properties(schema, strict=True)
    assert schema == before


# -- compiled grammars --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def grammars(tmp_path_factory) -> GrammarCompiler:
    """A compiler for a tiny byte-level tokenizer: any JSON text tokenizes."""
    path = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(path)
    backend = BackendTokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer = Tokenizer(backend, SpecialTokens(eos_ids=[2]), chat_template=None, byte_level=True)
    return GrammarCompiler(tokenizer, tokenizer.vocab_size)


def _accepts(grammars: GrammarCompiler, spec: StructuredOutputs, text: str) -> bool:
    matcher = grammars.matcher(grammars.compile(spec))
    tokens = grammars._ll_tokenizer.tokenize_str(text)
    return matcher.consume_tokens(tokens) and matcher.is_accepting()


@pytest.mark.parametrize("as_text", [False, True], ids=["object", "text"])
def test_a_compiled_schema_takes_its_properties_and_no_others(grammars, as_text):
    spec = StructuredOutputs(json=json.dumps(CITY) if as_text else CITY)
    assert _accepts(grammars, spec, '{"city":"Paris"}')
    assert not _accepts(grammars, spec, '{"city":"Paris","extra":1}')
    assert not _accepts(grammars, spec, '{"city":"Paris","properties":{}}')


def test_a_compiled_schema_allows_what_it_says_it_allows(grammars):
    open_schema = {**CITY, "additionalProperties": {"type": "integer"}}
    assert _accepts(grammars, StructuredOutputs(json=open_schema), '{"city":"Paris","extra":1}')
    anything = StructuredOutputs(
        json={"type": "object", "properties": {"opts": {"type": "object"}}}
    )
    assert _accepts(grammars, anything, '{"opts":{"x":1}}')
    assert not _accepts(grammars, anything, '{"opts":{},"x":1}')
    assert _accepts(grammars, StructuredOutputs(json_object=True), '{"x":1}')


def test_a_strict_schema_closes_every_object(grammars):
    schema = {"type": "object", "properties": {"opts": {"type": "object"}}}
    strict = StructuredOutputs(json=schema, strict=True)
    assert _accepts(grammars, strict, '{"opts":{}}')
    assert not _accepts(grammars, strict, '{"opts":{"x":1}}')
    assert not _accepts(grammars, strict, '{"opts":{},"x":1}')
    assert not _accepts(grammars, StructuredOutputs(json=CITY, strict=True), '{"city":"a","b":1}')


def test_a_root_id_that_is_no_uri_is_ignored_as_openai_ignores_it(grammars):
    """The `schema` package writes its title as the root `$id` ("Output Format", a space in
    it), which llguidance refuses as a base URI: the schema compiles without it; a URI stays."""
    titled = {**CITY, "$id": "Output Format", "$schema": "http://json-schema.org/draft-07/schema#"}
    assert _accepts(grammars, StructuredOutputs(json=titled), '{"city":"Paris"}')
    assert not _accepts(grammars, StructuredOutputs(json=titled), '{"city":"Paris","x":1}')
    with_uri = {**CITY, "$id": "https://example.com/city.json"}
    assert _accepts(grammars, StructuredOutputs(json=with_uri), '{"city":"Paris"}')
    assert grammars.compile(StructuredOutputs(json=with_uri)) != grammars.compile(
        StructuredOutputs(json=CITY)
    )


def test_a_schema_that_is_not_json_is_refused_naming_the_field(grammars):
    with pytest.raises(RequestFieldError, match="json does not compile") as refused:
        grammars.compile(StructuredOutputs(json="{not json"))
    assert refused.value.field == "structured_outputs"


@pytest.mark.parametrize("spec", [{"regex": "a", "strict": True}, {"json": {}, "strict": "yes"}])
def test_strict_is_a_boolean_of_a_json_schema(spec):
    with pytest.raises(ValueError, match="strict"):
        StructuredOutputs(**spec)


@pytest.mark.parametrize(
    "grammar",
    [
        'start: n "+" n\nn: /[0-9]+/',
        '\n?start: expr\n?expr: n "+" n\nn: /[0-9]+/\n',  # outlines' inlined rules
        'root ::= n "+" n\nn ::= [0-9]+',  # GBNF
    ],
    ids=["lark", "lark inlined start", "gbnf"],
)
def test_a_grammar_compiles_in_lark_or_gbnf(grammars, grammar):
    spec = StructuredOutputs(grammar=grammar)
    assert _accepts(grammars, spec, "12+7")
    assert not _accepts(grammars, spec, "12+")

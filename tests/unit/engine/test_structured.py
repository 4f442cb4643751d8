"""Structured output: schemas compile or are refused by name within their budgets, and the
backends' matchers let through exactly the texts a schema allows, ending only where a value
may end (checked against the `jsonschema` validator)."""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest
import torch

from engine.config import GrammarBackend
from engine.structured import GrammarLimits, SchemaError, check, precheck
from engine.structured.backend import TokenMatcher, Vocabulary, mask_words
from engine.structured.compilers import make_compiler

# a small vocabulary: the 256 bytes, a few longer tokens, a special token and a stop token
TOKENS: list[bytes | None] = [bytes((b,)) for b in range(256)]
TOKENS += [b'{"', b'": ', b"true", b"}", b"Paris", b'"}', None, None]
SPECIAL, STOP = len(TOKENS) - 2, len(TOKENS) - 1
VOCAB = Vocabulary(
    token_bytes=TOKENS,
    special_texts={SPECIAL: "<|special|>", STOP: "<|end|>"},
    eos_token_id=STOP,
    encode=lambda text: list(text.encode()),
)
BACKENDS = [GrammarBackend.LLGUIDANCE, GrammarBackend.XGRAMMAR]
COMPILERS = {backend: make_compiler(backend, VOCAB) for backend in BACKENDS}

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer"},
        "height": {"type": ["number", "null"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", 3]}, "maxItems": 2},
        "alive": {"type": "boolean"},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def matcher(schema: Any, backend: GrammarBackend = GrammarBackend.LLGUIDANCE) -> TokenMatcher:
    return COMPILERS[backend].matcher(json.dumps(schema), None, frozenset({STOP}))


def allowed(m: TokenMatcher) -> set[int]:
    bitmask = torch.zeros(1, mask_words(len(TOKENS)), dtype=torch.int32)
    m.fill_mask(bitmask, 0)
    words = bitmask[0].tolist()
    return {t for t in range(len(TOKENS)) if words[t >> 5] >> (t & 31) & 1}


def matches(schema: Any, text: str, backend: GrammarBackend = GrammarBackend.LLGUIDANCE) -> bool:
    m = matcher(schema, backend)
    for byte in text.encode():
        if byte not in allowed(m):
            return False
        m.accept(byte)
    return STOP in allowed(m)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ('{"name": "Ann", "age": 41}', True),
        ('{"name":"Ann","age":-1,"height":1.5e-3,"tags":["a",3],"alive":false}', True),
        ('{\n  "name" : "Ann",\n  "age" : 7\n}', True),
        ('{"name": "Zoë 日本", "age": 1}', True),
        ('{"name": "Ann"}', False),  # age is required
        ('{"name": "", "age": 1}', False),  # minLength
        ('{"name": "Annabelle!", "age": 1}', False),  # maxLength
        ('{"name": "Ann", "age": 4.5}', False),  # an integer
        ('{"name": "Ann", "age": 01}', False),  # no leading zeros
        ('{"name": "Ann", "age": 1, "tags": ["c"]}', False),  # enum
        ('{"name": "Ann", "age": 1, "tags": ["a", "a", "a"]}', False),  # maxItems
        ('{"name": "Ann", "age": 1, "extra": 1}', False),  # no undeclared properties
        ('{"name": "Ann", "age": 1,}', False),
        ('{"name": "a\\x", "age": 1}', False),  # a bad escape
        ('{"name": "a\nb", "age": 1}', False),  # a raw control character
        ("{" + " " * 21 + '"name": "Ann", "age": 1}', False),  # 20 bytes of whitespace
    ],
)
def test_a_schema_lets_through_exactly_its_texts(backend, text, ok):
    assert matches(PERSON, text, backend) is ok
    if ok:
        jsonschema.validate(json.loads(text), PERSON)


def test_whitespace_is_enough_to_pretty_print_and_no_more():
    assert matches(PERSON, json.dumps({"name": "Ann", "age": 1}, indent=4))
    assert not matches(PERSON, '{\n\n"name": "Ann", "age": 1}')  # a blank line
    assert not matches(PERSON, '{"name": "Ann",' + " " * 21 + '"age": 1}')


def test_keywords_the_old_engine_refused_are_enforced():
    one_of = {"oneOf": [{"type": "integer", "multipleOf": 3}, {"type": "string", "maxLength": 2}]}
    assert matches(one_of, "9") and matches(one_of, '"ab"')
    assert not matches(one_of, "10") and not matches(one_of, '"abc"')
    sized = {"type": "object", "minProperties": 1, "additionalProperties": {"type": "integer"}}
    assert matches(sized, '{"a": 1}') and not matches(sized, "{}")


def test_stop_tokens_end_only_a_complete_value_and_special_tokens_never_come():
    m = matcher({"type": "integer"})
    assert STOP not in allowed(m) and SPECIAL not in allowed(m)
    assert TOKENS.index(b"true") not in allowed(m)
    m.accept(ord("4"))
    assert {STOP, ord("2")} <= allowed(m) and not m.is_final
    m.accept(STOP)
    assert m.is_final
    m = matcher({"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]})
    for token in (b'{"', b"a", b'": ', b"true", b"}"):
        assert TOKENS.index(token) in allowed(m), token
        m.accept(TOKENS.index(token))
    assert m.is_final  # the object is closed and nothing may follow: the request ends


def test_a_matcher_with_no_token_to_continue_marks_itself_stuck():
    letters = Vocabulary([bytes((ord("a") + i,)) for i in range(26)], {}, None, list)
    m = make_compiler(GrammarBackend.LLGUIDANCE, letters).matcher(
        '{"type": "object"}', None, frozenset()
    )  # no token opens an object
    m.fill_mask(torch.zeros(1, mask_words(26), dtype=torch.int32), 0)
    assert m.stuck


def random_text(m: TokenMatcher, rng: random.Random) -> bytes | None:
    """A random walk through the tokens `m` allows, closing where it can once long."""
    text = bytearray()
    while not m.is_final:
        options = sorted(allowed(m) - {SPECIAL})
        assert options, f"a dead end after {bytes(text)!r}"
        closing = [t for t in options if t == STOP or TOKENS[t] in (b'"', b"]", b"}")]
        token = rng.choice(closing if closing and len(text) > 40 else options)
        m.accept(token)
        text += TOKENS[token] or b""
        if len(text) > 400:
            return None
    return bytes(text)


TREE = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "value": {"type": "number", "minimum": -1.5, "exclusiveMaximum": 2},
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
            },
            "required": ["value", "children"],
        }
    },
    "$ref": "#/$defs/node",
}
FORMATTED = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "format": "uuid"},
        "when": {"type": "string", "format": "date-time"},
        "code": {"type": "string", "pattern": "^[A-Z]{2}(-[0-9]{2,4})?$"},
        "count": {"type": "integer", "exclusiveMinimum": 9, "maximum": 12},
        "kind": {"anyOf": [{"const": "fixed"}, {"type": "array", "items": {"type": "integer"}}]},
    },
    "required": ["id", "when", "code", "count", "kind"],
}


@pytest.mark.parametrize("schema", [PERSON, TREE, FORMATTED, {"type": "object"}])
def test_every_text_a_matcher_lets_through_is_valid_json_of_the_schema(schema):
    rng = random.Random(7)
    texts = [t for t in (random_text(matcher(schema), rng) for _ in range(40)) if t is not None]
    assert len(texts) >= 20
    for text in texts:
        value = json.loads(text.decode("utf-8"))
        jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "array", "uniqueItems": True}, "keyword 'uniqueItems' is not supported"),
        ({"if": {"type": "string"}, "then": {"maxLength": 3}}, "keywords 'if', 'then' are not"),
        ({"type": "array", "contains": {"type": "integer"}}, "keyword 'contains' is not"),
        ({"not": {"type": "string"}}, "keyword 'not' is not supported"),
        ({"type": "string", "format": "uri-reference"}, "format 'uri-reference' is not"),
        ({"oneOf": [{"type": "string"}, {"maxLength": 2}]}, "oneOf constraints are not"),
        ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
        ({"type": "string", "pattern": "(a)\\1"}, "backreferences are not supported"),
        ({"type": "integer", "minimum": 3, "maximum": 2}, "Unsatisfiable schema"),
        ({"$ref": "http://example.com/s.json"}, "not present in a registry"),
        ({"type": "strin"}, "Invalid type: strin"),
        (False, "object schema"),
    ],
)
def test_what_cannot_be_enforced_is_refused_by_name(schema, message):
    with pytest.raises(SchemaError, match=message):
        check(json.dumps(schema), None)


def test_schema_texts_are_checked_before_compiling():
    with pytest.raises(SchemaError, match="not valid JSON"):
        precheck("{", None)
    with pytest.raises(SchemaError, match="larger than"):
        precheck(json.dumps({"description": "x" * 70_000}), None)
    with pytest.raises(SchemaError, match="together are not supported"):
        precheck("{}", "start: /a/")


NESTED = "^((a?){255}){8}$"  # 4,090 states for an automaton built up front


def pattern_schema(pattern: str, copies: int = 1) -> str:
    fields = {f"f{i}": {"type": "string", "pattern": pattern} for i in range(copies)}
    return json.dumps({"type": "object", "properties": fields, "required": list(fields)})


def test_adversarial_patterns_compile_lazily_and_fail_their_request_past_the_caps():
    check(pattern_schema(NESTED, 4), None)  # the lexer is built as the text needs it
    m = COMPILERS[GrammarBackend.LLGUIDANCE].matcher(
        pattern_schema(NESTED), None, frozenset({STOP})
    )
    for byte in b'{"f0": "' + b"a" * 400:
        if m.stuck:  # its lexer grew past max_lexer_states: the request fails, alone
            break
        assert allowed(m) & {ord("b"), ord("x")} == set()
        if byte in allowed(m):
            m.accept(byte)
        else:
            assert m.stuck
    assert m.stuck


def test_grammars_over_their_budgets_are_refused_with_the_reason():
    many = "^(" + "|".join(f"word{i}x" for i in range(2000)) + ")$"
    with pytest.raises(SchemaError, match=r"takes \d+ ms to compile; the limit is 0 ms"):
        check(pattern_schema(many), None, GrammarLimits(compile_cpu_s=1e-6))
    with pytest.raises(SchemaError, match=r"fuel|too large|limit"):
        check(pattern_schema(many), None, GrammarLimits(initial_lexer_fuel=1000))
    check(pattern_schema(many), None)  # within the default budget


def test_lark_grammars_constrain_text_too():
    lark = 'start: "yes" | "no" | NUM\nNUM: /[0-9]{1,3}/\n'
    m = COMPILERS[GrammarBackend.LLGUIDANCE].matcher(None, lark, frozenset({STOP}))
    assert allowed(m) >= {ord("y"), ord("n"), ord("7")} and ord("x") not in allowed(m)
    with pytest.raises(SchemaError, match="JSON Schemas only"):
        COMPILERS[GrammarBackend.XGRAMMAR].matcher(None, lark, frozenset({STOP}))


def test_objects_that_declare_properties_allow_no_others_unless_they_say_so():
    declared = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert matches(declared, '{"a": 1}') and not matches(declared, '{"a": 1, "b": 2}')
    opened = {**declared, "additionalProperties": {"type": "string"}}
    assert matches(opened, '{"a": 1, "b": "x"}')
    nested = {"type": "array", "items": {"anyOf": [declared, {"type": "null"}]}}
    assert not matches(nested, '[{"a": 1, "b": 2}]')
    assert matches({"type": "object"}, '{"b": 2}')  # no properties declared: any object
    const = {"const": {"properties": {"x": 1}}}  # a value, not a schema: left as it is
    assert matches(const, '{"properties":{"x":1}}')

"""Structured output: schemas compile or are refused by name, and the matcher lets through
exactly the JSON texts a schema allows (checked against the `jsonschema` validator)."""

from __future__ import annotations

import json
import random
import re
from datetime import datetime
from typing import Any

import jsonschema
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from engine.structured import JsonMatcher, SchemaError, TokenMatcher, compile_schema, grammar_for

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
}
TREE = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "value": {"type": "number"},
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
            },
            "required": ["value", "children"],
        }
    },
    "$ref": "#/$defs/node",
}
CHOICES = {
    "anyOf": [
        {"const": {"kind": "fixed", "n": [1, 2]}},
        {"type": "object", "properties": {"kind": {"const": "free"}}, "required": ["kind"],
         "additionalProperties": {"type": "string", "maxLength": 3}},
        {"type": "array", "minItems": 2, "maxItems": 3, "items": {"type": "string"}},
    ]
}  # fmt: skip
ANY_OBJECT = {"type": "object"}


def matches(schema: Any, text: str | bytes) -> bool:
    matcher = JsonMatcher(compile_schema(schema))
    data = text.encode() if isinstance(text, str) else text
    state = matcher.advance(matcher.start, data)
    return state is not None and matcher.can_end(state)


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ('{"name": "Ann", "age": 41}', True),
        ('{"name":"Ann","age":-0,"height":1.5e-3,"tags":["a",3],"alive":false}', True),
        ('{"name": "Ann", "age": 41, "height": null}', True),
        (' \n{ "name" : "Ann" ,\n  "age" : 7 }', True),
        ('{"name": "Zoë 日本", "age": 1}', True),
        ('{"name": "a\\"\\u00e9\\n", "age": 1}', True),
        ('{"age": 41, "name": "Ann"}', False),  # properties come in the schema's order
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
        ('{"name": "Ann", "age": 1} ', False),  # nothing after the value
        ('{\n\n"name": "Ann", "age": 1}', False),  # one line break per gap
        ("{" + " " * 21 + '"name": "Ann", "age": 1}', False),  # and 20 bytes
    ],
)
def test_a_schema_lets_through_exactly_its_texts(text, ok):
    assert matches(PERSON, text) is ok
    if ok:
        jsonschema.validate(json.loads(text), PERSON)


def test_strings_must_be_well_formed_utf8():
    for bad in (b"\xc0\xaf", b"\xe0\x80\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xff"):
        assert not matches(ANY_OBJECT, b'{"k": "' + bad + b'"}'), bad
    assert matches(ANY_OBJECT, '{"k": "\u00e9\u20ac\U0001f600"}')


def test_a_recursive_schema_and_choices_of_every_kind():
    assert matches(TREE, '{"value": 1, "children": [{"value": 2, "children": []}]}')
    assert not matches(TREE, '{"value": 1, "children": [{"value": 2}]}')
    assert matches(CHOICES, '{"kind":"fixed","n":[1,2]}')
    assert not matches(CHOICES, '{"kind": "fixed", "n": [1, 2]}')  # constants are compact
    assert matches(CHOICES, '{"kind": "free", "x": "abc", "y": ""}')
    assert not matches(CHOICES, '{"kind": "free", "x": "abcd"}')
    assert matches(CHOICES, '["a", "b"]') and not matches(CHOICES, '["a"]')


def test_an_enum_or_const_beside_a_type_keeps_the_values_of_that_type():
    schema = {"type": "string", "enum": ["a", 1, "b", None]}
    assert matches(schema, '"a"') and matches(schema, '"b"')
    assert not matches(schema, "1") and not matches(schema, "null")
    assert matches({"type": ["integer", "null"], "enum": [1, 2.0, "x", None]}, "null")
    assert matches({"type": "integer", "const": 3}, "3")
    with pytest.raises(SchemaError, match="no value of enum has the schema's type"):
        compile_schema({"type": "boolean", "enum": [1, "true"]})


def test_enums_are_read_in_one_pass_even_when_one_value_starts_another():
    schema = {"type": "object", "properties": {"n": {"enum": [1, 12, "a", [1]]}}}
    for value, ok in [(1, True), (12, True), (123, False), ("a", True), ([1], True), (2, False)]:
        assert matches(schema, json.dumps({"n": value})) is ok, value
    many = {"enum": [f"value-{i}" for i in range(4000)]}
    assert matches(many, '"value-3999"') and not matches(many, '"value-4000"')
    matcher = JsonMatcher(compile_schema(many))
    state = matcher.advance(matcher.start, b'"value-1')
    assert state is not None and len(state) == 1  # one stack, not one per value


def test_numbers_end_only_where_a_number_may():
    schema = {"type": "number"}
    for text, ok in [("0", True), ("-1.25e+10", True), ("1.", False), ("-", False),
                     ("1e", False), ("00", False), (".5", False), ("1E5", True)]:  # fmt: skip
        assert matches(schema, text) is ok, text


def max_whitespace_run(text: str) -> int:
    return max((len(m) for m in re.findall(r"[ \t\n\r]+", text)), default=0)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(json_values, st.sampled_from([None, 1, 2]), st.booleans())
def test_every_json_text_is_any_value_and_objects_are_any_object(value, indent, ascii_only):
    text = json.dumps(value, indent=indent, ensure_ascii=ascii_only)
    assume(max_whitespace_run(text) <= 20)
    assert matches(True, text)
    assert matches(ANY_OBJECT, text) is isinstance(value, dict)


def random_text(matcher: JsonMatcher, rng: random.Random) -> bytes | None:
    """A random walk through the bytes `matcher` allows: None if it ran too long."""
    state, text = matcher.start, bytearray()
    while not matcher.is_final(state):
        if matcher.can_end(state) and rng.random() < 0.3:
            break
        allowed = [b for b, ok in enumerate(matcher.next_bytes(state)) if ok]
        assert allowed, f"a dead end after {bytes(text)!r}"
        closing = [b for b in allowed if b in b'"]}']
        byte = rng.choice(closing if closing and len(text) > 40 else allowed)
        next_state = matcher.advance(state, bytes((byte,)))
        assert next_state is not None
        state = next_state
        text.append(byte)
        if len(text) > 400:
            return None
    return bytes(text)


FORMATTED = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "format": "uuid"},
        "when": {"type": "string", "format": "date-time"},
        "code": {"type": "string", "pattern": "^[A-Z]{2}(-[0-9]{2,4})?$"},
        "score": {"type": "number", "minimum": -1.5, "exclusiveMaximum": 2},
        "count": {"type": "integer", "exclusiveMinimum": 9, "maximum": 12},
    },
    "required": ["id", "when", "code", "score", "count"],
}


@pytest.mark.parametrize("schema", [PERSON, TREE, CHOICES, ANY_OBJECT, FORMATTED])
def test_every_text_the_matcher_lets_through_is_valid_json_of_the_schema(schema):
    matcher = JsonMatcher(compile_schema(schema))
    rng = random.Random(7)
    texts = [t for t in (random_text(matcher, rng) for _ in range(60)) if t is not None]
    assert len(texts) >= 30
    for text in texts:
        value = json.loads(text.decode("utf-8"))
        jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())
        if schema is FORMATTED:
            datetime.fromisoformat(value["when"])


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "string", "multipleOf": 2}, r"\$: keyword 'multipleOf' is not supported"),
        (
            {"properties": {"a": {"type": "integer", "minimum": "0"}}},
            r"\$.properties.a.minimum: must be a number",
        ),
        ({"type": "integer", "minimum": 3, "maximum": 2}, "no number lies within its bounds"),
        ({"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 2}, "no number lies"),
        ({"type": "string", "pattern": "(?=a)b"}, "lookaround"),
        ({"type": "string", "pattern": "(a)\\1"}, r"\\1 is not supported"),
        ({"type": "string", "pattern": "a^b"}, "only at the ends"),
        ({"type": "string", "pattern": "[é-ü]"}, "non-ASCII ranges are not supported"),
        ({"type": "string", "pattern": "[^é]"}, "non-ASCII characters in negated classes"),
        ({"type": "string", "pattern": "a{3,2}"}, "counts down"),
        ({"type": "string", "pattern": "(ab"}, "not closed"),
        ({"type": "string", "format": "uri-reference"}, "'uri-reference' is not supported"),
        ({"type": "string", "format": "date", "pattern": "."}, "together are not supported"),
        ({"oneOf": [{"type": "string"}]}, "keyword 'oneOf' is not supported"),
        ({"allOf": [{"type": "string"}, {"maxLength": 2}]}, "allOf of one schema"),
        ({"anyOf": [{"type": "string"}], "type": "string"}, "'anyOf' beside other keywords"),
        ({"type": "object", "properties": {}, "required": ["a"]}, "'a' is not in properties"),
        ({"type": "strin"}, "unknown type 'strin'"),
        ({"type": "array", "minItems": 3, "maxItems": 2}, "maxItems is below minItems"),
        ({"type": "string", "maxLength": -1}, "maxLength: must be a non-negative integer"),
        ({"$ref": "#/$defs/missing"}, "names no definition"),
        ({"$ref": "http://example.com/s.json"}, "refs are supported"),
        (False, "allows no value"),
        ({"enum": []}, "non-empty list"),
    ],
)
def test_unsupported_or_invalid_schemas_are_refused_by_name(schema, message):
    with pytest.raises(SchemaError, match=message):
        compile_schema(schema)


def test_schema_texts_are_checked_before_compiling():
    with pytest.raises(SchemaError, match="not valid JSON"):
        grammar_for("{")
    with pytest.raises(SchemaError, match="larger than"):
        grammar_for(json.dumps({"description": "x" * 70_000}))
    assert grammar_for('{"type": "object"}') is grammar_for('{"type": "object"}')


# a small vocabulary: the 256 bytes, a few longer tokens, a special token and a stop token
VOCAB: list[bytes | None] = [bytes((b,)) for b in range(256)]
VOCAB += [b'{"', b'": ', b"true", b"}", b"Paris", b'"}', None, None]
SPECIAL, STOP = len(VOCAB) - 2, len(VOCAB) - 1


def token_matcher(schema: Any) -> TokenMatcher:
    return TokenMatcher(JsonMatcher(compile_schema(schema)), VOCAB, frozenset({STOP}))


def test_tokens_are_checked_by_their_bytes_and_stop_tokens_only_end_a_value():
    tm = token_matcher({"type": "integer"})
    assert not tm.allows(STOP) and not tm.allows(SPECIAL) and not tm.allows(VOCAB.index(b"true"))
    tm.accept(ord("4"))
    assert tm.allows(STOP) and tm.allows(ord("2")) and not tm.is_final
    tm.accept(STOP)
    assert tm.is_final
    tm = token_matcher({"type": "object", "properties": {"a": {"type": "boolean"}}})
    for token in (b'{"', b"a", b'": ', b"true", b"}"):
        assert tm.allows(VOCAB.index(token)), token
        tm.accept(VOCAB.index(token))
    assert tm.is_final and not any(tm.allows(b) for b in range(256))  # nothing may follow


# -- patterns, formats and bounded numbers --------------------------------------------------

PATTERNS = [
    r"^[A-Z]{2}-\d{3}$",
    r"abc",
    r"^(foo|ba[rz])+$",
    r"^a.?c",
    r"x*y{2,3}$",
    r"^[^aeiou ]*$",
    r"^\w+@\w+\.(com|org)$",
    r"^(?:\d{1,3}\.){1}\d+$",
    r"^\s\S\D\W$",
    r"^[aé€]+x?$",
]


@pytest.mark.parametrize("pattern", PATTERNS)
@settings(max_examples=120, deadline=None)
@given(text=st.text(alphabet="abcfoqrzxyAZ019-.@ _éx€", max_size=12))
def test_pattern_strings_match_as_pythons_re_searches(pattern, text):
    expected = re.search(pattern, text, flags=re.ASCII) is not None
    assert (
        matches({"type": "string", "pattern": pattern}, json.dumps(text, ensure_ascii=False))
        is expected
    )


def test_strings_of_a_pattern_hold_no_escapes():
    schema = {"type": "string", "pattern": "^.+$"}
    assert matches(schema, '"a b"') and not matches(schema, '"a\\nb"')
    assert not matches(schema, '"a\\"b"')


@pytest.mark.parametrize(
    ("form", "good", "bad"),
    [
        (
            "date",
            "2024-02-29",
            ["2023-02-29", "2100-02-29", "2024-04-31", "2024-13-01", "2024-1-01", "0000-01-01"],
        ),
        ("time", "23:59:59Z", ["24:00:00Z", "12:00:00", "23:59:60Z"]),
        ("date-time", "2024-05-06T07:08:09.123+02:00", ["2024-05-06 07:08:09Z", "2024-05-06"]),
        ("uuid", "123e4567-e89b-12d3-a456-426614174000", ["123e4567e89b12d3a456426614174000"]),
        ("email", "ann.lee@mail.example.org", ["ann", "ann@", "@example.org"]),
        ("ipv4", "192.168.0.255", ["256.1.1.1", "1.2.3"]),
        ("uri", "https://example.org/a?b=c", ["no scheme", "1http://x"]),
    ],
)
def test_formats_allow_their_strings_only(form, good, bad):
    schema = {"type": "string", "format": form}
    assert matches(schema, json.dumps(good))
    for text in bad:
        assert not matches(schema, json.dumps(text)), text


def test_pattern_strings_count_characters_for_their_lengths():
    schema = {"type": "string", "pattern": "^[a-zé]*$", "minLength": 2, "maxLength": 3}
    texts = ("a", "éé", "abé", "abcd")
    assert [matches(schema, json.dumps(t, ensure_ascii=False)) for t in texts] == [
        False, True, True, False,
    ]  # fmt: skip


decimals = st.decimals(min_value=-1000, max_value=1000, places=3, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(
    low=st.none() | decimals, high=st.none() | decimals, value=decimals,
    exclusive=st.tuples(st.booleans(), st.booleans()), integer=st.booleans(),
)  # fmt: skip
def test_bounded_numbers_allow_exactly_the_values_within_bounds(
    low, high, value, exclusive, integer
):
    assume(low is None or high is None or low < high)
    schema: dict[str, Any] = {"type": "integer" if integer else "number"}
    if low is not None:
        schema["exclusiveMinimum" if exclusive[0] else "minimum"] = float(low)
    if high is not None:
        schema["exclusiveMaximum" if exclusive[1] else "maximum"] = float(high)
    if integer:
        value = value.to_integral_value()
    text = format(value, "f")
    within = (low is None or (value > low if exclusive[0] else value >= low)) and (
        high is None or (value < high if exclusive[1] else value <= high)
    )
    try:
        compile_schema(schema)
    except SchemaError:  # an integer range with no integer in it
        assert integer
        return
    assert matches(schema, text) is within
    if low is not None or high is not None:  # bounded numbers are written without exponents
        assert not matches(schema, "1e2")


def test_a_schemas_patterns_are_bounded_together():
    field = {"type": "string", "pattern": "^a{250}b{250}$"}
    compile_schema({"type": "object", "properties": {"a": field, "b": field}})
    many = {"type": "object", "properties": {f"f{i}": field for i in range(40)}}
    with pytest.raises(SchemaError, match="patterns are too large together"):
        compile_schema(many)

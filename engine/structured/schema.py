"""JSON Schema -> the grammar nodes that `engine.structured.matcher` walks byte by byte.

What a schema may say: `type` (one name or a list), `properties` / `required` /
`additionalProperties`, `items` / `minItems` / `maxItems`, `minLength` / `maxLength`, `enum`,
`const`, `anyOf`, `allOf` of one schema, `$ref` into `$defs` or `definitions` (recursion
included), and `true` / `{}` for any value. Annotations (`title`, `description`, `default`,
`examples`, ...) are ignored. Every other keyword is refused with its location, so no
constraint a client relies on is silently dropped.

How the output is shaped where JSON Schema leaves a choice: properties come in the schema's
order, and one missing from `required` may be left out. An object schema that declares
`properties` allows no others unless `additionalProperties` says so; one that declares none
(`{"type": "object"}`) allows any members. Enum and const values are written in compact form.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from engine.structured.errors import SchemaError
from engine.structured.numbers import bounds_of
from engine.structured.regex import FORMATS, Pattern

# node tags; a node is a tuple whose first item is its tag
ANY, OBJECT, ARRAY, STRING, NUMBER, LITERAL, CHOICE, PATTERN, TRIE = range(9)
# (ANY,)
# (OBJECT, ((key literal, value node, required), ...), additional node or None,
#          required_from: tuple[bool] (does any property from index i on remain required))
# (ARRAY, item node, min items, max items or None)
# (STRING, min length, max length or None)
# (PATTERN, Pattern, min length, max length or None): a string of a pattern or format
# (NUMBER, integer only, Bounds or None)
# (LITERAL, bytes)
# (CHOICE, (node, ...))
# (TRIE, ({byte: state}, ...), frozenset of states where a value ends): one of several fixed
#        texts (an enum), read in one pass however many there are
Node = tuple[Any, ...]

# the nodes every grammar starts with, at these ids
ANY_ID, ANY_OBJECT_ID, ANY_ARRAY_ID, STRING_ID, NUMBER_ID, INTEGER_ID = range(6)
TRUE_ID, FALSE_ID, NULL_ID = range(6, 9)
_BASE_NODES: tuple[Node, ...] = (
    (ANY,),
    (OBJECT, (), ANY_ID, (False,)),
    (ARRAY, ANY_ID, 0, None),
    (STRING, 0, None),
    (NUMBER, False, None),
    (NUMBER, True, None),
    (LITERAL, b"true"),
    (LITERAL, b"false"),
    (LITERAL, b"null"),
)
# what an ANY node may be
ANY_ALTERNATIVES = (ANY_OBJECT_ID, ANY_ARRAY_ID, STRING_ID, NUMBER_ID, TRUE_ID, FALSE_ID, NULL_ID)

MAX_SCHEMA_BYTES = 64 * 1024
MAX_NODES = 4096
MAX_PATTERN_STATES = 16384  # the automaton states of all of a schema's patterns and formats

_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment",
    "deprecated", "readOnly", "writeOnly", "$defs", "definitions",
})  # fmt: skip
_KEYWORDS_BY_TYPE = {
    "object": frozenset({"properties", "required", "additionalProperties"}),
    "array": frozenset({"items", "minItems", "maxItems"}),
    "string": frozenset({"minLength", "maxLength", "pattern", "format"}),
    "number": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}),
    "integer": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}),
    "boolean": frozenset(),
    "null": frozenset(),
}
_TYPED_KEYWORDS = frozenset().union(*_KEYWORDS_BY_TYPE.values())
_COMBINERS = frozenset({"$ref", "enum", "const", "anyOf", "allOf"})


@dataclass(frozen=True)
class Grammar:
    """A compiled schema: `nodes[root]` is the value the output must be."""

    nodes: tuple[Node, ...]
    root: int


@lru_cache(maxsize=256)
def grammar_for(schema_text: str) -> Grammar:
    """The grammar of a JSON Schema given as JSON text (cached: requests repeat schemas).
    Raises SchemaError."""
    if len(schema_text.encode()) > MAX_SCHEMA_BYTES:
        raise SchemaError(f"the schema is larger than {MAX_SCHEMA_BYTES // 1024} KiB")
    try:
        schema = json.loads(schema_text)
    except ValueError as exc:
        raise SchemaError(f"the schema is not valid JSON: {exc}") from None
    return compile_schema(schema)


def compile_schema(schema: Any) -> Grammar:
    """Compile a parsed JSON Schema. Raises SchemaError naming the first unsupported part."""
    compiler = _Compiler(schema)
    root = compiler.compile(schema, "$")
    return Grammar(tuple(compiler.nodes), root)


@lru_cache(maxsize=256)
def _pattern(source: str) -> Pattern:
    return Pattern(source)


def _trie(texts: list[bytes]) -> tuple[tuple[dict[int, int], ...], frozenset[int]]:
    """The states of a byte trie of `texts` (state 0 is the root), and where a text ends."""
    table: list[dict[int, int]] = [{}]
    ends = set()
    for text in texts:
        state = 0
        for byte in text:
            if byte not in table[state]:
                table[state][byte] = len(table)
                table.append({})
            state = table[state][byte]
        ends.add(state)
    return tuple(table), frozenset(ends)


def _literal(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


class _Compiler:
    def __init__(self, root: Any) -> None:
        self.root = root
        self.nodes: list[Node] = list(_BASE_NODES)
        self.refs: dict[str, int] = {}
        self.pattern_states = 0

    def add(self, node: Node) -> int:
        if len(self.nodes) >= MAX_NODES:
            raise SchemaError(f"the schema compiles to more than {MAX_NODES} parts")
        self.nodes.append(node)
        return len(self.nodes) - 1

    def compile(self, schema: Any, path: str) -> int:
        if schema is True:
            return ANY_ID
        if schema is False:
            raise SchemaError(f"{path}: the schema `false` allows no value")
        if not isinstance(schema, Mapping):
            raise SchemaError(f"{path}: a schema must be an object or a boolean")
        keys = set(schema) - _ANNOTATIONS
        unknown = keys - _TYPED_KEYWORDS - _COMBINERS - {"type"}
        if unknown:
            raise SchemaError(f"{path}: keyword {sorted(unknown)[0]!r} is not supported")
        combiners = keys & _COMBINERS
        if combiners:
            name = min(combiners)
            if name in ("enum", "const") and keys == {name, "type"}:  # values of those types
                return self._typed_values(name, schema, path)
            if len(keys) > 1:
                raise SchemaError(f"{path}: {name!r} beside other keywords is not supported")
            return self._combiner(name, schema[name], f"{path}.{name}")
        types = schema.get("type")
        if types is None:
            if not keys:
                return ANY_ID
            types = _implied_types(keys)
        if isinstance(types, str):
            return self._typed(types, schema, path)
        if not isinstance(types, list) or not types:
            raise SchemaError(f"{path}.type: must be a type name or a non-empty list of them")
        return self._choice([self._typed(t, schema, path) for t in dict.fromkeys(types)])

    def _typed_values(self, name: str, schema: Mapping[str, Any], path: str) -> int:
        """An enum or const beside `type`: its values of that type (or those types)."""
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        values = schema[name] if name == "enum" else [schema[name]]
        if not isinstance(values, list):
            raise SchemaError(f"{path}.enum: must be a non-empty list")
        kept = [v for v in values if any(_is_type(v, t) for t in types)]
        if not kept:
            raise SchemaError(f"{path}: no value of {name} has the schema's type")
        return self._combiner("enum", kept, f"{path}.{name}")

    def _choice(self, alternatives: list[int]) -> int:
        if len(alternatives) == 1:
            return alternatives[0]
        return self.add((CHOICE, tuple(alternatives)))

    def _combiner(self, name: str, value: Any, path: str) -> int:
        if name == "$ref":
            return self._ref(value, path)
        if name == "const":
            return self.add((LITERAL, _literal(value)))
        if not isinstance(value, list) or not value:
            raise SchemaError(f"{path}: must be a non-empty list")
        if name == "enum":
            literals = list(dict.fromkeys(_literal(v) for v in value))
            if len(literals) == 1:
                return self.add((LITERAL, literals[0]))
            return self.add((TRIE, *_trie(literals)))
        if name == "allOf":
            if len(value) != 1:
                raise SchemaError(f"{path}: only an allOf of one schema is supported")
            return self.compile(value[0], f"{path}[0]")
        return self._choice([self.compile(s, f"{path}[{i}]") for i, s in enumerate(value)])

    def _ref(self, ref: Any, path: str) -> int:
        if not isinstance(ref, str):
            raise SchemaError(f"{path}: must be a string")
        if ref in self.refs:
            return self.refs[ref]
        target: Any = self.root
        if ref != "#":
            parts = ref.split("/")
            if parts[0] != "#" or len(parts) != 3 or parts[1] not in ("$defs", "definitions"):
                raise SchemaError(f"{path}: only '#' and '#/$defs/<name>' refs are supported")
            definitions = self.root.get(parts[1]) if isinstance(self.root, Mapping) else None
            target = definitions.get(parts[2]) if isinstance(definitions, Mapping) else None
            if target is None:
                raise SchemaError(f"{path}: {ref!r} names no definition")
        # a one-way choice stands in for the target while it compiles (it may refer to itself)
        slot = self.add((CHOICE, ()))
        self.refs[ref] = slot
        self.nodes[slot] = (CHOICE, (self.compile(target, ref),))
        return slot

    def _typed(self, name: Any, schema: Mapping[str, Any], path: str) -> int:
        if name not in _KEYWORDS_BY_TYPE:
            raise SchemaError(f"{path}.type: unknown type {name!r}")
        if name == "object":
            return self._object(schema, path)
        if name == "array":
            lo, hi = _bounds(schema, "minItems", "maxItems", path)
            items = self.compile(schema.get("items", True), f"{path}.items")
            if (lo, hi, items) == (0, None, ANY_ID):
                return ANY_ARRAY_ID
            return self.add((ARRAY, items, lo, hi))
        if name == "string":
            return self._string(schema, path)
        if name == "boolean":
            return self._choice([TRUE_ID, FALSE_ID])
        if name == "null":
            return NULL_ID
        integer = name == "integer"
        bounds = bounds_of(schema, integer, path)
        if bounds is None:
            return INTEGER_ID if integer else NUMBER_ID
        return self.add((NUMBER, integer, bounds))

    def _string(self, schema: Mapping[str, Any], path: str) -> int:
        lo, hi = _bounds(schema, "minLength", "maxLength", path)
        pattern, form = schema.get("pattern"), schema.get("format")
        if pattern is None and form is None:
            return STRING_ID if (lo, hi) == (0, None) else self.add((STRING, lo, hi))
        if pattern is not None and form is not None:
            raise SchemaError(f"{path}: 'pattern' and 'format' together are not supported")
        if form is not None:
            if form not in FORMATS:
                raise SchemaError(
                    f"{path}.format: {form!r} is not supported (supported: {', '.join(FORMATS)})"
                )
            pattern = FORMATS[form]
        if not isinstance(pattern, str):
            raise SchemaError(f"{path}.pattern: must be a string")
        compiled = _pattern(pattern)
        self.pattern_states += len(compiled.edges)
        if self.pattern_states > MAX_PATTERN_STATES:
            raise SchemaError(f"{path}: the schema's patterns are too large together")
        return self.add((PATTERN, compiled, lo, hi))

    def _object(self, schema: Mapping[str, Any], path: str) -> int:
        properties = schema.get("properties", {})
        required = schema.get("required", [])
        if not isinstance(properties, Mapping):
            raise SchemaError(f"{path}.properties: must be an object")
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaError(f"{path}.required: must be a list of property names")
        missing = [name for name in required if name not in properties]
        if missing:
            raise SchemaError(f"{path}.required: {missing[0]!r} is not in properties")
        extra = schema.get("additionalProperties", not properties)
        additional = None if extra is False else self.compile(extra, f"{path}.additionalProperties")
        if not properties and additional == ANY_ID:
            return ANY_OBJECT_ID
        members = tuple(
            (_literal(name), self.compile(sub, f"{path}.properties.{name}"), name in required)
            for name, sub in properties.items()
        )
        required_from = tuple(any(m[2] for m in members[i:]) for i in range(len(members) + 1))
        return self.add((OBJECT, members, additional, required_from))


def _is_type(value: Any, name: Any) -> bool:
    """Whether a JSON value is of the JSON Schema type `name`."""
    if name == "integer":
        return type(value) is int or (type(value) is float and value.is_integer())
    if name == "number":
        return type(value) in (int, float)
    kinds = {"string": str, "boolean": bool, "null": type(None), "object": dict, "array": list}
    return name in kinds and type(value) is kinds[name]


def _implied_types(keys: set[str]) -> list[str]:
    """The types a schema without `type` describes through its keywords."""
    return [t for t, words in _KEYWORDS_BY_TYPE.items() if keys & words]


def _bounds(schema: Mapping[str, Any], low: str, high: str, path: str) -> tuple[int, int | None]:
    lo, hi = schema.get(low, 0), schema.get(high)
    for name, value in ((low, lo), (high, hi)):
        if value is not None and (type(value) is not int or value < 0):
            raise SchemaError(f"{path}.{name}: must be a non-negative integer")
    if hi is not None and hi < lo:
        raise SchemaError(f"{path}: {high} is below {low}")
    return lo, hi

"""The schemas bench/structured_output.py compiles: adversarial patterns, and a corpus of real
ones (pydantic models as pydantic writes them, OpenAI function definitions, one schema per
JSON Schema keyword)."""

from __future__ import annotations

import datetime
import enum
from typing import Any, Literal

ADVERSARIAL = {
    "nested_optional": "^((a?){255}){8}$",  # 4,090 states built up front
    "nested_stars": "^(a*)*(b+)+(c|d*)*$",
    "nested_counts": "^((a|b){1,100}){1,100}$",
    # four copies of each fit the 64 KiB a schema may take
    "long_alternation": "^(" + "|".join(f"w{i}x" for i in range(1500)) + ")$",
    "prefix_alternation": "^(" + "|".join("a" * i for i in range(1, 120)) + ")$",
    "large_counts": "^[a-z]{1000}[0-9]{1000}$",
    "email_backtracking": "^([a-zA-Z0-9_.+-]+)+@(([a-zA-Z0-9-])+\\.)+([a-zA-Z0-9]{2,4})+$",
}


def _pydantic() -> dict[str, Any]:
    import pydantic

    class Unit(enum.Enum):
        C = "celsius"
        F = "fahrenheit"

    class Address(pydantic.BaseModel):
        street: str
        city: str = pydantic.Field(max_length=40)
        zip: str = pydantic.Field(pattern=r"^\d{5}$")

    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(min_length=1, max_length=40)
        age: int = pydantic.Field(ge=0, le=150)
        email: str | None = None
        addresses: list[Address] = pydantic.Field(max_length=3)
        born: datetime.date

    class Reading(pydantic.BaseModel):
        unit: Unit
        value: float = pydantic.Field(multiple_of=0.5)
        tags: set[str] = pydantic.Field(max_length=4)

    class Node(pydantic.BaseModel):
        label: str
        children: list[Node] = pydantic.Field(default_factory=list, max_length=2)

    class Cat(pydantic.BaseModel):
        kind: Literal["cat"]
        lives: int

    class Dog(pydantic.BaseModel):
        kind: Literal["dog"]
        good: bool

    class Pet(pydantic.BaseModel):
        pet: Cat | Dog = pydantic.Field(discriminator="kind")
        extra: dict[str, int] = pydantic.Field(default_factory=dict)

    models = (Address, Person, Reading, Node, Pet)
    return {f"pydantic/{m.__name__}": m.model_json_schema() for m in models}


_FUNCTIONS: dict[str, Any] = {
    "get_weather": {
        "type": "object",
        "properties": {
            "location": {"type": "string", "description": "City and country"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["location"],
        "additionalProperties": False,
    },
    "search_flights": {
        "type": "object",
        "properties": {
            "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "date": {"type": "string", "format": "date"},
            "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
            "cabin": {"type": ["string", "null"], "enum": ["economy", "business", None]},
        },
        "required": ["origin", "destination", "date", "passengers", "cabin"],
        "additionalProperties": False,
    },
    "create_event": {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "start": {"type": "string", "format": "date-time"},
            "attendees": {
                "type": "array",
                "items": {"type": "string", "format": "email"},
                "minItems": 1,
                "maxItems": 5,
            },
            "reminder_minutes": {"type": "integer", "multipleOf": 5},
        },
        "required": ["title", "start", "attendees"],
    },
    "run_sql": {
        "type": "object",
        "properties": {
            "query": {"type": "string", "maxLength": 200},
            "params": {"type": "array", "items": {"type": ["string", "number", "boolean", "null"]}},
        },
        "required": ["query"],
    },
    "set_thermostat": {
        "type": "object",
        "properties": {
            "target": {"type": "number", "exclusiveMinimum": 5, "exclusiveMaximum": 35},
            "mode": {"const": "heat"},
        },
        "required": ["target", "mode"],
    },
}

_KEYWORDS: dict[str, Any] = {
    "type_list": {"type": ["string", "integer"]},
    "enum": {"enum": ["a", 1, None, [1, 2]]},
    "const": {"const": {"k": [1, "x"]}},
    "properties_required": {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
    },
    "additionalProperties": {"type": "object", "additionalProperties": {"type": "boolean"}},
    "patternProperties": {
        "type": "object",
        "patternProperties": {"^x_": {"type": "integer"}},
        "additionalProperties": False,
    },
    "minProperties": {"type": "object", "minProperties": 2},
    "maxProperties": {"type": "object", "maxProperties": 1},
    "propertyNames": {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}},
    "dependentRequired": {
        "type": "object",
        "properties": {"a": {}, "b": {}},
        "dependentRequired": {"a": ["b"]},
    },
    "items_bounds": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    "prefixItems": {
        "type": "array",
        "prefixItems": [{"type": "string"}, {"type": "integer"}],
        "items": False,
    },
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "contains": {"type": "array", "contains": {"const": 3}},
    "string_lengths": {"type": "string", "minLength": 2, "maxLength": 5},
    "pattern": {"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"},
    "format_date": {"type": "string", "format": "date"},
    "format_time": {"type": "string", "format": "time"},
    "format_uuid": {"type": "string", "format": "uuid"},
    "format_ipv4": {"type": "string", "format": "ipv4"},
    "format_uri": {"type": "string", "format": "uri"},
    "format_hostname": {"type": "string", "format": "hostname"},
    "number_bounds": {"type": "number", "minimum": -1.5, "exclusiveMaximum": 2},
    "integer_bounds": {"type": "integer", "exclusiveMinimum": 9, "maximum": 12},
    "multipleOf": {"type": "integer", "multipleOf": 7},
    "anyOf": {"anyOf": [{"type": "string", "maxLength": 2}, {"type": "integer"}]},
    "oneOf_disjoint": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
    "oneOf_overlapping": {"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 2}]},
    "allOf": {"allOf": [{"type": "string"}, {"maxLength": 3}]},
    "not": {"not": {"type": "string"}},
    "if_then_else": {"if": {"type": "integer"}, "then": {"minimum": 0}, "else": {"type": "string"}},
    "ref_recursive": {
        "$defs": {
            "n": {
                "type": "object",
                "properties": {"next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}},
                "required": ["next"],
            }
        },
        "$ref": "#/$defs/n",
    },
    "nullable_union": {"type": ["object", "null"], "properties": {"a": {"type": "string"}}},
}


def corpus() -> dict[str, Any]:
    """Every schema of the corpus by name."""
    return {
        **_pydantic(),
        **{f"function/{name}": schema for name, schema in _FUNCTIONS.items()},
        **{f"keyword/{name}": schema for name, schema in _KEYWORDS.items()},
    }

"""Structured output: generation constrained to JSON text that matches a JSON Schema.

`schema` compiles a schema into grammar nodes (torch-free: the gateway validates response
formats with it); `matcher` walks them a byte at a time and checks each candidate token.
"""

from engine.structured.errors import SchemaError
from engine.structured.matcher import JsonMatcher, TokenMatcher, json_matcher
from engine.structured.schema import Grammar, compile_schema, grammar_for

__all__ = [
    "Grammar",
    "JsonMatcher",
    "SchemaError",
    "TokenMatcher",
    "compile_schema",
    "grammar_for",
    "json_matcher",
]

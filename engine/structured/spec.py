"""What a request's output must be, checked without a vocabulary (torch-free: the gateway
uses it): a JSON Schema or a Lark grammar, as the llguidance grammar the engine compiles.

`precheck` costs microseconds (sizes, JSON syntax) and may run anywhere. `check` compiles the
grammar's lexer and parser once, within `GrammarLimits` (llguidance's own fuel and size caps,
then a budget of CPU time), and names what it refuses: a keyword llguidance cannot enforce,
a malformed pattern, an unsatisfiable schema. Callers run it off any event loop.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import llguidance

from engine.structured.errors import SchemaError

MAX_SCHEMA_BYTES = 64 * 1024
MAX_GRAMMAR_BYTES = 128 * 1024
# whitespace between JSON tokens: enough to pretty-print (one line break, indentation), too
# little for a model to loop on: at most 20 bytes of spaces and tabs, one of them maybe "\n"
JSON_WHITESPACE = "|".join(
    ["[ \t]{0,20}", *(f"[ \t]{{{i}}}\n[ \t]{{0,{19 - i}}}" for i in range(20))]
)
_JSON_OPTIONS: Any = {"whitespace_pattern": JSON_WHITESPACE}
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*?)\]")
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")


@dataclass(frozen=True)
class GrammarLimits:
    """How much work one grammar may cost. `compile_cpu_s`: CPU time to check it (a grammar
    over it is refused). The rest are llguidance's caps: lexer fuel to build the grammar's
    regexes (about 50 per microsecond) and per token mask (about 14 per microsecond), Earley
    items per mask, lexer states (1-2 kB each) and grammar symbols. A mask that runs out of
    fuel fails its request, never the batch."""

    compile_cpu_s: float = 0.1
    initial_lexer_fuel: int = 1_000_000
    step_lexer_fuel: int = 100_000
    step_max_items: int = 20_000
    max_lexer_states: int = 50_000
    max_grammar_size: int = 200_000

    def __post_init__(self) -> None:
        if not 0.0 < self.compile_cpu_s <= 60.0:
            raise ValueError("compile_cpu_s must be in (0, 60]")
        for name in (
            "initial_lexer_fuel",
            "step_lexer_fuel",
            "step_max_items",
            "max_lexer_states",
            "max_grammar_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")

    def parser_limits(self) -> llguidance.LLParserLimits:
        return llguidance.LLParserLimits(
            initial_lexer_fuel=self.initial_lexer_fuel,
            step_lexer_fuel=self.step_lexer_fuel,
            step_max_items=self.step_max_items,
            max_lexer_states=self.max_lexer_states,
            max_grammar_size=self.max_grammar_size,
            verbose_errors=False,
        )


DEFAULT_LIMITS = GrammarLimits()


def precheck(json_schema: str | None, grammar: str | None) -> None:
    """The checks that cost nothing: one kind of constraint, within its size, JSON a schema.
    Raises SchemaError."""
    if json_schema is not None and grammar is not None:
        raise SchemaError("a JSON Schema and a grammar together are not supported")
    if json_schema is not None:
        if len(json_schema.encode()) > MAX_SCHEMA_BYTES:
            raise SchemaError(f"the schema is larger than {MAX_SCHEMA_BYTES // 1024} KiB")
        try:
            json.loads(json_schema)
        except ValueError as exc:
            raise SchemaError(f"the schema is not valid JSON: {exc}") from None
    if grammar is not None and len(grammar.encode()) > MAX_GRAMMAR_BYTES:
        raise SchemaError(f"the grammar is larger than {MAX_GRAMMAR_BYTES // 1024} KiB")


def grammar_text(json_schema: str | None, grammar: str | None) -> str:
    """The llguidance grammar of a JSON Schema (given as JSON text) or a Lark grammar.
    Raises SchemaError for a schema that is not JSON."""
    precheck(json_schema, grammar)
    if grammar is not None:
        return llguidance.LLMatcher.grammar_from_lark(grammar)
    assert json_schema is not None
    try:
        schema = closed(json.loads(json_schema))
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    except ValueError as exc:
        raise SchemaError(readable(str(exc))) from None


# where a schema's values are schemas (one, a list, or a map of them)
_ONE = (
    "additionalProperties",
    "items",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
)
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed(schema: Any) -> Any:
    """`schema` with every object that declares `properties` closed to others unless it says
    otherwise (`additionalProperties`, `patternProperties`): where JSON Schema leaves the
    choice, the output holds what the schema describes, as OpenAI's strict mode does, rather
    than members a model may go on inventing. Enum and const values are left as they are."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if key in out:
            out[key] = closed(out[key])
    for key in _LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(sub) for sub in out[key]]
    for key in _MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    if isinstance(out.get("items"), list):  # draft 4's tuples
        out["items"] = [closed(sub) for sub in out["items"]]
    open_keys = ("additionalProperties", "patternProperties", "unevaluatedProperties")
    if "properties" in out and not any(key in out for key in open_keys):
        out["additionalProperties"] = False
    return out


def check(
    json_schema: str | None, grammar: str | None, limits: GrammarLimits = DEFAULT_LIMITS
) -> None:
    """Compile the grammar once without a vocabulary, within `limits`. Raises SchemaError
    naming what is refused. Blocks for up to about `limits.compile_cpu_s` of CPU time (the
    calling thread's own, so a busy machine does not turn a cheap grammar into a refused
    one): call it off the event loop."""
    refusal = _refusal(grammar_text(json_schema, grammar), limits)
    if refusal is not None:
        raise SchemaError(refusal)


@lru_cache(maxsize=256)
def _refusal(text: str, limits: GrammarLimits) -> str | None:
    """Why a grammar is refused (None: it is not). Requests repeat their schemas: each
    distinct grammar is compiled once."""
    started = time.thread_time()
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        text, None, limits=limits.parser_limits()
    )
    spent = time.thread_time() - started
    if failed:
        return readable(messages[0])
    if spent > limits.compile_cpu_s:
        return (
            f"the grammar takes {spent * 1e3:.0f} ms to compile; the limit is "
            f"{limits.compile_cpu_s * 1e3:.0f} ms"
        )
    return None


def readable(message: str) -> str:
    """llguidance's message in a line, naming refused keywords and formats as such."""
    if found := _UNIMPLEMENTED.search(message):
        names = [name.strip().strip('"') for name in found[1].split(",")]
        listed = ", ".join(f"'{name}'" for name in names)
        return f"keyword{'s' if len(names) > 1 else ''} {listed} {_are(names)} not supported"
    if found := _UNKNOWN_FORMAT.search(message):
        return f"format '{found[1]}' is not supported"
    line = " ".join(message.split())
    return line if len(line) <= 300 else line[:297] + "..."


def _are(names: list[str]) -> str:
    return "are" if len(names) > 1 else "is"

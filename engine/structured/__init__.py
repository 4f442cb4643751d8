"""Structured output: generation constrained to a JSON Schema or a Lark grammar.

`spec` checks a request's constraint without a vocabulary (torch-free, as this package's
top level is: the gateway checks response formats with it, off its event loop);
`backend` is the engine's interface to a grammar engine (llguidance by default, xgrammar for
comparison), whose matchers fill each step's token bitmask; `bitmask` applies those masks to
a batch's logits. docs/structured-output.md says why llguidance, with the figures.
"""

from engine.structured.errors import SchemaError
from engine.structured.spec import DEFAULT_LIMITS, GrammarLimits, check, precheck

__all__ = ["DEFAULT_LIMITS", "GrammarLimits", "SchemaError", "check", "precheck"]

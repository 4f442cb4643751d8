"""The grammar compiler of a backend (engine/structured/backend.py's interface)."""

from __future__ import annotations

from engine.config import GrammarBackend
from engine.structured.backend import GrammarCompiler, Vocabulary
from engine.structured.spec import DEFAULT_LIMITS, GrammarLimits


def make_compiler(
    backend: GrammarBackend, vocabulary: Vocabulary, limits: GrammarLimits = DEFAULT_LIMITS
) -> GrammarCompiler:
    """`backend`'s compiler over `vocabulary`, within `limits`."""
    if backend is GrammarBackend.XGRAMMAR:
        from engine.structured.xgrammar_backend import XGrammarCompiler  # noqa: PLC0415

        return XGrammarCompiler(vocabulary, limits)
    from engine.structured.llguidance_backend import LLGuidanceCompiler  # noqa: PLC0415

    return LLGuidanceCompiler(vocabulary, limits)

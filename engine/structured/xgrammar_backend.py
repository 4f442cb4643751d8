"""xgrammar behind `GrammarCompiler`, for comparison with llguidance (the default): JSON
Schemas only (a Lark grammar, and so a native tool-call format, is refused). Its compiler
builds each grammar's token-mask cache up front, which is what makes its masks fast and its
worst-case patterns slow to compile (docs/structured-output.md)."""

from __future__ import annotations

import json

import torch
import xgrammar

from engine.structured.backend import GrammarCompiler, TokenMatcher, Vocabulary, mask_words
from engine.structured.errors import SchemaError
from engine.structured.spec import GrammarLimits, precheck

_MAX_WHITESPACE = 20  # as llguidance's grammars (JSON_WHITESPACE), less the one-line-break rule


class XGrammarMatcher(TokenMatcher):
    def __init__(
        self, matcher: xgrammar.GrammarMatcher, stop_ids: frozenset[int], eos: int, size: int
    ) -> None:
        super().__init__(stop_ids, [eos])
        self._matcher = matcher
        self._eos = eos
        self._words = mask_words(size)

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def _accept(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def can_end(self) -> bool:
        return self._matcher.is_completed()

    def _is_stopped(self) -> bool:
        if not self._matcher.is_completed():
            return False
        scratch = torch.zeros(1, self._words, dtype=torch.int32)
        self._matcher.fill_next_token_bitmask(scratch, 0)
        scratch[0, self._eos >> 5] &= ~(1 << (self._eos & 31))
        return not bool(scratch.any())


class XGrammarCompiler(GrammarCompiler):
    def __init__(self, vocabulary: Vocabulary, limits: GrammarLimits) -> None:
        super().__init__(vocabulary, limits)
        self._eos = vocabulary.eos_token_id if vocabulary.eos_token_id is not None else 0
        info = xgrammar.TokenizerInfo(
            [data or b"" for data in vocabulary.token_bytes],
            xgrammar.VocabType.RAW,
            vocab_size=vocabulary.size,
            stop_token_ids=[self._eos],
        )
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=True)

    def matcher(
        self, json_schema: str | None, grammar: str | None, stop_ids: frozenset[int]
    ) -> TokenMatcher:
        precheck(json_schema, grammar)
        if json_schema is None:
            raise SchemaError("the xgrammar backend takes JSON Schemas only")
        try:
            compiled = self._compiler.compile_json_schema(
                json.loads(json_schema), max_whitespace_cnt=_MAX_WHITESPACE
            )
        except (RuntimeError, ValueError) as exc:
            raise SchemaError(" ".join(str(exc).split())[:300]) from None
        return XGrammarMatcher(
            xgrammar.GrammarMatcher(compiled), stop_ids, self._eos, self.vocabulary.size
        )

"""llguidance (the Rust grammar engine vLLM and SGLang use) behind `GrammarCompiler`: JSON
Schemas and Lark grammars, full-vocabulary masks computed from a token trie, lexers built
lazily (so a pathological pattern costs fuel, bounded by `GrammarLimits`, not states)."""

from __future__ import annotations

import threading
from collections import OrderedDict

import llguidance
import torch

from engine.structured.backend import GrammarCompiler, TokenMatcher, Vocabulary
from engine.structured.errors import SchemaError
from engine.structured.spec import GrammarLimits, grammar_text, readable

_KEPT_GRAMMARS = 64  # compiled grammars kept to be copied for requests that repeat them


def ll_tokenizer(vocabulary: Vocabulary) -> llguidance.LLTokenizer:
    """llguidance's view of the vocabulary: each token's bytes (special tokens by their
    spelling, marked special), EOS, and the tokenizer for texts a grammar spells out."""
    wrapper = llguidance.TokenizerWrapper.__new__(llguidance.TokenizerWrapper)
    wrapper.eos_token_id = vocabulary.eos_token_id  # type: ignore[assignment]
    wrapper.bos_token_id = None
    wrapper.tokens = [
        data if data is not None else vocabulary.special_texts.get(i, "").encode()
        for i, data in enumerate(vocabulary.token_bytes)
    ]
    wrapper.special_token_ids = sorted(vocabulary.special_texts)
    wrapper.is_tokenizer_wrapper = True
    wrapper._accepts_bytes = False
    wrapper._gtokenizer = vocabulary.encode
    return llguidance.LLTokenizer(wrapper, n_vocab=vocabulary.size)


class LLGuidanceMatcher(TokenMatcher):
    def __init__(
        self, matcher: llguidance.LLMatcher, stop_ids: frozenset[int], eos: int | None
    ) -> None:
        super().__init__(stop_ids, [] if eos is None else [eos])
        self._matcher = matcher

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        words = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        if self._matcher.is_error():
            words.zero_()

    def _accept(self, token_id: int) -> bool:
        return self._matcher.consume_token(token_id)

    def can_end(self) -> bool:
        return self._matcher.is_accepting()

    def _is_stopped(self) -> bool:
        return self._matcher.is_stopped()


class LLGuidanceCompiler(GrammarCompiler):
    def __init__(self, vocabulary: Vocabulary, limits: GrammarLimits) -> None:
        super().__init__(vocabulary, limits)
        self.tokenizer = ll_tokenizer(vocabulary)
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(
        self, json_schema: str | None, grammar: str | None, stop_ids: frozenset[int]
    ) -> TokenMatcher:
        text = grammar_text(json_schema, grammar)
        with self._lock:
            start = self._compiled.get(text)
            if start is not None:
                self._compiled.move_to_end(text)
        if start is None:
            start = llguidance.LLMatcher(
                self.tokenizer, text, log_level=0, limits=self.limits.parser_limits()
            )
            if start.is_error():
                raise SchemaError(readable(start.get_error()))
            with self._lock:
                self._compiled[text] = start
                if len(self._compiled) > _KEPT_GRAMMARS:
                    self._compiled.popitem(last=False)
        return LLGuidanceMatcher(start.deep_copy(), stop_ids, self.vocabulary.eos_token_id)

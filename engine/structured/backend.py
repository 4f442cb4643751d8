"""The engine's structured output interface: a grammar backend compiles a request's constraint
against the model's vocabulary into a `TokenMatcher`, which writes each step's mask of
allowed tokens (one bit per vocabulary entry) and follows the tokens sampled.

Backends (`GrammarBackend`): llguidance, the default, and xgrammar (JSON Schemas only; kept
for comparison, docs/structured-output.md has the figures). Whichever it is, the matcher ends
a value the same way: the request's own stop tokens (EOS unless `ignore_eos`, its
`stop_token_ids`) are allowed exactly where the value may end, and no other special token is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.structured.spec import GrammarLimits

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class Vocabulary:
    """What a backend needs of the tokenizer. `token_bytes[id]`: the bytes token `id` adds to
    the text (None for special tokens and unknown ids); `special_texts`: each special token's
    spelling; `encode`: text to token ids, no special tokens added."""

    token_bytes: Sequence[bytes | None]
    special_texts: dict[int, str]
    eos_token_id: int | None
    encode: Callable[[str], list[int]]

    @property
    def size(self) -> int:
        return len(self.token_bytes)

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> Vocabulary:
        special = sorted(tokenizer.all_special_ids)
        return cls(
            token_bytes=tokenizer.token_bytes(),
            special_texts=dict(zip(special, tokenizer.convert_ids_to_tokens(special), strict=True)),
            eos_token_id=tokenizer.eos_token_id,
            encode=lambda text: tokenizer.encode(text, add_special_tokens=False),
        )

    def padded(self, size: int) -> Vocabulary:
        """The vocabulary of a model with `size` token ids (embedding rows past the
        tokenizer's own are never allowed)."""
        if size <= self.size:
            return replace(self, token_bytes=self.token_bytes[:size])
        return replace(self, token_bytes=[*self.token_bytes, *[None] * (size - self.size)])


def mask_words(vocab_size: int) -> int:
    """int32 words in one row of a token bitmask."""
    return (vocab_size + 31) // 32


class TokenMatcher(ABC):
    """One request's progress through its grammar. Mutated by `fill_mask` (it may mark the
    request `stuck`: no token can continue) and `accept`."""

    def __init__(self, stop_ids: frozenset[int], backend_stops: Sequence[int]) -> None:
        self.stop_ids = sorted(stop_ids)
        # the backend's own end tokens: allowed only when they are the request's stop tokens
        self._foreign_stops = [t for t in backend_stops if t not in stop_ids]
        self.stuck = False
        self.is_final = False  # complete, and nothing may follow: the request ends here

    @abstractmethod
    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the backend's mask into `bitmask[row]` ([W] int32 on the host)."""

    @abstractmethod
    def _accept(self, token_id: int) -> bool:
        """Advance past a token the grammar allows; False if it does not."""

    @abstractmethod
    def can_end(self) -> bool:
        """Whether the text so far is a complete value."""

    @abstractmethod
    def _is_stopped(self) -> bool:
        """Whether no token but an end token may follow."""

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` ([W] int32 on the host)."""
        self._fill(bitmask, row)
        words = bitmask[row].numpy().view(np.uint32)
        for token in self._foreign_stops:
            words[token >> 5] &= ~np.uint32(1 << (token & 31))
        if self.can_end():
            for token in self.stop_ids:
                if token >> 5 < len(words):
                    words[token >> 5] |= np.uint32(1 << (token & 31))
        if not words.any():
            self.stuck = True

    def accept(self, token_id: int) -> None:
        """Advance past `token_id`, which the last mask allowed. A stop token ends it."""
        if token_id in self.stop_ids:
            assert self.can_end(), f"stop token {token_id} before the value is complete"
            self.is_final = True
            return
        ok = self._accept(token_id)
        assert ok, f"token {token_id} is not allowed"
        self.is_final = self._is_stopped()


class GrammarCompiler(ABC):
    """Compiles requests' constraints for one vocabulary; safe to call from several threads."""

    def __init__(self, vocabulary: Vocabulary, limits: GrammarLimits) -> None:
        self.vocabulary = vocabulary
        self.limits = limits

    @abstractmethod
    def matcher(
        self, json_schema: str | None, grammar: str | None, stop_ids: frozenset[int]
    ) -> TokenMatcher:
        """A fresh matcher at the start of the grammar. Raises SchemaError."""

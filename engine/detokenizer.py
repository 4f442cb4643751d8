"""Streaming token ids -> text, and stop strings over a text stream.

`IncrementalDetokenizer` decodes only a short window per step (the prefix/read offset scheme):
the window starts at the tokens of the last emitted chunk, whose text is known, so the new text
is whatever the whole window decodes to beyond it. Text is held back while it ends in an
incomplete UTF-8 sequence (U+FFFD), so a character split across byte tokens is emitted whole.
"""

from __future__ import annotations

from typing import Protocol


class TokenDecoder(Protocol):
    """What the detokenizer needs from `engine.tokenizer.Tokenizer`."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas, one step at a time.

    Invariant: the concatenation of every `add` and `flush` result equals
    `tokenizer.decode(all_output_ids, skip_special_tokens)`, i.e. the output is decoded on its
    own, as transformers decodes a generation (a SentencePiece first token loses its leading
    space). `prompt_token_ids` is accepted for call-site symmetry and does not change the text.
    """

    def __init__(
        self,
        tokenizer: TokenDecoder,
        prompt_token_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        del prompt_token_ids
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # _window[:_read_offset] decodes to _prefix_text, which was already emitted
        self._window: list[int] = []
        self._read_offset = 0
        self._prefix_text = ""
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """The output text emitted so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def add(self, token_ids: list[int]) -> str:
        """Append generated `token_ids` and return the text they complete: "" while the text
        ends in an incomplete character. Mutates the decode window and `text`."""
        self._window.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Emit held-back text when generation ends (an incomplete character decodes to
        U+FFFD, as in a full decode). Mutates the decode window and `text`."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read_offset == len(self._window):
            return ""
        new_text = self._decode(self._window)
        if not final and (new_text.endswith(_REPLACEMENT) or new_text == self._prefix_text):
            return ""
        # Decoders used here (byte-level, SentencePiece) decode a window as a continuation of
        # its first token's text, so the already emitted part is a prefix.
        assert new_text.startswith(self._prefix_text), (new_text, self._prefix_text)
        delta = new_text[len(self._prefix_text) :]
        # slide: the tokens just read become the next prefix
        del self._window[: self._read_offset]
        self._read_offset = len(self._window)
        self._prefix_text = self._decode(self._window)
        self._chunks.append(delta)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


class StopStringMatcher:
    """Cuts a text stream at the first stop string, across any delta boundaries.

    "First" is the occurrence that completes first (ties: the one that starts first). Text that
    could still be the start of a stop string is held back (at most `max(len(s)) - 1` chars)
    until it is ruled out. Invariant: everything emitted equals the stream up to the stop
    string (plus the stop string if `include_stop_str_in_output`), or the whole stream.
    """

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        self._stops = sorted({s for s in stop if s})
        self._include_stop = include_stop_str_in_output
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""
        self.matched: str | None = None

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Add `delta`; return the text now safe to emit and the stop string that matched
        (None while none has). After a match every call returns ("", that stop string).
        Mutates the held-back text and `matched`."""
        if self.matched is not None:
            return "", self.matched
        text = self._held + delta
        found = [(i + len(s), i, s) for s in self._stops if (i := text.find(s)) >= 0]
        if found:
            end, start, stop = min(found)
            self.matched, self._held = stop, ""
            return text[: end if self._include_stop else start], stop
        hold = self._partial_suffix_len(text)
        self._held = text[len(text) - hold :]
        return text[: len(text) - hold], None

    def flush(self) -> str:
        """Release held-back text when generation ends without a stop string."""
        held, self._held = self._held, ""
        return held

    def _partial_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for size in range(min(self._max_hold, len(text)), 0, -1):
            tail = text[-size:]
            if any(s.startswith(tail) for s in self._stops):
                return size
        return 0

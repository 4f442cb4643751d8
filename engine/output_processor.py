"""Token ids in, text out: incremental detokenization plus stop strings, per request.

The engine core stops on token ids only; whoever holds the tokenizer (the offline `LLM`, the
gateway) runs a `TextStream` per request and aborts the engine request when a stop string
matches.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from engine.protocol import FinishReason, RequestOutput, SamplingParams, TokenLogprob
from engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class TextDelta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: FinishReason | None
    stop_reason: str | int | None  # the stop string or stop token id that ended it
    num_output_tokens: int
    prompt_logprobs: list[TokenLogprob] | None = None  # the prompt's scores, when asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class TextStream:
    """Turns one request's `RequestOutput`s into text deltas.

    Mutates its own detokenizer state. A delta that is finished while its RequestOutput is
    not means a stop string matched: the caller should abort the request in the engine.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens
        )
        self.matcher = (
            StopStringMatcher(list(params.stop), params.include_stop_str_in_output)
            if params.stop
            else None
        )
        self.min_tokens = params.min_tokens
        self.text = ""
        self.token_ids: list[int] = []
        self.finish_reason: FinishReason | None = None

    def process(self, out: RequestOutput) -> TextDelta:
        """The text of `out`'s new tokens. With stop strings, an output of several tokens
        (accepted drafts) is read a token at a time: tokens after the one that completes a
        stop string are dropped, as if the request had ended there."""
        assert self.finish_reason is None, "output after the request finished"
        ids = out.new_token_ids
        if self.matcher is None or len(ids) <= 1:
            text, finish, reason = self._read(ids, out, out.num_output_tokens, out.finished)
            kept = list(ids)
        else:
            before = out.num_output_tokens - len(ids)
            text, kept = "", []
            for j, token_id in enumerate(ids):
                last = j == len(ids) - 1
                piece, finish, reason = self._read(
                    [token_id], out, before + j + 1, out.finished and last
                )
                text += piece
                kept.append(token_id)
                if finish is not None:
                    break
        self.token_ids.extend(kept)
        self.text += text
        self.finish_reason = finish
        return TextDelta(
            text=text,
            token_ids=kept,
            logprobs=out.new_logprobs,
            finish_reason=finish,
            stop_reason=reason,
            num_output_tokens=out.num_output_tokens - len(ids) + len(kept),
            prompt_logprobs=out.prompt_logprobs,
        )

    def _read(
        self, ids: list[int], out: RequestOutput, num_output_tokens: int, last: bool
    ) -> tuple[str, FinishReason | None, str | int | None]:
        """The text of `ids`, the last of `out`'s tokens when `last`: how the request ends
        there (the engine's reason, or a stop string's), and the text that stands."""
        delta = self.detokenizer.add(ids)
        if last:
            delta += self.detokenizer.flush()
        finish = out.finish_reason if last else None
        reason: str | int | None = out.stop_reason if last else None
        text = delta
        # stop strings are looked for after min_tokens: the text of earlier tokens passes
        if self.matcher is not None and num_output_tokens > self.min_tokens:
            text, matched = self.matcher.feed(delta)
            if matched is not None:
                finish, reason = FinishReason.STOP, matched
            elif finish is not None:
                text += self.matcher.flush()
        return text, finish, reason

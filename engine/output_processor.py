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
        assert self.finish_reason is None, "output after the request finished"
        self.token_ids.extend(out.new_token_ids)
        delta = self.detokenizer.add(out.new_token_ids)
        if out.finished:
            delta += self.detokenizer.flush()
        finish, stop_reason = out.finish_reason, out.stop_reason
        text = delta
        reason: str | int | None = stop_reason
        # stop strings are looked for after min_tokens: the text of earlier tokens passes
        if self.matcher is not None and out.num_output_tokens > self.min_tokens:
            text, matched = self.matcher.feed(delta)
            if matched is not None:
                finish, reason = FinishReason.STOP, matched
            elif finish is not None:
                text += self.matcher.flush()
        self.text += text
        self.finish_reason = finish
        return TextDelta(
            text=text,
            token_ids=list(out.new_token_ids),
            logprobs=out.new_logprobs,
            finish_reason=finish,
            stop_reason=reason,
            num_output_tokens=out.num_output_tokens,
            prompt_logprobs=out.prompt_logprobs,
        )

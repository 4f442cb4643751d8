"""OpenAI response bodies and SSE streams for chat and text completions."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import msgspec

from engine.output_processor import TextDelta
from engine.protocol import EngineDeadError, InvalidRequestError, TokenLogprob
from engine.tokenizer import Tokenizer
from gateway.openai_types import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    ErrorBody,
    ErrorInfo,
    PromptTokensDetails,
    TokenLogprobContent,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from gateway.pipeline import ChoiceResult, JobStream, Tally
from gateway.prepare import Job
from gateway.tool_formats import NativeReplyStream
from gateway.tools import ReplyStream

_encode = msgspec.json.Encoder().encode
DONE = b"data: [DONE]\n\n"


def sse(obj: msgspec.Struct) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


def usage_of(job: Job, tally: Tally) -> Usage:
    return Usage(
        prompt_tokens=job.num_prompt_tokens,
        completion_tokens=tally.completion_tokens,
        total_tokens=job.num_prompt_tokens + tally.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=tally.cached_tokens,
            cached_tokens_host=tally.cached_host_tokens,
            cached_tokens_disk=tally.cached_disk_tokens,
        ),
    )


class Renderer:
    """Token-level details (logprob token strings) need the tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def chat_logprobs(self, items: Sequence[TokenLogprob]) -> ChoiceLogprobs:
        content = []
        for lp in items:
            text = self._token(lp.token_id)
            tops = [
                TopLogprob(token=(t := self._token(i)), logprob=v, bytes=list(t.encode()))
                for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)
            ]
            content.append(
                TokenLogprobContent(
                    token=text, logprob=lp.logprob, bytes=list(text.encode()), top_logprobs=tops
                )
            )
        return ChoiceLogprobs(content=content)

    def completion_logprobs(
        self,
        items: Sequence[TokenLogprob],
        offset: int,
        prompt: Sequence[int] = (),
        prompt_scores: Sequence[TokenLogprob] = (),
    ) -> CompletionLogprobs:
        """The generated tokens' logprobs, their text starting at `offset`; with echo, the
        `prompt` tokens come first (from offset 0), scored from the second one on."""
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])

        def add(token_id: int, at: int, lp: TokenLogprob | None) -> int:
            text = self._token(token_id)
            out.tokens.append(text)
            out.text_offset.append(at)
            out.token_logprobs.append(None if lp is None else lp.logprob)
            out.top_logprobs.append(
                None
                if lp is None
                else {self._token(i): v for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)}
            )
            return at + len(text)

        if prompt:
            at = add(prompt[0], 0, None)
            for lp in prompt_scores:
                at = add(lp.token_id, at, lp)
        for lp in items:
            offset = add(lp.token_id, offset, lp)
        return out

    # -- whole responses --------------------------------------------------------------------

    def chat_completion(
        self, job: Job, results: list[ChoiceResult], tally: Tally
    ) -> ChatCompletion:
        choices = []
        for r in results:
            message, finish = AssistantMessage(content=r.text), r.finish_reason
            if job.tools is not None:
                message, finish = job.tools.parse_reply(r.text, r.finish_reason)
            logprobs = self.chat_logprobs(r.logprobs) if job.params.logprobs is not None else None
            choices.append(
                ChatChoice(
                    index=r.index,
                    message=message,
                    finish_reason=finish,
                    stop_reason=r.stop_reason,
                    logprobs=logprobs,
                )
            )
        return ChatCompletion(
            id=job.request_id,
            created=job.created,
            model=job.model,
            choices=choices,
            usage=usage_of(job, tally),
        )

    def completion(self, job: Job, results: list[ChoiceResult], tally: Tally) -> Completion:
        choices = []
        for r in results:
            prompt = job.prompt_of(r.index)
            echo = None if job.echo_texts is None else job.echo_texts[prompt]
            logprobs = None
            if job.params.logprobs is not None:
                logprobs = self.completion_logprobs(
                    r.logprobs,
                    len(echo or ""),
                    () if echo is None else job.prompts[prompt],
                    r.prompt_logprobs,
                )
            choices.append(
                CompletionChoice(
                    index=r.index,
                    text=(echo or "") + r.text,
                    finish_reason=r.finish_reason,
                    stop_reason=r.stop_reason,
                    logprobs=logprobs,
                )
            )
        return Completion(
            id=job.request_id,
            created=job.created,
            model=job.model,
            choices=choices,
            usage=usage_of(job, tally),
        )

    # -- streams ----------------------------------------------------------------------------

    def _chunk(
        self,
        job: Job,
        index: int,
        delta: TextDelta | None,
        prompt_scores: Sequence[TokenLogprob] | None = None,
    ) -> msgspec.Struct:
        """A chunk with `delta`'s text (None: the chat role's opening chunk); the echoed
        prompt's chunk carries the prompt's scores."""
        finish = delta.finish_reason.value if delta and delta.finish_reason else None
        stop_reason = delta.stop_reason if delta and delta.finish_reason else None
        text = delta.text if delta else ""
        logprobs = delta.logprobs if delta and job.params.logprobs is not None else None
        if job.endpoint == "chat.completions":
            choice = ChatChunkChoice(
                index=index,
                delta=ChatDelta(role="assistant", content="")
                if delta is None
                else ChatDelta(content=text),
                finish_reason=finish,
                stop_reason=stop_reason,
                logprobs=self.chat_logprobs(logprobs) if logprobs else None,
            )
            return ChatCompletionChunk(
                id=job.request_id, created=job.created, model=job.model, choices=[choice]
            )
        rendered = None
        if prompt_scores is not None and job.params.logprobs is not None:
            prompt = job.prompts[job.prompt_of(index)]
            rendered = self.completion_logprobs(logprobs or (), 0, prompt, prompt_scores)
        elif logprobs:
            rendered = self.completion_logprobs(logprobs, 0)
        cchoice = CompletionChoice(
            index=index, text=text, finish_reason=finish, stop_reason=stop_reason, logprobs=rendered
        )
        return Completion(
            id=job.request_id, created=job.created, model=job.model, choices=[cchoice]
        )

    def _reply_chunk(
        self, job: Job, index: int, deltas: list[TextDelta], text: str
    ) -> msgspec.Struct:
        """A tool-calling choice's last chunk, once its reply is whole: the reply's content
        not yet sent (`text`), or its calls."""
        last = deltas[-1]
        assert last.finish_reason is not None and job.tools is not None
        message, finish = job.tools.parse_reply(text, last.finish_reason.value)
        if message.tool_calls is None:
            delta = ChatDelta(content=message.content)
        else:
            calls = [
                ToolCallDelta(index=k, id=c.id, function=c.function)
                for k, c in enumerate(message.tool_calls)
            ]
            delta = ChatDelta(content=message.content, tool_calls=calls)
        logprobs = [lp for d in deltas for lp in d.logprobs or ()]
        choice = ChatChunkChoice(
            index=index,
            delta=delta,
            finish_reason=finish,
            stop_reason=last.stop_reason,
            logprobs=self.chat_logprobs(logprobs) if logprobs else None,
        )
        return ChatCompletionChunk(
            id=job.request_id, created=job.created, model=job.model, choices=[choice]
        )

    def _usage_chunk(self, job: Job, tally: Tally) -> msgspec.Struct:
        usage = usage_of(job, tally)
        if job.endpoint == "chat.completions":
            return ChatCompletionChunk(
                id=job.request_id, created=job.created, model=job.model, choices=[], usage=usage
            )
        return Completion(
            id=job.request_id, created=job.created, model=job.model, choices=[], usage=usage
        )

    async def stream(self, run: JobStream) -> AsyncIterator[bytes]:
        """SSE events for a job's stream (the pipeline runs and settles it; this formats)."""
        job = run.job
        try:
            if job.endpoint == "chat.completions":
                for i in range(job.n):
                    yield sse(self._chunk(job, i, None))
            echo = job.echo_texts
            echoed = [echo is None] * job.num_choices
            # tool-calling replies: read as they come; calls held until whole
            readers: dict[int, ReplyStream | NativeReplyStream] = {}
            held: dict[int, list[TextDelta]] = {}
            async for index, delta in run:
                if echo is not None and not echoed[index]:
                    # the prompt, with its scores when asked, arrives with the first output
                    echoed[index] = True
                    prompt = TextDelta(echo[job.prompt_of(index)], [], None, None, None, 0)
                    yield sse(self._chunk(job, index, prompt, delta.prompt_logprobs or ()))
                if job.tools is not None:
                    held.setdefault(index, []).append(delta)
                    reader = readers.setdefault(index, job.tools.reader())
                    text = reader.feed(delta.text)
                    if text is not None:  # a text answer: its characters as they come
                        deltas = held.pop(index)
                        delta = TextDelta(
                            text,
                            [],
                            [lp for d in deltas for lp in d.logprobs or ()],
                            delta.finish_reason,
                            delta.stop_reason,
                            delta.num_output_tokens,
                        )
                    elif delta.finish_reason is not None:  # only whole calls can be read
                        yield sse(self._reply_chunk(job, index, held.pop(index), reader.unreleased))
                        continue
                    else:
                        continue
                if delta.text or delta.logprobs or delta.finish_reason is not None:
                    yield sse(self._chunk(job, index, delta))
            if job.include_usage:
                yield sse(self._usage_chunk(job, run.tally))
            yield DONE
        except (EngineDeadError, InvalidRequestError) as exc:
            message = (
                f"the inference engine failed while generating; the response is incomplete ({exc})"
            )
            error = ErrorInfo(message=message, type="server_error", code="engine_error")
            yield b"data: " + _encode(ErrorBody(error=error)) + b"\n\n"
            yield DONE

"""Offline generation in one process: `strata generate`, tests and benchmarks use this."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.factory import create_engine
from engine.output_processor import TextStream
from engine.protocol import (
    FinishReason,
    LoRARequest,
    SamplingParams,
    Scheduling,
    TokenLogprob,
)
from engine.tokenizer import Tokenizer

Prompt = str | list[int]


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # with SamplingParams.prompt_logprobs: the scores of prompt tokens 1..
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    num_cached_host_tokens: int = 0
    num_cached_disk_tokens: int = 0


class LLM:
    """An EngineCore plus tokenizer, driven synchronously until every request finishes."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        progress: bool = False,
        core: EngineCore | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        if core is None or tokenizer is None:
            core, tokenizer = create_engine(config or EngineConfig(), progress=progress)
        self.core = core
        self.tokenizer = tokenizer
        self._ids = itertools.count()

    def encode(self, prompt: Prompt, *, chat: bool = False) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if chat:
            return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat: bool = False,
        priorities: Sequence[int] | None = None,
        scheduling: Scheduling | None = None,
        lora: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[Completion]:
        """Run all prompts as one continuously batched workload; results in prompt order.
        `scheduling` applies to every prompt (`priorities`, when given, override its
        priority one by one); `lora` is one adapter for all, or one (or None) per prompt.

        Raises InvalidRequestError (before anything runs) if any request is invalid.
        """
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(prompts)
        else:
            params_list = list(params)
        assert len(params_list) == len(prompts)
        results: dict[str, Completion] = {}
        streams: dict[str, TextStream] = {}
        added: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params_list, strict=True)):
                rid = f"gen-{next(self._ids)}"
                ids = self.encode(prompt, chat=chat)
                sched = scheduling
                if priorities:
                    sched = msgspec.structs.replace(sched or Scheduling(), priority=priorities[i])
                adapter = lora if lora is None or isinstance(lora, LoRARequest) else lora[i]
                self.core.add_request(rid, ids, p, scheduling=sched, lora=adapter)
                added.append(rid)
                results[rid] = Completion(rid, ids)
                streams[rid] = TextStream(self.tokenizer, ids, p)
        except BaseException:
            for rid in added:
                self.core.abort_request(rid)
            raise
        pending = set(added)
        while pending:
            for out in self.core.step():
                if out.request_id not in pending:
                    continue
                delta = streams[out.request_id].process(out)
                done = results[out.request_id]
                done.text += delta.text
                done.token_ids.extend(delta.token_ids)
                done.logprobs.extend(delta.logprobs or ())
                done.prompt_logprobs.extend(out.prompt_logprobs or ())
                done.num_cached_tokens = out.num_cached_tokens
                done.num_cached_host_tokens = out.num_cached_host_tokens
                done.num_cached_disk_tokens = out.num_cached_disk_tokens
                if delta.finished:
                    done.finish_reason = delta.finish_reason
                    done.stop_reason = delta.stop_reason
                    pending.discard(out.request_id)
                    if not out.finished:  # a stop string ended it before the engine did
                        self.core.abort_request(out.request_id)
        return [results[rid] for rid in added]

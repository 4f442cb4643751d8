"""Per-request state owned by the scheduler.

The single scheduling invariant: each step a request's `num_computed_tokens` catches up with
`num_tokens` (prompt + generated). Prefill, chunked prefill, recompute after preemption and
decode are all that one rule.
"""

from __future__ import annotations

import enum
import time

import torch

from engine.protocol import FinishReason, SamplingParams, TokenLogprob
from engine.speculative import NgramIndex
from engine.structured.backend import TokenMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"  # admitted, its blocks held; waits outside the batch for its pages
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        tenant: str = "",
        weight: float = 1.0,
        cache_salt: str = "",
        lora_slot: int = 0,
        lora_key: str = "",
        arrival_time: float | None = None,
        device: torch.device | None = None,
    ) -> None:
        assert prompt_token_ids, "empty prompts are rejected before a Request is built"
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.tenant = tenant
        self.weight = weight
        self.cache_salt = cache_salt
        self.lora_slot = lora_slot  # the adapter slot its tokens use (0: the base model)
        self.lora_key = lora_key  # adapter name@version, part of its prefix-cache keys
        self.block_hashes: list[bytes] = []  # prefix-cache hash chain of its full blocks
        self.num_committed_blocks = 0  # leading blocks already offered to the prefix cache
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens whose KV came from the prefix cache
        self.num_cached_host_tokens = 0  # of those, copied back from host RAM
        self.num_cached_disk_tokens = 0  # and from disk
        self.num_cached_remote_tokens = 0  # and from the remote tier
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | None = None
        # tokens/logprobs produced since the last RequestOutput was emitted
        self.num_emitted_tokens = 0
        self.pending_logprobs: list[TokenLogprob] = []
        # with params.prompt_logprobs: the scores of prompt tokens 1.. computed so far (entry
        # j is token j + 1, scored from position j), and how many have been emitted
        self.prompt_logprobs: list[TokenLogprob] = []
        self.num_emitted_prompt_logprobs = 0
        self.matcher: TokenMatcher | None = None  # with a response format: its grammar's progress
        self.draft_index: NgramIndex | None = None  # with speculative decoding: its n-grams
        self.draft_limit = 1 << 30  # the most drafts its next step may take
        self.generator: torch.Generator | None = None
        if params.seed is not None and not params.is_greedy:
            self.generator = torch.Generator(device=device or "cpu")
            self.generator.manual_seed(params.seed % (1 << 64))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def positions_to_score(self, start: int, end: int) -> range:
        """Of the positions [start, end) computed this step, those whose logits score the
        next prompt token and are not scored yet (empty unless prompt logprobs are asked)."""
        if self.params.prompt_logprobs is None:
            return range(0)
        first = max(start, len(self.prompt_logprobs))
        span = range(first, min(end, self.num_prompt_tokens - 1))
        assert not span or first == len(self.prompt_logprobs), "prompt scores must not skip"
        return span

    @property
    def num_scored_prefix(self) -> int:
        """Leading tokens whose KV may come from the prefix cache without losing a prompt
        score: all of them unless the prompt is being scored, else those already scored."""
        if self.params.prompt_logprobs is None:
            return self.num_tokens
        return len(self.prompt_logprobs)

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def finish(self, reason: FinishReason, stop_reason: int | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, {self.status.value})"
        )

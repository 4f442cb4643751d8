"""Continuous batching with chunked prefill, in the vLLM v1 style.

Each step hands every scheduled request some number of new tokens so that its
`num_computed_tokens` catches up with `num_tokens`, under a per-step token budget and a cap
on running sequences. When the KV pool runs dry, running requests are preempted
(recompute: their blocks are freed and they re-enter the waiting queue).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.protocol import FinishReason
from engine.request import Request, RequestStatus
from engine.sched_policy import create_policy


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    block_table: list[int]

    @property
    def completes_sequence(self) -> bool:
        """True when this chunk reaches the last known token, so the step samples for it."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.policy = create_policy(config.policy)
        self.waiting = self.policy.new_queue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- queue management ---------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, "duplicate request id"
        self.requests[request.request_id] = request
        self.policy.on_arrival(request)
        self.waiting.add(request)

    def finish_request(
        self, request: Request, reason: FinishReason, stop: int | None = None
    ) -> None:
        """Mark finished, free its blocks and drop it from the queues."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.finish(reason, stop)
        self.block_manager.free(request.request_id)
        if self.requests.pop(request.request_id, None) is not None:
            self.policy.on_finish(request)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- the step -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, allocating their KV blocks.

        Mutates: block tables, the running/waiting queues, and preempted requests'
        `num_computed_tokens` (reset to 0).
        """
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        self.policy.order_running(self.running)

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            assert num_new > 0, f"running request with nothing to compute: {req}"
            target = req.num_computed_tokens + num_new
            while not self.block_manager.can_allocate(req.request_id, target):
                # victims come from the tail of the ranked list, never from what is scheduled
                victim = self.policy.pick_victim(self.running)
                assert self.running.index(victim) >= i
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            table = self.block_manager.allocate(req.request_id, target)
            scheduled.append(ScheduledRequest(req, num_new, table))
            budget -= num_new
            i += 1

        if not preempted:
            while len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
                req = self.waiting.peek()
                num_new = min(req.num_tokens - req.num_computed_tokens, budget)
                target = req.num_computed_tokens + num_new
                if not self.block_manager.can_allocate(req.request_id, target):
                    break
                self.waiting.pop()
                table = self.block_manager.allocate(req.request_id, target)
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                scheduled.append(ScheduledRequest(req, num_new, table))
                budget -= num_new
        return SchedulerOutput(scheduled, preempted)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.readd_preempted(request)

    def advance(self, output: SchedulerOutput) -> None:
        """Credit every scheduled request with the tokens the step computed."""
        for s in output.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
            self.policy.charge(s.request, s.num_new_tokens)

    def check_stop(self, request: Request, eos_token_ids: frozenset[int]) -> bool:
        """Finish `request` if its newest token ends it; returns True when finished."""
        params = request.params
        token = request.all_token_ids[-1]
        if not params.ignore_eos and token in eos_token_ids:
            self.finish_request(request, FinishReason.STOP)
        elif token in params.stop_token_ids:
            self.finish_request(request, FinishReason.STOP, token)
        elif (
            request.num_output_tokens >= params.max_tokens
            or request.num_tokens >= self.max_model_len
        ):
            self.finish_request(request, FinishReason.LENGTH)
        return request.is_finished

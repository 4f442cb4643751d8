"""Continuous batching with chunked prefill, in the vLLM v1 style: each step, every scheduled
request's `num_computed_tokens` catches up with `num_tokens` under a token budget.

Owns the running, waiting and loading queues, preemption, admission of prefix-cache hits
below the device, and draft tokens. The design is in docs/design/scheduler.md.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from engine.block_hash import chain_hashes, namespace, root_hash
from engine.block_manager import BlockManager
from engine.config import SchedulerConfig, SpeculativeConfig
from engine.protocol import FinishReason
from engine.request import Request, RequestStatus
from engine.sched_policy import create_policy
from engine.speculative import DraftGate, NgramIndex, draftable
from kvstore.tiers import Tier

_READ_AHEAD_REQUESTS = 4  # waiting requests whose disk pages are read before their turn


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # including the drafts
    block_table: list[int]
    draft_token_ids: list[int] = field(default_factory=list)  # after the last known token

    @property
    def completes_sequence(self) -> bool:
        """True when this chunk reaches the last known token (and its drafts), so the step
        samples for it."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens + len(
            self.draft_token_ids
        )


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted_ids: list[str] = field(default_factory=list)
    # the copies into (or out of) its requests' blocks that the step waits for
    load_tickets: frozenset[int] = frozenset()

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        cache_namespace: str = "",
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self.config = config
        self.speculative = speculative or SpeculativeConfig()
        spec = self.speculative
        # measures whether drafts pay (the engine core records each decode step's time)
        self.draft_gate = DraftGate() if spec.adaptive and spec.num_speculative_tokens else None
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        # prefix-cache keys: model, KV dtype (from the engine) + the request's salt
        self.cache_namespace = cache_namespace
        self.policy = create_policy(config.policy)
        self.waiting = self.policy.new_queue()
        self.running: list[Request] = []
        self.loading: list[Request] = []  # admitted; their pages still arriving
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
        elif request.status is RequestStatus.LOADING:
            self.loading.remove(request)
        request.finish(reason, stop)
        self.block_manager.free(request.request_id)
        if self.requests.pop(request.request_id, None) is not None:
            self.policy.on_finish(request)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        """Requests holding KV blocks: running, or waiting for their pages."""
        return len(self.running) + len(self.loading)

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

        # each running request's share of the step's drafts
        spec = self.speculative
        draft_share = min(
            spec.num_speculative_tokens, spec.max_step_drafts // max(1, len(self.running))
        )
        if draft_share and self.draft_gate and not self.draft_gate.allow(len(self.running)):
            draft_share = 0
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
            drafts = self._drafts(req, draft_share, budget - num_new, target) if draft_share else []
            num_new += len(drafts)
            table = self.block_manager.allocate(req.request_id, target + len(drafts))
            scheduled.append(ScheduledRequest(req, num_new, table, drafts))
            budget -= num_new
            i += 1

        if not preempted:
            # requests already running take this step: new ones whose pages are still on
            # their way wait outside it
            busy = bool(scheduled)
            budget = self._join_loaded(scheduled, budget, busy)
            loaded = 0  # pages admitted from below the device, while busy
            skipped: list[Request] = []  # their pages are still being read from disk
            while len(self.waiting) and budget > 0 and self.num_running < self.config.max_num_seqs:
                req = self.waiting.peek()
                assert req.num_computed_tokens == 0, "waiting requests hold no KV"
                hits, below, rest = self._cache_hits(req)
                if (below or rest) and not self.block_manager.prefetch_below(
                    req.request_id, below, rest, req.tenant
                ):
                    skipped.append(self.waiting.pop())
                    continue
                if rest and self.block_manager.remote_pages_arrived(req.request_id):
                    hits, below, _ = self._cache_hits(req)  # they continue the prefix
                if busy and loaded and loaded + len(below) > self.config.max_loaded_blocks_per_step:
                    break  # the next step admits it: this one's bookkeeping is spent
                loaded += len(below)
                bs = self.block_manager.block_size
                num_new = min(req.num_tokens - (len(hits) + len(below)) * bs, budget)
                target = (len(hits) + len(below)) * bs + num_new
                if not self.block_manager.can_allocate(req.request_id, target, hits):
                    break
                self.waiting.pop()
                # a request with pages to load waits outside a busy batch: so can its spills
                self.block_manager.allocate(
                    req.request_id,
                    target,
                    hits,
                    below,
                    owner=req.tenant,
                    background=busy and bool(below),
                )
                # pages found below the device (disk pages read ahead by now) are copied into
                # the new blocks before the step that reads them; a page that fails to load
                # is computed
                tiers = self.block_manager.load_below(req.request_id, len(hits), below)
                cached = (len(hits) + len(tiers)) * bs
                req.num_computed_tokens = cached
                req.num_committed_blocks = len(hits) + len(tiers)
                if req.num_preemptions == 0:
                    req.num_cached_tokens = cached
                    req.num_cached_host_tokens = tiers.count(Tier.HOST) * bs
                    req.num_cached_disk_tokens = tiers.count(Tier.DISK) * bs
                    req.num_cached_remote_tokens = tiers.count(Tier.REMOTE) * bs
                if busy and not self.block_manager.loads_ready(req.request_id):
                    req.status = RequestStatus.LOADING
                    self.loading.append(req)
                    continue
                budget = self._seat(req, scheduled, budget)
            for req in reversed(skipped):
                self.waiting.readd_preempted(req)
        self._read_ahead_waiting()
        tickets = self.block_manager.load_tickets(s.request.request_id for s in scheduled)
        return SchedulerOutput(scheduled, preempted, tickets)

    def _seat(self, req: Request, scheduled: list[ScheduledRequest], budget: int) -> int:
        """Add an admitted request to the running batch and this step, with as many of its
        tokens as the budget and its blocks allow; returns the budget left."""
        table = self.block_manager.block_table(req.request_id)
        room = len(table) * self.block_manager.block_size - req.num_computed_tokens
        num_new = min(req.num_tokens - req.num_computed_tokens, budget, room)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        scheduled.append(ScheduledRequest(req, num_new, table))
        return budget - num_new

    def _join_loaded(self, scheduled: list[ScheduledRequest], budget: int, busy: bool) -> int:
        """Seat the loading requests whose pages have arrived, or all of them when no other
        request runs (their layers then wait for their own pages); returns the budget left."""
        for req in list(self.loading):
            if budget <= 0:
                break
            if busy and not self.block_manager.loads_ready(req.request_id):
                continue
            self.loading.remove(req)
            budget = self._seat(req, scheduled, budget)
        return budget

    def _drafts(self, req: Request, share: int, room: int, target: int) -> list[int]:
        """Up to `share` draft tokens for a request whose step computes only its last token
        (and would end at `target` tokens), within `room` more tokens of the step's budget,
        the blocks that are free, and what its recent drafts earned (`Request.draft_limit`);
        [] for a request that may not be drafted for."""
        if req.num_tokens - req.num_computed_tokens != 1:
            return []
        params = req.params
        k = min(
            share,
            req.draft_limit,
            room,
            params.max_tokens - req.num_output_tokens - 1,  # each draft may become a token
            self.max_model_len - req.num_tokens - 1,
        )
        if k <= 0 or not draftable(params, req.num_output_tokens):
            return []
        if req.draft_index is None:
            spec = self.speculative
            req.draft_index = NgramIndex(spec.prompt_lookup_min, spec.prompt_lookup_max)
        drafts = req.draft_index.propose(req.all_token_ids, k)
        if drafts and not self.block_manager.can_allocate(req.request_id, target + len(drafts)):
            return []  # drafts never take blocks another request would have to give up
        return drafts

    def _read_ahead_waiting(self) -> None:
        """Start reading from disk the pages of the next few waiting requests, which could
        not be admitted this step, so that they are in memory when their turn comes."""
        bm = self.block_manager
        if not len(self.waiting) or not (bm.has_disk_tier or bm.has_remote_tier):
            return
        for req in itertools.islice(self.waiting, _READ_AHEAD_REQUESTS):
            _, below, rest = self._cache_hits(req)
            if below or rest:
                bm.prefetch_below(req.request_id, below, rest, req.tenant)

    def _block_hashes(self, request: Request) -> list[bytes]:
        """The hash chain of the request's full blocks, extended to its current tokens."""
        hashes = request.block_hashes
        if len(hashes) < request.num_tokens // self.block_manager.block_size:
            space = namespace(self.cache_namespace, request.cache_salt, request.lora_key)
            parent = hashes[-1] if hashes else root_hash(space)
            hashes += chain_hashes(
                parent, request.all_token_ids, self.block_manager.block_size, len(hashes)
            )
        return hashes

    def _cache_hits(self, request: Request) -> tuple[list[int], list[bytes], list[bytes]]:
        """Cached device blocks for the request's prefix, the hashes of the blocks that
        continue it in the tiers below, and those of the usable blocks after them (what
        the remote tier may hold); hits and tiers leave at least one token to compute
        (its logits are needed)."""
        if not self.block_manager.enable_caching:
            return [], [], []
        # a request scoring its prompt needs the logits of every position it has not scored
        usable = min(request.num_tokens - 1, request.num_scored_prefix)
        usable //= self.block_manager.block_size
        hashes = self._block_hashes(request)[:usable]
        hits = self.block_manager.lookup(hashes)
        below = self.block_manager.lookup_below(request.request_id, hashes[len(hits) :])
        return hits, below, hashes[len(hits) + len(below) :]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.readd_preempted(request)

    def advance(self, output: SchedulerOutput, rejected: dict[str, int] | None = None) -> None:
        """Credit every scheduled request with the tokens the step computed, less its
        `rejected` drafts (request id -> count): their K/V is overwritten by later steps."""
        bm = self.block_manager
        for s in output.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            if s.draft_token_ids:
                refused = (rejected or {}).get(req.request_id, 0)
                req.num_computed_tokens -= refused
                # the next drafts: twice as many after a step that kept them all, else one
                # more than were kept (drafting goes on cheaply through a run of misses)
                kept = len(s.draft_token_ids) - refused
                spec = self.speculative
                req.draft_limit = (
                    kept + 1 if refused else min(2 * kept, spec.num_speculative_tokens)
                )
            self.policy.charge(req, s.num_new_tokens)
            # accepted drafts join the token list after this: their block waits a step
            full = min(req.num_computed_tokens, req.num_tokens) // bm.block_size
            if bm.enable_caching and full > req.num_committed_blocks:
                hashes = self._block_hashes(req)
                bm.commit(req.request_id, hashes[:full], start=req.num_committed_blocks)
                req.num_committed_blocks = full

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

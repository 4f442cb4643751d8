"""Admit a Job, run it on an engine worker, stream or aggregate the result, and settle it:
release the reservation, write exactly one ledger record, and update metrics, whatever way
the request ends (finished, stopped by a stop string, client gone, engine dead).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import msgspec
from redis.exceptions import RedisError

from engine.output_processor import TextDelta, TextStream
from engine.protocol import EngineDeadError, FinishReason, InvalidRequestError, RequestOutput
from gateway.denials import check_key_model, denial
from gateway.errors import APIError
from gateway.fleet import Fleet, ModelGroup, NoWorkerError, WorkerHandle
from gateway.metrics import GatewayMetrics
from gateway.openai_types import ErrorType
from gateway.prepare import Job
from gateway.prices import PriceCache
from policies.admission import (
    Admission,
    Charge,
    Decision,
    DenyReason,
    LeaseState,
    StoreUnavailableError,
)
from policies.budgets import BudgetHold
from policies.headers import rate_limit_headers
from tenants.keys import AuthContext
from tenants.ledger import LedgerWriter
from tenants.pricing import Rates, with_costs
from tenants.records import UsageRecord, UsageStatus

log = logging.getLogger(__name__)

_STATUS = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "cancelled",
    FinishReason.ERROR: "error",
}


@dataclass
class Route:
    """Where a job runs: its model's group and the worker chosen for it."""

    group: ModelGroup
    worker: WorkerHandle
    num_prefill_tokens: int  # of its first prompt: the tokens not cached on the worker
    failed: set[str] = field(default_factory=set)
    # the prefill worker that computes its first prompt's KV for `worker` (a decode
    # worker), once; None: the worker computes it
    prefill: WorkerHandle | None = None

    async def fail(self, worker: WorkerHandle, fleet: Fleet, job: Job) -> bool:
        """`worker` failed this job before any output: move the job to another worker of
        its model (unless a choice before did already). False when none is left."""
        self.failed.add(worker.worker_id)
        if self.worker is not worker:
            return True  # another choice of the job moved it already
        self.prefill = None  # the worker it moves to computes the prompt itself
        try:
            self.worker, self.num_prefill_tokens = await fleet.route(
                self.group,
                token_ids=job.prompts[0],
                cache_salt=job.scheduling.cache_salt,
                lora_key="" if job.lora is None else job.lora.key,
                exclude=tuple(self.failed),
            )
        except NoWorkerError:
            return False
        return True


# a streamed job whose response never starts (the client left as it was sent) is settled as
# cancelled after this long, so its lease and its ledger record never hang
START_GRACE_S = 30.0


@dataclass
class Ticket:
    """An admitted job: who it bills, the headers every response for it carries, and its
    lease's keeper. `begin` and `settle` happen once each, in that order (or settle alone)."""

    auth: AuthContext
    reserved: bool
    headers: dict[str, str]
    route: Route | None = None  # the worker it runs on
    rates: Rates | None = None  # the prices in force at admission (None: unpriced)
    charge: Charge | None = None  # what it holds against budgets
    begun: bool = False
    settled: bool = False
    keeper: asyncio.Task[None] | None = None
    ending: asyncio.Event = field(default_factory=asyncio.Event)
    record: UsageRecord | None = None  # its usage, once settled (for the access log)

    def begin(self) -> bool:
        """Mark the job as running; False when it was settled before it could start."""
        if self.settled:
            return False
        self.begun = True
        return True


@dataclass
class ChoiceResult:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # engine TokenLogprob records
    prompt_logprobs: list = field(default_factory=list)  # the prompt's scores, when asked
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class Tally:
    """What a job actually consumed, filled in as outputs arrive."""

    completion_tokens: int = 0
    first_token_at: float | None = None
    status: UsageStatus | None = None
    engine_started: float | None = None  # first submit to the engine (perf_counter)
    engine_finished: float | None = None  # last final output from the engine
    # per prompt, its best choice's cached prompt tokens: (all tiers, from host, from disk)
    hits: dict[int, tuple[int, int, int]] = field(default_factory=dict)

    def cached(self, prompt: int, out: RequestOutput) -> None:
        """Count a prompt's prefix-cache hits once, however many choices it has."""
        if out.num_cached_tokens > self.hits.get(prompt, (0, 0, 0))[0]:
            self.hits[prompt] = (
                out.num_cached_tokens,
                out.num_cached_host_tokens,
                out.num_cached_disk_tokens,
            )

    @property
    def cached_tokens(self) -> int:
        return sum(h[0] for h in self.hits.values())

    @property
    def cached_host_tokens(self) -> int:
        """Of cached_tokens, those copied back from host RAM."""
        return sum(h[1] for h in self.hits.values())

    @property
    def cached_disk_tokens(self) -> int:
        """Of cached_tokens, those read back from disk."""
        return sum(h[2] for h in self.hits.values())

    def server_timing(self, started: float) -> str:
        """A `Server-Timing` value: time spent waiting on the engine, and the rest of the
        time since `started` (parsing, admission, rendering: the gateway's own cost)."""
        now = time.perf_counter()
        engine = 0.0
        if self.engine_started is not None:
            engine = (self.engine_finished or now) - self.engine_started
        gateway = max(0.0, now - started - engine)
        return f"engine;dur={engine * 1e3:.3f}, gateway;dur={gateway * 1e3:.3f}"


class Pipeline:
    def __init__(
        self,
        fleet: Fleet,
        admission: Admission,
        ledger: LedgerWriter,
        metrics: GatewayMetrics,
        prices: PriceCache | None = None,
    ) -> None:
        self.fleet = fleet
        self.admission = admission
        self.ledger = ledger
        self.metrics = metrics
        self.prices = prices
        self._settling: set[asyncio.Task[None]] = set()
        self._keepers: set[asyncio.Task[None]] = set()

    # -- admission --------------------------------------------------------------------------

    async def _route(self, job: Job) -> Route:
        """The worker a job runs on (every choice on one, so they share the prompt's KV): by
        the fleet's policy, from its first prompt. 503 when no worker of its model is up."""
        group = self.fleet.groups.get(job.base_model)
        try:
            if group is None:
                raise NoWorkerError(f"no worker serves {job.base_model}")
            worker, num_prefill_tokens = await self.fleet.route(
                group,
                token_ids=job.prompts[0],
                cache_salt=job.scheduling.cache_salt,
                lora_key="" if job.lora is None else job.lora.key,
            )
        except NoWorkerError as exc:
            raise APIError(
                503,
                f"the model '{job.model}' has no worker available; retry shortly",
                type="service_unavailable",
                code="model_unavailable",
                headers={"retry-after": "2"},
            ) from exc
        prefill = self.fleet.prefill_worker(
            group,
            worker,
            num_prefill_tokens,
            token_ids=job.prompts[0],
            cache_salt=job.scheduling.cache_salt,
            lora_key="" if job.lora is None else job.lora.key,
        )
        return Route(group, worker, num_prefill_tokens, prefill=prefill)

    async def _rates(self, job: Job) -> Rates | None:
        """The prices in force now for the job's model (its adapter's, when priced)."""
        if self.prices is None:
            return None
        try:
            history = await self.prices.history()
        except (RedisError, OSError):
            return None  # the store is down: admission decides what happens next
        lora = job.lora
        return history.rates_at(
            time.time(),
            job.base_model,
            None if lora is None else lora.name,
            None if lora is None else lora.version,
        )

    def _charge(self, auth: AuthContext, job: Job, rates: Rates | None) -> Charge:
        """The job's worst-case cost and the budgets it is held against."""
        cost = 0
        if rates is not None:
            cost = rates.worst_case_nanos(job.num_prompt_tokens, job.num_choices * job.max_tokens)
        now, tenant, key = time.time(), auth.tenant, auth.key
        tenant_budget = tenant.budget
        key_budget = key.budget
        return Charge(
            cost_nanos=cost,
            tenant_budget=None
            if tenant_budget is None
            else BudgetHold.of(tenant.id, "tenant", tenant_budget, now),
            key_budget=None
            if key_budget is None
            else BudgetHold.of(tenant.id, f"key:{key.id}", key_budget, now),
        )

    async def admit(self, auth: AuthContext, job: Job) -> Ticket:
        """Check the key's model list, reserve every limit and the job's worst-case cost at
        once, and choose the worker. Raises APIError 403 (the key may not use the model),
        429 (denied) or 503 (no worker up; store down and the tenant's policy says
        fail_closed)."""
        check_key_model(auth, job)
        rates = await self._rates(job)
        charge = self._charge(auth, job, rates)
        decision = await self._reserve(
            auth,
            job.request_id,
            job.num_prompt_tokens,
            job.num_choices * job.max_tokens,
            job.kv_tokens,
            job,
            charge,
        )
        route = await self._route(job)
        if decision is None:
            return Ticket(auth, reserved=False, headers={}, route=route, rates=rates)
        ticket = Ticket(
            auth,
            reserved=True,
            headers=rate_limit_headers(decision),
            route=route,
            rates=rates,
            charge=charge,
        )
        ticket.keeper = asyncio.get_running_loop().create_task(
            self._keep(job, ticket), name=f"lease-{job.request_id}"
        )
        self._keepers.add(ticket.keeper)
        ticket.keeper.add_done_callback(self._keepers.discard)
        return ticket

    @contextlib.asynccontextmanager
    async def admitted(self, auth: AuthContext, request_id: str) -> AsyncIterator[dict[str, str]]:
        """Admission for a request that generates nothing (tokenize): one request from the
        tenant's request bucket and a concurrency slot while it runs; no tokens, no KV and
        no ledger record. Yields the rate-limit headers; raises APIError as `admit`."""
        decision = await self._reserve(auth, request_id, 0, 0, 0, None, None)
        try:
            yield {} if decision is None else rate_limit_headers(decision)
        finally:
            if decision is not None:
                with contextlib.suppress(StoreUnavailableError):  # the lease expires
                    await self.admission.release(
                        auth.tenant.id, request_id, used_tokens=0, key_id=auth.key.id
                    )

    async def _reserve(
        self,
        auth: AuthContext,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        kv_tokens: int,
        job: Job | None,
        charge: Charge | None,
    ) -> Decision | None:
        """The allowing decision, or None when the store is down and the tenant fails open;
        raises APIError 429 (denied) or 503 (store down, fail_closed)."""
        tenant, policy = auth.tenant, auth.tenant.policy
        try:
            decision = await self.admission.reserve(
                tenant.id,
                policy,
                request_id,
                prompt_tokens=prompt_tokens,
                max_tokens=max_tokens,
                kv_tokens=kv_tokens,
                key_id=auth.key.id,
                key_limits=auth.key.limits,
                charge=charge,
            )
        except StoreUnavailableError as exc:
            if policy.on_store_unavailable == "fail_open":
                self.metrics.store_bypassed(tenant.id)
                log.warning("store unreachable; admitting %s (fail_open)", request_id)
                return None
            self.metrics.rejected(tenant.id, "store_unavailable")
            raise APIError(
                503,
                "rate-limit store unavailable; retry shortly",
                type="service_unavailable",
                code="store_unavailable",
                headers={"retry-after": "1"},
            ) from exc
        if not decision.allowed:
            reason = decision.reason or "rate_limit"
            self.metrics.rejected(tenant.id, reason)
            kind: ErrorType = "insufficient_quota" if decision.hard else "rate_limit_error"
            code = f"rate_limit_{reason}"
            if reason in (DenyReason.TENANT_BUDGET, DenyReason.KEY_BUDGET):
                code = f"{reason}_exceeded"
            raise APIError(
                429,
                denial(decision, job, policy, charge),
                type=kind,
                code=code,
                headers=rate_limit_headers(decision),
            )
        return decision

    async def _keep(self, job: Job, ticket: Ticket) -> None:
        """Renew the job's lease every third of its TTL until the job settles (retrying,
        with a warning, while the store is out of reach); settle a job that never began."""
        loop = asyncio.get_running_loop()
        tenant_id, interval = ticket.auth.tenant.id, self.admission.lease_ttl_s / 3
        start_by = loop.time() + START_GRACE_S
        renew_at, backoff = loop.time() + interval, min(0.5, interval)
        while True:
            wake_at = renew_at if ticket.begun else min(renew_at, start_by)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(wake_at):
                    await ticket.ending.wait()
            if ticket.ending.is_set():
                return
            if not ticket.begun and loop.time() >= start_by:
                log.warning("%s never started streaming; settled as cancelled", job.request_id)
                self.settle(job, ticket, Tally(status="cancelled"))
                return
            if loop.time() < renew_at:
                continue
            try:
                state = await self.admission.renew(tenant_id, job.request_id, ticket.auth.key.id)
            except StoreUnavailableError:
                log.warning(
                    "could not renew the lease of %s; retry in %.1fs", job.request_id, backoff
                )
                renew_at, backoff = loop.time() + backoff, min(backoff * 2, interval)
                continue
            if state is LeaseState.RESTORED:
                log.warning("the lease of %s had expired; restored", job.request_id)
            elif state is LeaseState.GONE:
                log.error("the lease of %s is gone while it runs", job.request_id)
            renew_at, backoff = loop.time() + interval, min(0.5, interval)

    # -- running ----------------------------------------------------------------------------

    async def run_choice(
        self,
        job: Job,
        ticket: Ticket,
        index: int,
        tally: Tally,
        results: ChoiceResult | None = None,
    ) -> AsyncIterator[TextDelta]:
        """Stream one choice's text deltas; closing the iterator aborts the engine request.
        A worker that dies or fails before the choice's first output is replaced, once, by
        another worker of the model: the client sees nothing of it, and the job is billed
        once (its settlement counts what was sent)."""
        route = ticket.route
        assert route is not None
        retried = False
        while True:
            worker, started = route.worker, False
            try:
                async for delta in self._run_on(route, worker, job, index, tally, results):
                    started = True
                    yield delta
                return
            except EngineDeadError as exc:
                if started or retried or not await route.fail(worker, self.fleet, job):
                    raise
                retried = True
                self.metrics.failed_over(job.base_model)
                log.warning(
                    "%s: worker %s failed before the first output (%s); retrying on %s",
                    job.request_id,
                    worker.worker_id,
                    exc,
                    route.worker.worker_id,
                )

    async def _run_on(
        self,
        route: Route,
        worker: WorkerHandle,
        job: Job,
        index: int,
        tally: Tally,
        results: ChoiceResult | None,
    ) -> AsyncIterator[TextDelta]:
        prompt = job.prompt_of(index)
        prompt_ids = job.prompts[prompt]
        params = job.params
        if params.seed is not None and index % job.n:
            # a seeded request's choices must differ from each other, and still repeat: the
            # k-th choice of each prompt draws from seed + k
            params = msgspec.structs.replace(params, seed=(params.seed + index % job.n) % 2**64)
        group = self.fleet.groups[job.base_model]
        stream = TextStream(group.tokenizer, prompt_ids, params)
        rid = f"{job.request_id}-{index}"
        leader = index % job.n == 0
        prefilled = job.prefilled.setdefault(prompt, asyncio.Event())
        if job.staggered and not leader:
            await prefilled.wait()
        if tally.engine_started is None:
            tally.engine_started = time.perf_counter()
        if prompt == 0 and leader and worker is route.worker and route.prefill is not None:
            await self._prefill_elsewhere(route, route.prefill, worker, job, rid)
        outputs = worker.client.generate(
            rid, prompt_ids, params, scheduling=job.scheduling, lora=job.lora
        )
        # until its first output: work waiting on that worker (a prompt routed to its
        # cached prefix there waits on the rest only)
        routed = prompt == 0 and worker is route.worker
        queued = route.num_prefill_tokens if routed else len(prompt_ids)
        worker.queued_tokens += queued
        try:
            async with contextlib.aclosing(outputs), _setting(prefilled, leader):
                async for out in outputs:
                    if queued:
                        worker.queued_tokens -= queued
                        queued = 0
                    if leader:
                        prefilled.set()  # its first output: the prompt is computed and cached
                    if out.error is not None:
                        raise EngineDeadError(out.error)
                    delta = stream.process(out)
                    if out.new_token_ids and tally.first_token_at is None:
                        tally.first_token_at = time.perf_counter()
                    tally.completion_tokens += len(delta.token_ids)  # none past a stop string
                    tally.cached(prompt, out)
                    if results is not None:
                        results.text += delta.text
                        results.token_ids.extend(delta.token_ids)
                        results.logprobs.extend(delta.logprobs or ())
                        results.prompt_logprobs.extend(delta.prompt_logprobs or ())
                    if delta.finished:
                        tally.engine_finished = time.perf_counter()
                    yield delta
                    if delta.finished:
                        if results is not None and delta.finish_reason is not None:
                            results.finish_reason = delta.finish_reason.value
                            results.stop_reason = delta.stop_reason
                        return
        finally:
            worker.queued_tokens -= queued

    async def _prefill_elsewhere(
        self, route: Route, prefill: WorkerHandle, worker: WorkerHandle, job: Job, rid: str
    ) -> None:
        """Have `prefill` compute the job's first prompt's KV pages and hand them to
        `worker`'s tiers, ahead of the request itself (docs/design/disaggregation.md). A
        prefill that fails leaves the prompt to `worker`, which computes what it lacks:
        the job goes on, and its one ledger record is written as for any other."""
        route.prefill = None  # once per job
        queued = route.num_prefill_tokens
        prefill.queued_tokens += queued
        outcome = "sent"
        try:
            await asyncio.gather(prefill.client.connect(), worker.client.connect())
            remote = self.fleet.through_remote(prefill, worker)
            replies = prefill.client.prefill(
                rid, job.prompts[0], scheduling=job.scheduling, lora=job.lora, remote=remote
            )
            relayed = False
            async with contextlib.aclosing(replies):
                async for reply in replies:
                    if reply.pages:
                        relayed = True
                        await worker.client.put_pages(reply.pages)
            if remote and not relayed:
                outcome = "remote"  # the decode worker fetches them from the remote tier
            elif remote:
                log.warning(
                    "%s: the remote tier did not take %s's pages; relayed them to %s",
                    job.request_id,
                    prefill.worker_id,
                    worker.worker_id,
                )
        except (EngineDeadError, InvalidRequestError) as exc:
            outcome = "failed"
            log.warning(
                "%s: prefill on %s failed (%s); %s computes the prompt",
                job.request_id,
                prefill.worker_id,
                exc,
                worker.worker_id,
            )
        finally:
            prefill.queued_tokens -= queued
        self.metrics.disaggregated(job.base_model, outcome)

    async def complete(self, job: Job, ticket: Ticket) -> tuple[list[ChoiceResult], Tally]:
        """Run every choice to the end (non-streaming); settles the job however it ends."""
        tally = Tally()
        results = [ChoiceResult(i) for i in range(job.num_choices)]
        ticket.begin()

        async def drain(i: int) -> None:
            async for _ in self.run_choice(job, ticket, i, tally, results[i]):
                pass

        try:
            await asyncio.gather(*(drain(i) for i in range(job.num_choices)))
            tally.status = final_status([r.finish_reason for r in results])
        except InvalidRequestError as exc:
            tally.status = "error"
            raise APIError(400, str(exc), code="invalid_request") from exc
        except EngineDeadError:
            tally.status = "error"
            raise
        except BaseException:
            tally.status = "cancelled"
            raise
        finally:
            self.settle(job, ticket, tally)
        return results, tally

    def stream(self, job: Job, ticket: Ticket) -> JobStream:
        """Every choice's deltas as they come, for a streamed response; settles the job
        however the stream ends."""
        return JobStream(self, job, ticket)

    # -- settling ---------------------------------------------------------------------------

    def settle(self, job: Job, ticket: Ticket, tally: Tally) -> None:
        """Bill and release exactly once; never raises and never blocks (safe in finally).
        A second call for the same ticket does nothing."""
        if ticket.settled:
            return
        ticket.settled = True
        ticket.ending.set()
        status = tally.status or "error"
        now = time.perf_counter()
        tenant_id = ticket.auth.tenant.id
        # a job refused or gone before any engine saw it (a grammar over budget, a client
        # that left at once) processed no prompt: nothing to bill for it
        prompt_tokens = job.num_prompt_tokens if tally.engine_started is not None else 0
        record = UsageRecord(
            request_id=job.request_id,
            tenant_id=tenant_id,
            key_id=ticket.auth.key.id,
            model=job.base_model,
            adapter=None if job.lora is None else job.lora.name,
            adapter_version=None if job.lora is None else job.lora.version,
            user=job.user,
            endpoint=job.endpoint,
            prompt_tokens=prompt_tokens,
            cached_tokens=tally.cached_tokens,
            cached_host_tokens=tally.cached_host_tokens,
            cached_disk_tokens=tally.cached_disk_tokens,
            completion_tokens=tally.completion_tokens,
            status=status,
            ttft_ms=None
            if tally.first_token_at is None
            else round((tally.first_token_at - job.started) * 1e3, 3),
            e2e_ms=round((now - job.started) * 1e3, 3),
            started_at=job.started_at,
            finished_at=time.time(),
        )
        record = with_costs(record, ticket.rates)
        ticket.record = record
        self.ledger.submit(record)
        self.metrics.finished(record, tally.first_token_at, job.started)
        if ticket.reserved:
            used = prompt_tokens + tally.completion_tokens
            cost = record.cost_nanos or 0
            task = asyncio.get_running_loop().create_task(self._release(ticket, job, used, cost))
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)

    async def _release(self, ticket: Ticket, job: Job, used: int, cost_nanos: int) -> None:
        """Release once the keeper has stopped (a renewal never lands after the release),
        retrying while the store is out of reach: a release is idempotent, and one that
        comes after the lease expired still credits the unused tokens and counts the cost
        as spend."""
        keeper = ticket.keeper
        if keeper is not None and keeper is not asyncio.current_task():
            await asyncio.wait([keeper])
        tenant_id, delay = ticket.auth.tenant.id, 0.5
        while True:
            try:
                await self.admission.release(
                    tenant_id,
                    job.request_id,
                    used_tokens=used,
                    key_id=ticket.auth.key.id,
                    cost_nanos=cost_nanos,
                    charge=ticket.charge,
                )
                return
            except StoreUnavailableError:
                log.warning("could not release %s; retry in %.1fs", job.request_id, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 30.0)

    async def drain(self, timeout: float = 5.0) -> None:
        """Wait for in-progress releases, then stop the keepers of jobs still running
        (shutdown: their leases expire, and their records are written as they end)."""
        if self._settling:
            await asyncio.wait(set(self._settling), timeout=timeout)
        for keeper in set(self._keepers):
            keeper.cancel()


@contextlib.asynccontextmanager
async def _setting(event: asyncio.Event, owner: bool) -> AsyncIterator[None]:
    """Set `event` on the way out when `owner` is the one that sets it: a first choice that
    fails or is cancelled before its first output must not leave the others waiting."""
    try:
        yield
    finally:
        if owner:
            event.set()


def final_status(reasons: Sequence[str | None]) -> UsageStatus:
    """A job's status from its choices' finish reasons: any error is an error, any choice
    aborted or never finished makes it cancelled, else length if any ran out, else stop."""
    if "error" in reasons:
        return "error"
    if "abort" in reasons or None in reasons:
        return "cancelled"
    return "length" if "length" in reasons else "stop"


class JobStream:
    """One admitted job's choices as `(index, delta)` pairs as they come, and its `tally`.
    Iterate once. However the iteration ends (finished, a failed engine, the client gone)
    the job is settled with the status `final_status` gives, or error, or cancelled."""

    def __init__(self, pipeline: Pipeline, job: Job, ticket: Ticket) -> None:
        self.pipeline = pipeline
        self.job = job
        self.ticket = ticket
        self.tally = Tally()

    def __aiter__(self) -> AsyncIterator[tuple[int, TextDelta]]:
        return self._run()

    async def _run(self) -> AsyncIterator[tuple[int, TextDelta]]:
        job, ticket, tally = self.job, self.ticket, self.tally
        if not ticket.begin():
            return  # settled before the response could start (see Pipeline._keep)
        reasons: list[str | None] = [None] * job.num_choices
        try:
            async for index, delta in self._merge():
                if delta.finish_reason is not None:
                    reasons[index] = delta.finish_reason.value
                yield index, delta
            tally.status = final_status(reasons)
        except (EngineDeadError, InvalidRequestError):
            tally.status = "error"
            raise
        except BaseException:
            tally.status = "cancelled"
            raise
        finally:
            if tally.status is None:
                tally.status = "cancelled"
            self.pipeline.settle(job, ticket, tally)

    async def _merge(self) -> AsyncIterator[tuple[int, TextDelta]]:
        """Deltas of every choice as they come; one choice is iterated directly."""
        job, ticket, tally, run = self.job, self.ticket, self.tally, self.pipeline.run_choice
        if job.num_choices == 1:
            async for delta in run(job, ticket, 0, tally):
                yield 0, delta
            return
        queue: asyncio.Queue[tuple[int, TextDelta | BaseException | None]] = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for delta in run(job, ticket, i, tally):
                    await queue.put((i, delta))
            except Exception as exc:  # surfaced to the consumer below
                await queue.put((i, exc))
            else:
                await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i)) for i in range(job.num_choices)]
        try:
            remaining = job.num_choices
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

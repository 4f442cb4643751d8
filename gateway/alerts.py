"""A gateway replica's alert delivery, in background tasks that never touch a request:

- events from the store's stream, read through the consumer group all replicas share (each
  event goes to one replica; one a dead replica left unacknowledged is claimed by another
  after `claim_idle_s`), POSTed to every subscribed webhook with retries and backoff, and
  acknowledged once every webhook accepted it or was given up on;
- `worker_lost`, raised when a registry worker leaves this replica's view because its
  connection ended or its heartbeat stopped, unless it left the registry itself (a clean
  stop); every replica sees it, a dedupe key per worker incarnation makes it one event;
- `store_unreachable` after the store has been out of reach for `store_outage_s`, and
  `store_recovered` when it answers again: these cannot go through the store, so the
  replica that saw the outage delivers them from memory to the webhooks it last read (each
  replica that sees the outage sends its own: they are not deduplicated across replicas).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from datetime import datetime
from typing import Any, TypeVar

import httpx
import redis.asyncio as aioredis

from engine.fleet import WORKERS
from gateway.fleet import WorkerHandle
from gateway.metrics import GatewayMetrics
from gateway.webhooks import AlertConfig, Outcome, new_client, post
from policies.admission import BUDGET_EVENTS
from tenants.alerts import AlertEvent, AlertStore, Delivery, StoredWebhook, new_event
from tenants.records import nanos_to_usd
from tenants.store import cancel_and_wait, ping

log = logging.getLogger(__name__)

T = TypeVar("T")
_CONSUMER_GONE_MS = 3600_000  # a consumer idle this long, holding nothing, is removed
_STORE_ERRORS = (aioredis.RedisError, OSError, TimeoutError)
BUDGET_ALERT_CURSOR = "strata:alerts:budget-cursor"  # the last crossing raised as an alert


class AlertDispatcher:
    """Delivers this replica's share of alerts. Open with `start`, close with `close`."""

    def __init__(self, alerts: AlertStore, metrics: GatewayMetrics, config: AlertConfig) -> None:
        self.alerts = alerts
        self.metrics = metrics
        self.config = config
        self.consumer = f"gw-{uuid.uuid4().hex[:12]}"
        self.client: httpx.AsyncClient | None = None
        self._webhooks: list[StoredWebhook] = []  # as last read: for store outages
        self._working: dict[str, AlertEvent | None] = {}  # stream entry id -> its event
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self.client = new_client(self.config)
        for name, loop in (
            ("alerts-read", self._read_loop),
            ("alerts-claim", self._claim_loop),
            ("alerts-store", self._watch_store),
            ("alerts-budgets", self._budget_loop),
        ):
            self._spawn(loop(), name)

    async def close(self) -> None:
        await asyncio.gather(*(cancel_and_wait(task) for task in list(self._tasks)))
        if self.client is not None:
            await self.client.aclose()
        with contextlib.suppress(*_STORE_ERRORS):  # unless it holds events: others claim them
            async with asyncio.timeout(2.0):
                await self.alerts.leave_group(self.consumer)

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- worker_lost ---------------------------------------------------------------------

    def worker_left(self, handle: WorkerHandle) -> None:
        """The fleet's hook: a registry worker's connection ended or its heartbeat stopped."""
        self._spawn(self._judge_lost(handle), f"alerts-lost-{handle.worker_id}")

    async def _judge_lost(self, handle: WorkerHandle) -> None:
        await asyncio.sleep(self.config.lost_check_delay_s)
        redis = self.alerts.redis
        record = handle.record
        try:
            if await redis.zscore(WORKERS, handle.worker_id) is None:
                return  # it left the registry itself: a clean stop
            incarnation = f"{record.started_at:.6f}" if record is not None else "unknown"
            await self.alerts.raise_alert(
                "worker_lost",
                handle.worker_id,
                {
                    "worker_id": handle.worker_id,
                    "address": handle.address,
                    "model": handle.model_id or (record.model_id if record else None),
                },
                dedupe_key=f"worker_lost:{handle.worker_id}:{incarnation}",
            )
        except _STORE_ERRORS as exc:
            log.warning("worker %s was lost; no alert raised (%s)", handle.worker_id, exc)

    # -- budget_threshold ----------------------------------------------------------------

    async def _budget_loop(self) -> None:
        """Budget thresholds crossed (admission appends them to the budget event stream)
        become `budget_threshold` alerts. Every replica reads on from a cursor kept in the
        store; the crossing's stream id dedupes, so a replica behind the others raises
        nothing twice. A store without a cursor starts at its newest crossing."""
        redis: Any = self.alerts.redis
        while True:
            try:
                cursor = await redis.get(BUDGET_ALERT_CURSOR)
                if cursor is None:
                    newest = await redis.xrevrange(BUDGET_EVENTS, count=1)
                    cursor = newest[0][0] if newest else b"0-0"
                    await redis.set(BUDGET_ALERT_CURSOR, cursor, nx=True)
                read: list[Any] = await redis.xread({BUDGET_EVENTS: cursor}, count=100, block=1000)
                for _, entries in read:
                    for entry_id, fields in entries:
                        await self._raise_budget_alert(_text(entry_id), fields)
                        await redis.set(BUDGET_ALERT_CURSOR, entry_id)
            except _STORE_ERRORS:
                await asyncio.sleep(self.config.store_check_s)

    async def _raise_budget_alert(self, entry_id: str, fields: dict[Any, Any]) -> None:
        f = {_text(k): _text(v) for k, v in fields.items()}
        await self.alerts.raise_alert(
            "budget_threshold",
            f["tenant_id"],
            {
                "tenant_id": f["tenant_id"],
                "key_id": f.get("key_id") or None,
                "scope": f["scope"],
                "period": f["period"],
                "threshold_pct": int(f["threshold_pct"]),
                "limit_usd": nanos_to_usd(int(f["limit_nanos"])),
                "spent_usd": nanos_to_usd(int(f["spent_nanos"])),
            },
            dedupe_key=f"budget_threshold:{entry_id}",
        )

    # -- the stream ----------------------------------------------------------------------

    async def _read_loop(self) -> None:
        joined = False
        while True:
            try:
                if not joined:
                    await self.alerts.join_group()
                    joined = True
                room = self.config.num_in_flight - len(self._working)
                if room <= 0:
                    await asyncio.sleep(0.1)
                    continue
                self._take(await self.alerts.read_new(self.consumer, room, block_ms=1000))
            except aioredis.ResponseError:  # the group is gone (a flushed store): join again
                joined = False
                await asyncio.sleep(self.config.store_check_s)
            except _STORE_ERRORS:
                await asyncio.sleep(self.config.store_check_s)

    async def _claim_loop(self) -> None:
        """Keep this replica's events from looking abandoned; take those others dropped."""
        idle_ms = int(self.config.claim_idle_s * 1000)
        while True:
            await asyncio.sleep(self.config.claim_idle_s / 3)
            with contextlib.suppress(*_STORE_ERRORS):
                await self.alerts.touch(self.consumer, list(self._working))
                self._take(await self.alerts.claim_stale(self.consumer, idle_ms, count=16))
                await self.alerts.prune_consumers(_CONSUMER_GONE_MS)

    def _take(self, entries: Sequence[tuple[str, AlertEvent | None]]) -> None:
        for entry_id, event in entries:
            if entry_id not in self._working:
                self._working[entry_id] = event
                self._spawn(self._deliver_entry(entry_id, event), f"alerts-{entry_id}")

    async def _deliver_entry(self, entry_id: str, event: AlertEvent | None) -> None:
        try:
            if event is not None:
                await self._deliver_event(event)
            await self._until_stored(lambda: self.alerts.ack([entry_id]))
        finally:
            self._working.pop(entry_id, None)

    async def _deliver_event(self, event: AlertEvent) -> None:
        webhooks = self._webhooks = await self._until_stored(self.alerts.stored_webhooks)
        done = await self._until_stored(lambda: self.alerts.delivered_to(event.id))
        targets = [
            s
            for s in webhooks
            if s.webhook.id not in done
            and (
                s.webhook.id == event.webhook_id
                if event.webhook_id is not None
                else s.webhook.wants(event.type)
            )
        ]
        await asyncio.gather(*(self._deliver(s, event, durable=True) for s in targets))

    async def _until_stored(self, call: Callable[[], Awaitable[T]]) -> T:
        """`call()`'s answer, retried while the store is out of reach."""
        while True:
            try:
                return await call()
            except _STORE_ERRORS:
                await asyncio.sleep(self.config.store_check_s)

    # -- one webhook ---------------------------------------------------------------------

    async def _deliver(self, hook: StoredWebhook, event: AlertEvent, *, durable: bool) -> None:
        """Attempts until one succeeds, `max_attempts` are spent or the event is older than
        `max_age_s`; each attempt is logged (when the store answers) and counted."""
        assert self.client is not None
        created = _unix(event.created)
        for attempt in range(1, self.config.max_attempts + 1):
            try:
                async with asyncio.timeout(self.config.timeout_s + 1.0):
                    outcome = await post(self.client, hook.webhook.url, hook.secret, event)
            except TimeoutError:
                outcome = Outcome(False, error="timed out")
            wait = self.config.backoff(attempt)
            last = (
                attempt == self.config.max_attempts
                or time.time() + wait - created > self.config.max_age_s
            )
            result = "ok" if outcome.ok else "failed" if last else "retried"
            self.metrics.webhook_delivered(result)
            entry = Delivery(
                event_id=event.id,
                type=event.type,
                attempt=attempt,
                attempted_at=time.time(),
                status_code=outcome.status_code,
                error=outcome.error,
                ok=outcome.ok,
            )
            with contextlib.suppress(*_STORE_ERRORS):
                await self.alerts.log_attempt(hook.webhook.id, entry)
                if outcome.ok and durable:
                    await self.alerts.mark_delivered(event.id, hook.webhook.id)
            if outcome.ok:
                return
            if durable and not await self._still_registered(hook.webhook.id):
                return
            if last:
                log.warning(
                    "alert %s to webhook %s given up after %d attempts",
                    event.id,
                    hook.webhook.id,
                    attempt,
                )
                return
            await asyncio.sleep(wait)

    async def _still_registered(self, webhook_id: str) -> bool:
        """False once the webhook was deleted (True while the store cannot say)."""
        try:
            return await self.alerts.has_webhook(webhook_id)
        except _STORE_ERRORS:
            return True

    # -- the store -----------------------------------------------------------------------

    async def _watch_store(self) -> None:
        """Read the webhooks while the store answers; past `store_outage_s` without it,
        deliver `store_unreachable` from memory (and `store_recovered` once it is back)."""
        down_since: float | None = None
        alerted = False
        while True:
            up = await ping(self.alerts.redis, timeout=self.config.store_check_s)
            now = time.monotonic()
            if up:
                with contextlib.suppress(*_STORE_ERRORS):
                    self._webhooks = await self.alerts.stored_webhooks()
                if alerted:
                    outage = now - (down_since or now)
                    self._direct("store_recovered", {"outage_s": round(outage, 1)})
                down_since, alerted = None, False
            else:
                down_since = down_since if down_since is not None else now
                if not alerted and now - down_since >= self.config.store_outage_s:
                    alerted = True
                    self._direct("store_unreachable", {"since_s": round(now - down_since, 1)})
            await asyncio.sleep(self.config.store_check_s)

    def _direct(self, kind: str, details: dict[str, object]) -> None:
        event = new_event(kind, "store", {**details, "gateway": self.consumer})
        self.metrics.alert_raised(kind, "raised")
        for hook in self._webhooks:
            if hook.webhook.wants(kind):
                self._spawn(self._deliver(hook, event, durable=False), f"alerts-{kind}")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _unix(created: str) -> float:
    try:
        return datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return time.time()

"""Operator alerts as stored: the webhooks an operator registered, the durable stream of
alert events every gateway replica delivers from (one consumer group: each event goes to
one replica, and back to another if that one dies before acknowledging it), the dedupe keys
that make one event of many replicas' sightings, and each webhook's delivery log.

Raising an alert from anywhere in the gateway is one call on the replica's `AlertStore`
(`GatewayState.alerts`):

    await alerts.raise_alert(
        "budget_threshold",
        subject=tenant_id,
        details={"tenant": tenant_id, "key": None, "budget": 100.0, "period": "month",
                 "threshold_percent": 80, "spent": 81.5},
        dedupe_key=f"budget:{tenant_id}:2026-11:80",
    )

It returns the event's id, or None when `dedupe_key` was already raised (within
`DEDUPE_TTL_S`). Delivery (signing, retries, the log) is the gateway's: gateway/alerts.py.
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, cast
from urllib.parse import urlsplit

import msgspec
import redis.asyncio as aioredis

from tenants.errors import NotFoundError
from tenants.records import RecordError

# the events a webhook may subscribe to ("*": all of them); `test` goes only to the webhook
# it was sent to
EVENT_TYPES = ("budget_threshold", "worker_lost", "store_unreachable", "store_recovered")
TEST_EVENT = "test"

WEBHOOKS = "strata:al:hooks"  # webhook id -> its stored record (JSON)
STREAM = "strata:al:events"
GROUP = "delivery"
STREAM_MAXLEN = 10_000
DEDUPE_TTL_S = 7 * 86400
LOG_SIZE = 100  # attempts kept per webhook
DONE_TTL_S = 2 * 86400


def _log_key(webhook_id: str) -> str:
    return f"strata:al:log:{webhook_id}"


def _done_key(event_id: str) -> str:
    return f"strata:al:done:{event_id}"


def _dedupe_key(key: str) -> str:
    return f"strata:al:dedupe:{key}"


class WebhookFieldError(RecordError):
    """A webhook field the operator must change; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class WebhookCreate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    url: str
    events: list[str] = msgspec.field(default_factory=lambda: ["*"])
    description: str = ""

    def check(self) -> None:
        """Raise WebhookFieldError naming the first field that is not acceptable."""
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise WebhookFieldError("url", "url must be an http:// or https:// URL with a host")
        if len(self.url) > 2048:
            raise WebhookFieldError("url", "url must be at most 2048 characters")
        if not self.events:
            raise WebhookFieldError("events", "events must name at least one event, or '*'")
        unknown = [e for e in self.events if e != "*" and e not in EVENT_TYPES]
        if unknown:
            raise WebhookFieldError(
                "events",
                f"events: unknown event {unknown[0]!r}; known: {', '.join(EVENT_TYPES)} or '*'",
            )
        if len(self.description) > 500:
            raise WebhookFieldError("description", "description must be at most 500 characters")


class Webhook(msgspec.Struct, kw_only=True, frozen=True):
    """A registered webhook as listed (its secret is never listed)."""

    id: str
    url: str
    events: list[str]
    description: str
    created_at: float

    def wants(self, event_type: str) -> bool:
        return "*" in self.events or event_type in self.events


class WebhookCreated(msgspec.Struct, kw_only=True, frozen=True):
    """The answer to registering a webhook: the only time its signing secret is shown."""

    webhook: Webhook
    secret: str


class StoredWebhook(msgspec.Struct, kw_only=True, frozen=True):
    webhook: Webhook
    secret: str


class AlertEvent(msgspec.Struct, kw_only=True, frozen=True):
    """One alert: `id` is its idempotency id, the same on every delivery attempt."""

    id: str
    type: str
    created: str  # RFC 3339, UTC
    subject: str
    data: dict[str, Any]
    webhook_id: str | None = None  # only this webhook (a test event); None: every subscriber


class Delivery(msgspec.Struct, kw_only=True, frozen=True):
    """One delivery attempt, as the log keeps it."""

    event_id: str
    type: str
    attempt: int
    attempted_at: float
    status_code: int | None = None  # the receiver's answer, if any
    error: str | None = None  # why the attempt failed, if it did
    ok: bool = False


def new_event(
    kind: str, subject: str, details: Mapping[str, Any], webhook_id: str | None = None
) -> AlertEvent:
    created = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return AlertEvent(
        id=f"evt_{uuid.uuid4().hex}",
        type=kind,
        created=created,
        subject=subject,
        data=dict(details),
        webhook_id=webhook_id,
    )


class AlertStore:
    """Webhooks, the event stream and the delivery logs in the store."""

    def __init__(
        self, redis: aioredis.Redis, on_raised: Callable[[str, str], None] | None = None
    ) -> None:
        self.redis = redis
        self.on_raised = on_raised  # (type, "raised" or "duplicate"): the gateway counts them

    # -- webhooks ------------------------------------------------------------------------

    async def create_webhook(self, spec: WebhookCreate) -> WebhookCreated:
        spec.check()
        webhook = Webhook(
            id=f"wh_{uuid.uuid4().hex[:16]}",
            url=spec.url,
            events=sorted(set(spec.events)),
            description=spec.description,
            created_at=time.time(),
        )
        stored = StoredWebhook(webhook=webhook, secret=f"whsec_{secrets.token_urlsafe(32)}")
        await self.redis.hset(WEBHOOKS, webhook.id, msgspec.json.encode(stored))
        return WebhookCreated(webhook=webhook, secret=stored.secret)

    async def stored_webhooks(self) -> list[StoredWebhook]:
        """Every webhook with its secret (for signing), oldest first."""
        raw = cast(dict[bytes, bytes], await self.redis.hgetall(WEBHOOKS))
        found = [msgspec.json.decode(v, type=StoredWebhook) for v in raw.values()]
        return sorted(found, key=lambda s: (s.webhook.created_at, s.webhook.id))

    async def list_webhooks(self) -> list[Webhook]:
        return [s.webhook for s in await self.stored_webhooks()]

    async def get_webhook(self, webhook_id: str) -> Webhook:
        raw = await self.redis.hget(WEBHOOKS, webhook_id)
        if raw is None:
            raise NotFoundError("webhook", webhook_id)
        return msgspec.json.decode(raw, type=StoredWebhook).webhook

    async def has_webhook(self, webhook_id: str) -> bool:
        return bool(await self.redis.hexists(WEBHOOKS, webhook_id))

    async def delete_webhook(self, webhook_id: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hdel(WEBHOOKS, webhook_id)
            pipe.delete(_log_key(webhook_id))
            removed, _ = await pipe.execute()
        if not removed:
            raise NotFoundError("webhook", webhook_id)

    # -- raising -------------------------------------------------------------------------

    async def raise_alert(
        self,
        kind: str,
        subject: str,
        details: Mapping[str, Any],
        dedupe_key: str | None = None,
    ) -> str | None:
        """Add an alert to the durable stream for delivery to every webhook subscribed to
        `kind`; returns its id, or None when `dedupe_key` was raised before (by any replica,
        within DEDUPE_TTL_S). Raises the store's errors when it is out of reach."""
        if kind not in EVENT_TYPES:
            raise ValueError(f"unknown alert type {kind!r}")
        if dedupe_key is not None:
            fresh = await self.redis.set(_dedupe_key(dedupe_key), "1", nx=True, ex=DEDUPE_TTL_S)
            if not fresh:
                self._count(kind, "duplicate")
                return None
        event_id = await self.publish(new_event(kind, subject, details))
        self._count(kind, "raised")
        return event_id

    def _count(self, kind: str, result: str) -> None:
        if self.on_raised is not None:
            self.on_raised(kind, result)

    async def send_test(self, webhook_id: str) -> str:
        """A `test` event for one webhook; returns its id."""
        webhook = await self.get_webhook(webhook_id)
        details = {"message": "a test event from Strata", "webhook_id": webhook.id}
        return await self.publish(new_event(TEST_EVENT, webhook.id, details, webhook.id))

    async def publish(self, event: AlertEvent) -> str:
        await self.redis.xadd(
            STREAM, {"event": msgspec.json.encode(event)}, maxlen=STREAM_MAXLEN, approximate=True
        )
        return event.id

    # -- the consumer group --------------------------------------------------------------

    async def join_group(self) -> None:
        """Create the stream and its consumer group unless they exist."""
        try:
            await self.redis.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
        except aioredis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def leave_group(self, consumer: str) -> None:
        """Remove `consumer` from the group if it holds no pending entries."""
        pending: Any = await self.redis.xpending_range(
            STREAM, GROUP, min="-", max="+", count=1, consumername=consumer
        )
        if not pending:
            await self.redis.xgroup_delconsumer(STREAM, GROUP, consumer)

    async def prune_consumers(self, min_idle_ms: int) -> None:
        """Remove consumers (replicas gone without leaving) that hold no pending entries and
        were idle for `min_idle_ms`."""
        consumers: Any = await self.redis.xinfo_consumers(STREAM, GROUP)
        for info in consumers:
            if int(info["pending"]) == 0 and int(info["idle"]) >= min_idle_ms:
                await self.redis.xgroup_delconsumer(STREAM, GROUP, info["name"])

    async def read_new(
        self, consumer: str, count: int, block_ms: int
    ) -> list[tuple[str, AlertEvent | None]]:
        """Events never handed to any consumer, now this one's (pending until `ack`)."""
        answer: Any = await self.redis.xreadgroup(
            GROUP, consumer, {STREAM: ">"}, count=count, block=block_ms
        )
        entries = answer[0][1] if answer else []
        return [(_entry_id(i), _decode(fields)) for i, fields in entries]

    async def claim_stale(
        self, consumer: str, min_idle_ms: int, count: int
    ) -> list[tuple[str, AlertEvent | None]]:
        """Events another consumer took and has not touched for `min_idle_ms` (it died),
        now this one's."""
        answer = await self.redis.xautoclaim(
            STREAM, GROUP, consumer, min_idle_ms, start_id="0-0", count=count
        )
        claimed, deleted = answer[1], answer[2] if len(answer) > 2 else []
        if deleted:
            await self.ack([_entry_id(i) for i in deleted])
        return [(_entry_id(i), _decode(fields)) for i, fields in claimed if fields]

    async def touch(self, consumer: str, entry_ids: Sequence[str]) -> None:
        """Reset the idle time of entries this consumer is still working on."""
        if entry_ids:
            await self.redis.xclaim(STREAM, GROUP, consumer, 0, list(entry_ids), justid=True)

    async def ack(self, entry_ids: Sequence[str]) -> None:
        if entry_ids:
            await self.redis.xack(STREAM, GROUP, *entry_ids)

    # -- per-event progress and the log --------------------------------------------------

    async def delivered_to(self, event_id: str) -> set[str]:
        """The webhooks that already accepted `event_id` (a re-claimed event skips them)."""
        members = cast(set[bytes], await self.redis.smembers(_done_key(event_id)))
        return {m.decode() for m in members}

    async def mark_delivered(self, event_id: str, webhook_id: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.sadd(_done_key(event_id), webhook_id)
            pipe.expire(_done_key(event_id), DONE_TTL_S)
            await pipe.execute()

    async def log_attempt(self, webhook_id: str, delivery: Delivery) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.lpush(_log_key(webhook_id), msgspec.json.encode(delivery))
            pipe.ltrim(_log_key(webhook_id), 0, LOG_SIZE - 1)
            await pipe.execute()

    async def deliveries(self, webhook_id: str, limit: int = LOG_SIZE) -> list[Delivery]:
        """The latest attempts to deliver to `webhook_id`, newest first."""
        await self.get_webhook(webhook_id)
        raw = cast(list[bytes], await self.redis.lrange(_log_key(webhook_id), 0, limit - 1))
        return [msgspec.json.decode(r, type=Delivery) for r in raw]


def _entry_id(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _decode(fields: Mapping[bytes, bytes]) -> AlertEvent | None:
    """The entry's event; None for an entry that does not decode (it is acknowledged)."""
    try:
        return msgspec.json.decode(fields[b"event"], type=AlertEvent)
    except (KeyError, msgspec.DecodeError, msgspec.ValidationError):
        return None

"""Cache invalidation across gateway replicas over the store's pub/sub.

Writers (registry, key manager) publish on `strata:invalidate` a small JSON message naming
what changed: a key (by the SHA-256 of its secret) or a tenant (by id). Each replica runs one
`InvalidationSubscriber` that hands every message to a callback. A subscription is only
trusted while it is confirmed: when it drops, messages may be lost, so `on_resubscribe` runs
each time the server confirms a (re)subscription and the owner must then forget everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, Literal

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from tenants.store import cancel_and_wait

log = logging.getLogger(__name__)

CHANNEL = b"strata:invalidate"

InvalidationKind = Literal["key", "tenant"]


class Invalidation(msgspec.Struct, frozen=True):
    """`kind="key"`: `ident` is a key's secret hash; `kind="tenant"`: a tenant id."""

    kind: InvalidationKind
    ident: str


_decoder = msgspec.json.Decoder(Invalidation)


def encode_invalidation(kind: InvalidationKind, ident: str) -> bytes:
    return msgspec.json.encode(Invalidation(kind, ident))


def stage_invalidation(pipe: Pipeline, kind: InvalidationKind, ident: str) -> None:
    """Queue the PUBLISH on a MULTI pipeline, so it goes out only if the write commits."""
    pipe.publish(CHANNEL, encode_invalidation(kind, ident))


async def publish_invalidation(redis: aioredis.Redis, kind: InvalidationKind, ident: str) -> None:
    """Tell every replica that `ident` changed (fire-and-forget; no subscriber is fine)."""
    await redis.publish(CHANNEL, encode_invalidation(kind, ident))


class InvalidationSubscriber:
    """Background task listening on `CHANNEL` with reconnect and backoff.

    `on_message` runs for each invalidation, `on_resubscribe` each time a subscription is
    confirmed (the first one included). `is_live` is true only between a confirmation and the
    next error. Both callbacks run on the event loop and must not block.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        on_message: Callable[[Invalidation], None],
        on_resubscribe: Callable[[], None],
        *,
        min_backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
        ping_interval_s: float = 5.0,
    ) -> None:
        self._redis = redis
        self._on_message = on_message
        self._on_resubscribe = on_resubscribe
        self._min_backoff_s = min_backoff_s
        self._max_backoff_s = max_backoff_s
        self._ping_interval_s = ping_interval_s
        self._task: asyncio.Task[None] | None = None
        self._live = asyncio.Event()
        self.num_resubscribes = 0

    @property
    def is_live(self) -> bool:
        return self._live.is_set()

    async def start(self, timeout: float = 5.0) -> bool:
        """Start the listener task (idempotent); wait up to `timeout` for the first
        subscription. Returns whether it is live; if not, it keeps retrying in the background."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="strata-invalidation")
        return await self.wait_live(timeout)

    async def wait_live(self, timeout: float) -> bool:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._live.wait()
        return self.is_live

    async def stop(self) -> None:
        """Cancel the listener and close its connection."""
        task, self._task = self._task, None
        self._live.clear()
        if task is not None:
            await cancel_and_wait(task)

    async def _run(self) -> None:
        backoff, num_failures = self._min_backoff_s, 0
        while True:
            num_before, error = self.num_resubscribes, "closed"
            try:
                await self._listen(self._redis.pubsub())
            except (aioredis.RedisError, OSError) as exc:
                error = str(exc)
            except Exception:  # a bug must not end the listener: the cache would stay off
                log.exception("invalidation listener failed")
                error = "listener error"
            if self.num_resubscribes > num_before:  # it was up: retry quickly again
                backoff, num_failures = self._min_backoff_s, 0
            num_failures += 1
            level = logging.WARNING if num_failures == 1 else logging.DEBUG
            log.log(level, "invalidation subscription down (%s); retry in %.2fs", error, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._max_backoff_s)

    async def _listen(self, pubsub: Any) -> None:
        try:
            await pubsub.subscribe(CHANNEL)
            ping_sent = False
            while True:
                message = await pubsub.get_message(timeout=self._ping_interval_s)
                if message is not None:
                    ping_sent = False
                    self._dispatch(message)
                elif ping_sent:
                    # a half-open connection would otherwise look like a quiet channel
                    raise aioredis.ConnectionError("no answer to ping on the subscription")
                else:
                    await pubsub.ping()
                    ping_sent = True
        finally:
            self._live.clear()
            with contextlib.suppress(aioredis.RedisError, OSError):
                await pubsub.aclose()

    def _dispatch(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind in ("subscribe", b"subscribe"):
            # a (re)subscription: anything published while we were away is lost
            self.num_resubscribes += 1
            self._on_resubscribe()
            self._live.set()
        elif kind in ("unsubscribe", b"unsubscribe"):
            self._live.clear()
        elif kind in ("message", b"message"):
            try:
                invalidation = _decoder.decode(message["data"])
            except msgspec.DecodeError:
                log.warning("ignoring a malformed invalidation message")
                return
            self._on_message(invalidation)

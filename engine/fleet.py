"""A worker's place in the fleet: its record in the store (sealed with the fleet secret,
renewed by a heartbeat) and the events that tell gateways which KV blocks it holds in each
tier, as deltas with a per-worker sequence number plus periodic snapshots. The store layout
and how gateways read it: docs/design/fleet.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import logging
import time
from collections.abc import Callable, Collection, Mapping

import msgspec
import redis.asyncio as aioredis

from engine.block_hash import block_key
from engine.protocol import ModelInfo

log = logging.getLogger(__name__)

WORKERS = "strata:w:all"
DRAINED = "strata:w:drain"
EVENTS = b"strata:w:events"
KV_EVENTS = b"strata:kv:events"
HEARTBEAT_S = 1.0
# a worker that stops beating (a hang, a partition) leaves gateways' view after this; one
# that dies leaves at once, when its connection to each gateway ends
RECORD_TTL_MS = 10_000
TIERS = ("device", "host", "disk", "remote")
SNAPSHOT_TTL_S = 600  # a dead worker's snapshot goes with it
_MAX_PENDING = 1000
_SEAL_LABEL = b"strata fleet record v1\0"


ROLES = ("both", "prefill", "decode")  # engine/config.py WorkerRole


@dataclasses.dataclass(frozen=True)
class FleetConfig:
    """How a worker joins a fleet: the store it registers in, the fleet secret that seals
    its record, the address gateways reach it at, its id and its role."""

    redis_url: str
    secret: str = dataclasses.field(repr=False)
    advertise: str
    worker_id: str
    role: str = "both"
    kv_poll_s: float = 0.25  # how often the block events are computed, at most

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}")
        if not self.worker_id or any(c.isspace() for c in self.worker_id):
            raise ValueError("a worker id is non-empty and has no spaces")
        if self.kv_poll_s <= 0:
            raise ValueError("kv_poll_s must be positive")


def connect_store(url: str) -> aioredis.Redis:
    """An asyncio client for the fleet store (redis://, rediss:// or unix://)."""
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=8, timeout=2.0, socket_timeout=2.0, socket_connect_timeout=2.0
    )
    return aioredis.Redis.from_pool(pool)


def record_key(worker_id: str) -> str:
    return f"strata:w:rec:{worker_id}"


def snapshot_key(worker_id: str) -> str:
    return f"strata:kv:snap:{worker_id}"


class WorkerRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker tells the fleet about itself, every heartbeat."""

    worker_id: str
    address: str  # where gateways reach it (unix://, tcp://, tls://)
    model_id: str
    shape: str  # digest of the model's shapes: one model id, one shape, fleet-wide
    max_model_len: int
    kv_block_size: int
    cache_namespace: str  # the root of its prefix-cache chains (engine/block_hash.py)
    role: str = "both"
    adapters: list[str] = msgspec.field(default_factory=list)  # loaded, as name@version
    max_num_seqs: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks_used: int = 0
    num_kv_blocks_total: int = 0
    kv_blocks_by_tier: dict[str, int] = msgspec.field(default_factory=dict)
    started_at: float = 0.0
    heartbeat_at: float = 0.0


class _Sealed(msgspec.Struct, frozen=True):
    body: bytes
    mac: bytes


def _mac(secret: str, body: bytes) -> bytes:
    return hmac.new(secret.encode(), _SEAL_LABEL + body, hashlib.sha256).digest()


def seal(record: WorkerRecord, secret: str) -> bytes:
    """The record as stored: its msgpack body and an HMAC of it under the fleet secret."""
    body = msgspec.msgpack.encode(record)
    return msgspec.msgpack.encode(_Sealed(body, _mac(secret, body)))


def unseal(blob: bytes, secret: str) -> WorkerRecord | None:
    """The record of `blob` if it was sealed with `secret`, else None (never raises)."""
    try:
        sealed = msgspec.msgpack.decode(blob, type=_Sealed)
        if not hmac.compare_digest(sealed.mac, _mac(secret, sealed.body)):
            return None
        return msgspec.msgpack.decode(sealed.body, type=WorkerRecord)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def model_shape(info: ModelInfo) -> str:
    """A short digest of a model's shapes (vocabulary, widths, layers, heads): workers that
    announce one model id must agree on it."""
    fields = (
        info.vocab_size,
        info.hidden_size,
        info.intermediate_size,
        info.num_layers,
        info.num_heads,
        info.num_kv_heads,
        info.head_dim,
    )
    return hashlib.sha256(repr(fields).encode()).hexdigest()[:16]


class KVEvent(msgspec.Struct, frozen=True, kw_only=True):
    """What changed in one worker's KV blocks (by 64-bit key, engine/block_hash.py) since
    its previous event, per tier; with `snapshot`, `added` is everything it holds."""

    worker_id: str
    seq: int
    added: dict[str, list[int]] = msgspec.field(default_factory=dict)
    removed: dict[str, list[int]] = msgspec.field(default_factory=dict)
    snapshot: bool = False


class KVTracker:
    """Turns a worker's cached block hashes per tier into KVEvents: the difference from what
    it reported last, as 64-bit keys. Call `poll` from the thread that owns the engine
    (between steps): it reads the engine's own maps."""

    def __init__(self, worker_id: str, snapshot_every: int = 20) -> None:
        self.worker_id = worker_id
        self.snapshot_every = snapshot_every  # every so many polls, a full snapshot too
        self._seq = 0
        self._polls = 0
        self._last: dict[str, set[bytes]] = {tier: set() for tier in TIERS}

    def poll(self, hashes: Mapping[str, Collection[bytes]]) -> list[KVEvent]:
        """The events for the block hashes held now (tier -> hashes): a delta when something
        changed, and, every `snapshot_every` polls, a snapshot of everything."""
        added: dict[str, list[int]] = {}
        removed: dict[str, list[int]] = {}
        for tier in TIERS:
            now = set(hashes.get(tier, ()))
            before = self._last[tier]
            if now != before:
                if gained := now - before:
                    added[tier] = [block_key(h) for h in gained]
                if lost := before - now:
                    removed[tier] = [block_key(h) for h in lost]
                self._last[tier] = now
        events = []
        if added or removed:
            self._seq += 1
            events.append(
                KVEvent(worker_id=self.worker_id, seq=self._seq, added=added, removed=removed)
            )
        self._polls += 1
        if self._polls % self.snapshot_every == 1:
            events.append(self.snapshot())
        return events

    def snapshot(self) -> KVEvent:
        """Every block held now, by tier, at the latest sequence number."""
        return KVEvent(
            worker_id=self.worker_id,
            seq=self._seq,
            snapshot=True,
            added={t: [block_key(h) for h in hashes] for t, hashes in self._last.items() if hashes},
        )


class Registration:
    """A worker's heartbeat: its sealed record every `HEARTBEAT_S` seconds (expiring after
    `RECORD_TTL_MS` unless renewed), the block events the engine thread hands it, and a
    `leave` on stop. The store being out of reach is logged and retried: the worker keeps
    serving the gateways already connected to it."""

    def __init__(
        self,
        redis: aioredis.Redis,
        secret: str,
        record: Callable[[], WorkerRecord],
    ) -> None:
        self.redis = redis
        self.secret = secret
        self.record = record  # the current record, load figures included
        self._pending: list[KVEvent] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._joined = False

    def post(self, events: list[KVEvent]) -> None:
        """Queue events for the next publish (call on the event loop's thread). While the
        store is out of reach the deltas pile up only so far: past that they are dropped
        (gateways see the gap in the sequence and reload the next snapshot)."""
        self._pending.extend(events)
        if len(self._pending) > _MAX_PENDING:
            self._pending = [e for e in self._pending if e.snapshot][-1:]
        self._wake.set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="fleet-heartbeat")

    async def stop(self) -> None:
        """Leave the fleet: the record and index entry go, gateways are told."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        worker_id = self.record().worker_id
        with contextlib.suppress(aioredis.RedisError, OSError):
            async with asyncio.timeout(2.0):
                async with self.redis.pipeline(transaction=True) as pipe:
                    pipe.delete(record_key(worker_id), snapshot_key(worker_id))
                    pipe.zrem(WORKERS, worker_id)
                    pipe.publish(EVENTS, f"leave {worker_id}")
                    await pipe.execute()

    async def _run(self) -> None:
        next_beat = 0.0
        failures = 0
        while True:
            now = time.monotonic()
            try:
                if now >= next_beat:
                    await self._beat()
                    next_beat = now + HEARTBEAT_S
                await self._publish()
                if failures:
                    log.warning("fleet store reachable again")
                failures = 0
            except (aioredis.RedisError, OSError) as exc:
                failures += 1
                if failures == 1:
                    log.warning("cannot reach the fleet store (%s); retrying", exc)
                next_beat = now + HEARTBEAT_S
            except Exception:  # a bug must not end the heartbeat: the worker would vanish
                log.exception("fleet heartbeat failed; retrying")
                next_beat = now + HEARTBEAT_S
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, next_beat - time.monotonic())):
                    await self._wake.wait()
            self._wake.clear()

    async def _beat(self) -> None:
        record = msgspec.structs.replace(self.record(), heartbeat_at=time.time())
        expires_ms = int(time.time() * 1000) + RECORD_TTL_MS
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(record_key(record.worker_id), seal(record, self.secret), px=RECORD_TTL_MS)
            pipe.zadd(WORKERS, {record.worker_id: expires_ms})
            if not self._joined:
                pipe.publish(EVENTS, f"join {record.worker_id}")
            await pipe.execute()
        self._joined = True

    async def _publish(self) -> None:
        if not self._pending:
            return
        events, self._pending = self._pending, []
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for event in events:
                    blob = msgspec.msgpack.encode(event)
                    if event.snapshot:
                        pipe.set(snapshot_key(event.worker_id), blob, ex=SNAPSHOT_TTL_S)
                    else:
                        pipe.publish(KV_EVENTS, blob)
                await pipe.execute()
        except BaseException:
            self._pending[:0] = events  # kept for the next try (deltas keep their order)
            raise

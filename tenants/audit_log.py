"""The audit log of admin changes: one entry per mutating admin request, in a Redis stream
whose ids are the time of writing (milliseconds), trimmed to about `max_entries` (XADD
MAXLEN ~). Entries are written by the gateway with secrets already removed; here they are
only appended, and read back by time window and target in pages.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import redis.asyncio as aioredis

from tenants import keyspace

DEFAULT_MAX_ENTRIES = 1_000_000
_SCAN_BATCH = 500


class AuditEntry(msgspec.Struct, kw_only=True):
    """One admin request that changed (or tried to change) something."""

    at: float  # unix seconds
    actor: str  # the admin token's id, or `bootstrap`
    role: str
    action: str  # `<resource>.<operation>`, e.g. `tenants.patch_policy`
    method: str
    path: str
    status: int  # the HTTP status answered: the change happened when it is 2xx
    target: str | None = None  # the id the change is about (tenant, key, adapter, ...)
    tenant_id: str | None = None  # the tenant it concerns, where there is one
    created_id: str | None = None  # the id of what it created
    change: Any = None  # the request's JSON body, secrets removed
    client: str | None = None  # the client's address
    user_agent: str | None = None
    request_id: str | None = None
    id: str = ""  # the stream id, given when read back (the page cursor)

    def concerns(self, target: str) -> bool:
        return target in (self.target, self.tenant_id, self.created_id)


_decoder = msgspec.json.Decoder(AuditEntry)


class AuditLog:
    """Append entries and read them back; owns nothing but the stream."""

    def __init__(self, redis: aioredis.Redis, *, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self._redis = redis
        self.max_entries = max_entries

    async def append(self, entry: AuditEntry) -> str:
        """XADD the entry (trimming the stream to about `max_entries`); returns its id."""
        entry_id = await self._redis.xadd(
            keyspace.AUDIT_STREAM,
            {"e": msgspec.json.encode(entry)},
            maxlen=self.max_entries,
            approximate=True,
        )
        return keyspace.as_str(entry_id)

    async def page(
        self,
        start: float,
        end: float,
        *,
        target: str | None = None,
        limit: int = 100,
        after: str | None = None,
    ) -> tuple[list[AuditEntry], str | None]:
        """Up to `limit` entries written in [start, end) about `target` (all for None),
        oldest first, after the cursor `after`; and the cursor of the next page (None when
        this one reaches the end)."""
        found: list[AuditEntry] = []
        async for entry in self.scan(start, end, target=target, after=after):
            found.append(entry)
            if len(found) == limit:
                return found, entry.id
        return found, None

    async def scan(
        self, start: float, end: float, *, target: str | None = None, after: str | None = None
    ) -> AsyncIterator[AuditEntry]:
        """Every entry of [start, end) about `target`, oldest first, read in batches."""
        low = f"({after}" if after else f"{max(0, math.floor(start * 1000))}-0"
        high = str(max(0, math.ceil(end * 1000) - 1))
        while True:
            batch: list[Any] = (
                await self._redis.xrange(keyspace.AUDIT_STREAM, low, high, count=_SCAN_BATCH) or []
            )
            for raw_id, fields in batch:
                entry = _decoder.decode(fields.get(b"e") or fields["e"])
                entry.id = keyspace.as_str(raw_id)
                if target is None or entry.concerns(target):
                    yield entry
            if len(batch) < _SCAN_BATCH:
                return
            low = f"({keyspace.as_str(batch[-1][0])}"

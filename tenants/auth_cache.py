"""The in-process cache of successful authentications, keyed by the SHA-256 of the secret.

Entries live at most `ttl_s` and are dropped early by invalidations. A generation counter,
bumped by every drop, closes the read/invalidate race: a caller snapshots `generation` before
reading the store and `put` refuses the entry if any invalidation arrived in between, so a
result read before a revocation can never be cached after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from tenants.records import ApiKey, Tenant


class AuthContext(msgspec.Struct, frozen=True):
    """Who a request is: the tenant record (policy included) and the key it presented."""

    tenant: Tenant
    key: ApiKey


class AuthCache:
    """Bounded TTL map secret-hash -> AuthContext. Not thread-safe (one event loop)."""

    def __init__(
        self,
        ttl_s: float = 10.0,
        max_entries: int = 10_000,
        *,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        assert ttl_s > 0 and max_entries > 0
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._monotonic = monotonic
        self._entries: dict[str, tuple[float, AuthContext]] = {}
        self.generation = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, secret_hash: str, max_age_s: float | None = None) -> AuthContext | None:
        """The cached context if younger than `max_age_s` (default: the TTL), else None.

        Entries past the TTL are kept (until evicted by size or dropped by an invalidation) so
        that `KeyManager` can fall back to them while the store is unreachable.
        """
        entry = self._entries.get(secret_hash)
        if entry is None:
            return None
        stored_at, ctx = entry
        if self._monotonic() - stored_at >= (self.ttl_s if max_age_s is None else max_age_s):
            return None
        return ctx

    def put(self, secret_hash: str, ctx: AuthContext, generation: int) -> bool:
        """Store `ctx` unless an invalidation happened since `generation` was read. Evicts
        the oldest entry when full. Returns whether it was stored."""
        if generation != self.generation:
            return False
        self._entries.pop(secret_hash, None)
        while len(self._entries) >= self.max_entries:
            del self._entries[next(iter(self._entries))]
        self._entries[secret_hash] = (self._monotonic(), ctx)
        return True

    def drop_key(self, secret_hash: str) -> None:
        self.generation += 1
        self._entries.pop(secret_hash, None)

    def drop_tenant(self, tenant_id: str) -> None:
        self.generation += 1
        stale = [h for h, (_, ctx) in self._entries.items() if ctx.tenant.id == tenant_id]
        for secret_hash in stale:
            del self._entries[secret_hash]

    def clear(self) -> None:
        self.generation += 1
        self._entries.clear()

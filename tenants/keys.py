"""API keys: issue, list, revoke, rotate and authenticate.

A secret is `sk-strata-` + 43 url-safe base64 characters (32 random bytes). The store keeps
only its SHA-256 hex; the secret is returned once, by `create_key` / `rotate_key`, and never
logged. `authenticate` serves repeat presentations from an in-process cache that every replica
keeps coherent through `tenants.invalidation`: a revocation, rotation or tenant change made
anywhere drops the affected entries everywhere (pub/sub latency, well under a second), and
revocation and expiry times are re-checked against the clock on every hit.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Callable

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from tenants import keyspace
from tenants.auth_cache import AuthCache, AuthContext
from tenants.errors import AuthError, ConflictError, TenantDisabledError
from tenants.invalidation import Invalidation, InvalidationSubscriber, stage_invalidation
from tenants.keyspace import StoredKey
from tenants.records import (
    ApiKey,
    ApiKeyCreated,
    Budget,
    KeyCreate,
    KeyRotate,
    KeyUpdate,
    RecordError,
)

__all__ = ["AuthContext", "KeyManager", "hash_secret", "new_secret"]

SECRET_PREFIX = "sk-strata-"
PREFIX_CHARS = 14  # what listings show: "sk-strata-" and 4 characters of the secret
_SECRET = re.compile(r"sk-strata-[A-Za-z0-9_-]{43}")

# key hash -> key record -> tenant record in one round trip; returns nil or {key, tenant|nil}
_LOOKUP = """
local key_id = redis.call('GET', KEYS[1])
if not key_id then return false end
local raw = redis.call('GET', ARGV[1] .. key_id)
if not raw then return false end
local tenant_id = cjson.decode(raw)['key']['tenant_id']
return {raw, redis.call('GET', ARGV[2] .. tenant_id)}
"""


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def check_active(ctx: AuthContext, now: float) -> None:
    """Raise AuthError unless the key is live at `now` and its tenant enabled."""
    key = ctx.key
    if key.revoked_at is not None and key.revoked_at <= now:
        raise AuthError("revoked")
    if key.expires_at is not None and now >= key.expires_at:
        raise AuthError("expired")
    if ctx.tenant.disabled:
        raise AuthError("tenant_disabled")


async def read_tenant_keys(pipe: Pipeline, tenant_id: str) -> list[StoredKey]:
    """The tenant's stored keys, read on a pipeline in watch mode (it WATCHes the key set)."""
    await pipe.watch(keyspace.tenant_keys(tenant_id))
    key_ids = sorted(map(keyspace.as_str, await pipe.smembers(keyspace.tenant_keys(tenant_id))))
    if not key_ids:
        return []
    raws = await pipe.mget([keyspace.key(k) for k in key_ids])
    return [keyspace.decode_key(raw) for raw in raws if raw is not None]


def stage_key_purge(pipe: Pipeline, tenant_id: str, keys: list[StoredKey]) -> None:
    """Queue (after MULTI) the deletion of all of a tenant's keys: records, hash lookups and
    the key set. Used when the tenant itself is deleted, so a re-created tenant with the same
    id never inherits them."""
    for stored in keys:
        pipe.delete(keyspace.key(stored.key.id), keyspace.key_hash(stored.secret_hash))
    pipe.delete(keyspace.tenant_keys(tenant_id))


def _stage_key_write(pipe: Pipeline, stored: StoredKey, *, is_new: bool) -> None:
    pipe.set(keyspace.key(stored.key.id), msgspec.json.encode(stored))
    if is_new:
        pipe.set(keyspace.key_hash(stored.secret_hash), stored.key.id)
        pipe.sadd(keyspace.tenant_keys(stored.key.tenant_id), stored.key.id)


async def _require_enabled_tenant(pipe: Pipeline, tenant_id: str) -> None:
    await pipe.watch(keyspace.tenant(tenant_id))
    tenant = await keyspace.read_tenant(pipe, tenant_id)
    if tenant.disabled:
        raise TenantDisabledError(tenant_id)


def _issue(
    tenant_id: str, name: str, now: float, expires_at: float | None, like: ApiKey | KeyCreate
) -> ApiKeyCreated:
    """A new key; its limits, budget and metadata are `like`'s (the spec, or the key it
    succeeds)."""
    secret = new_secret()
    key = ApiKey(
        id="key_" + secrets.token_hex(8),
        tenant_id=tenant_id,
        prefix=secret[:PREFIX_CHARS],
        name=name,
        created_at=now,
        expires_at=expires_at,
        limits=like.limits,
        budget=like.budget,
        metadata=dict(like.metadata),
    )
    return ApiKeyCreated(key=key, secret=secret)


def _stored(created: ApiKeyCreated) -> StoredKey:
    return StoredKey(key=created.key, secret_hash=hash_secret(created.secret))


class KeyManager:
    """API keys in the store plus this replica's authentication cache.

    Call `start()` once the event loop runs (it subscribes to invalidations; until the
    subscription is confirmed every `authenticate` goes to the store) and `stop()` at shutdown.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        cache_ttl_s: float = 10.0,
        cache_max_entries: int = 10_000,
        clock: Callable[[], float] = time.time,
        ping_interval_s: float = 5.0,
        outage_grace_s: float = 3600.0,
    ) -> None:
        self._redis = redis
        self.outage_grace_s = outage_grace_s
        self._clock = clock
        self.cache = AuthCache(cache_ttl_s, cache_max_entries)
        self.subscriber = InvalidationSubscriber(
            redis, self._on_invalidation, self.cache.clear, ping_interval_s=ping_interval_s
        )
        self._lookup = redis.register_script(_LOOKUP)

    async def start(self, timeout: float = 5.0) -> bool:
        """Subscribe to invalidations; returns whether the subscription is live yet."""
        return await self.subscriber.start(timeout)

    async def stop(self) -> None:
        await self.subscriber.stop()
        self.cache.clear()

    # -- admin -----------------------------------------------------------------------------

    async def create_key(self, tenant_id: str, spec: KeyCreate) -> ApiKeyCreated:
        """Issue a key for an existing, enabled tenant. Writes the key record, its hash lookup
        and the tenant's key set atomically. Raises NotFoundError, TenantDisabledError,
        RecordError (bad expiry)."""
        now = self._clock()
        if spec.expires_at is not None and spec.expires_in_s is not None:
            raise RecordError("give expires_at or expires_in_s, not both")
        expires_at = spec.expires_at
        if spec.expires_in_s is not None:
            expires_at = now + spec.expires_in_s
        if expires_at is not None and expires_at <= now:
            raise RecordError("expires_at must be in the future")
        created = _issue(tenant_id, spec.name, now, expires_at, spec)

        async def write(pipe: Pipeline) -> None:
            await _require_enabled_tenant(pipe, tenant_id)
            pipe.multi()
            _stage_key_write(pipe, _stored(created), is_new=True)

        await self._redis.transaction(write)
        return created

    async def list_keys(self, tenant_id: str) -> list[ApiKey]:
        """The tenant's keys (revoked ones included), oldest first; NotFoundError if no
        such tenant."""
        await keyspace.read_tenant(self._redis, tenant_id)
        key_ids = await self._redis.smembers(keyspace.tenant_keys(tenant_id))
        if not key_ids:
            return []
        raws = await self._redis.mget([keyspace.key(keyspace.as_str(k)) for k in key_ids])
        keys = [keyspace.decode_key(raw).key for raw in raws if raw is not None]
        return sorted(keys, key=lambda k: (k.created_at, k.id))

    async def get_key(self, key_id: str) -> ApiKey:
        return (await keyspace.read_key(self._redis, key_id)).key

    async def update_key(self, key_id: str, spec: KeyUpdate) -> ApiKey:
        """Rename the key or replace its limits or metadata (the fields `spec` gives) and
        invalidate every replica's cache entry. Raises NotFoundError."""
        changes = {
            f: getattr(spec, f)
            for f in spec.__struct_fields__
            if getattr(spec, f) is not msgspec.UNSET
        }
        return await self._modify_key(key_id, lambda k: msgspec.structs.replace(k, **changes))

    async def set_key_budget(self, key_id: str, budget: Budget | None) -> ApiKey:
        """Set (or clear, with None) the key's budget; invalidates cached authentications."""
        return await self._modify_key(key_id, lambda k: msgspec.structs.replace(k, budget=budget))

    async def _modify_key(self, key_id: str, change: Callable[[ApiKey], ApiKey]) -> ApiKey:
        async def write(pipe: Pipeline) -> StoredKey:
            await pipe.watch(keyspace.key(key_id))
            stored = await keyspace.read_key(pipe, key_id)
            updated = msgspec.structs.replace(stored, key=change(stored.key))
            assert updated.key.id == key_id
            pipe.multi()
            _stage_key_write(pipe, updated, is_new=False)
            stage_invalidation(pipe, "key", stored.secret_hash)
            return updated

        updated: StoredKey = await self._redis.transaction(write, value_from_callable=True)
        self.cache.drop_key(updated.secret_hash)  # read-your-writes here, before the echo
        return updated.key

    async def revoke_key(self, key_id: str) -> ApiKey:
        """Set `revoked_at = now` (an earlier revocation is kept) and invalidate every
        replica's cache entry. Idempotent. Raises NotFoundError."""

        async def write(pipe: Pipeline) -> StoredKey:
            await pipe.watch(keyspace.key(key_id))
            stored = await keyspace.read_key(pipe, key_id)
            now = self._clock()
            revoked_at = min(now, stored.key.revoked_at or now)
            updated = msgspec.structs.replace(
                stored, key=msgspec.structs.replace(stored.key, revoked_at=revoked_at)
            )
            pipe.multi()
            _stage_key_write(pipe, updated, is_new=False)
            stage_invalidation(pipe, "key", stored.secret_hash)
            return updated

        updated: StoredKey = await self._redis.transaction(write, value_from_callable=True)
        self.cache.drop_key(updated.secret_hash)  # read-your-writes here, before the echo
        return updated.key

    async def rotate_key(self, key_id: str, spec: KeyRotate) -> ApiKeyCreated:
        """Issue a successor (same tenant, name and expiry) and set the old key's
        `revoked_at = now + grace_seconds`, so it keeps working through the grace period.
        Raises NotFoundError, ConflictError (old key no longer active), TenantDisabledError."""

        async def write(pipe: Pipeline) -> tuple[ApiKeyCreated, str]:
            await pipe.watch(keyspace.key(key_id))
            old = await keyspace.read_key(pipe, key_id)
            now = self._clock()
            if not old.key.is_active(now):
                raise ConflictError(f"key {key_id!r} is revoked or expired")
            await _require_enabled_tenant(pipe, old.key.tenant_id)
            deadline = now + spec.grace_seconds
            if old.key.revoked_at is not None:
                deadline = min(deadline, old.key.revoked_at)
            retired = msgspec.structs.replace(
                old, key=msgspec.structs.replace(old.key, revoked_at=deadline)
            )
            created = _issue(old.key.tenant_id, old.key.name, now, old.key.expires_at, old.key)
            pipe.multi()
            _stage_key_write(pipe, retired, is_new=False)
            _stage_key_write(pipe, _stored(created), is_new=True)
            stage_invalidation(pipe, "key", old.secret_hash)
            return created, old.secret_hash

        created, old_hash = await self._redis.transaction(write, value_from_callable=True)
        self.cache.drop_key(old_hash)  # read-your-writes here, before the echo
        return created

    # -- request path ----------------------------------------------------------------------

    async def authenticate(self, secret: str | None) -> AuthContext:
        """The tenant and key behind a presented secret, from the cache or one store round
        trip. Mutates only the cache. Raises AuthError(reason) for anything but a live key of
        an enabled tenant; store errors (redis.RedisError) propagate, except for keys of
        fail_open tenants verified within `outage_grace_s`, which are accepted from the cache
        while the store is unreachable."""
        if not secret:
            raise AuthError("missing")
        if not _SECRET.fullmatch(secret):
            raise AuthError("malformed")
        secret_hash = hash_secret(secret)
        use_cache = self.subscriber.is_live
        if use_cache and (ctx := self.cache.get(secret_hash)) is not None:
            check_active(ctx, self._clock())
            return ctx
        generation = self.cache.generation
        try:
            found = await self._lookup(
                keys=[keyspace.key_hash(secret_hash)],
                args=[keyspace.KEY_PREFIX, keyspace.TENANT_PREFIX],
            )
        except (aioredis.ConnectionError, aioredis.TimeoutError, OSError):
            # the store is down: a fail_open tenant keeps its recently verified keys (nobody
            # can revoke anything while the store is down); everyone else gets the error
            stale = self.cache.get(secret_hash, max_age_s=self.outage_grace_s)
            if stale is None or stale.tenant.policy.on_store_unavailable != "fail_open":
                raise
            check_active(stale, self._clock())
            return stale
        if not found or found[1] is None:
            raise AuthError("unknown")  # no such key, or its tenant was deleted
        stored = keyspace.decode_key(found[0])
        if not hmac.compare_digest(stored.secret_hash, secret_hash):
            raise AuthError("unknown")
        ctx = AuthContext(tenant=keyspace.decode_tenant(found[1]), key=stored.key)
        check_active(ctx, self._clock())
        # kept even while invalidations are not heard (a resubscription clears the cache):
        # hits are served only while they are, but a fail_open tenant's key verified now
        # still answers if the store then goes away
        self.cache.put(secret_hash, ctx, generation)
        return ctx

    def _on_invalidation(self, invalidation: Invalidation) -> None:
        if invalidation.kind == "key":
            self.cache.drop_key(invalidation.ident)
        else:
            self.cache.drop_tenant(invalidation.ident)

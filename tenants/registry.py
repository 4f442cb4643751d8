"""Tenants (with their policies), LoRA adapters and prices, stored as msgspec JSON under the
layout in `tenants.keyspace`.

Read-modify-write updates run under WATCH/MULTI, so concurrent writers on any replica never
lose each other's changes, and a change that affects authentication (tenant update, policy,
deletion) publishes its invalidation inside the same transaction.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from tenants import keyspace
from tenants.errors import ConflictError, NotFoundError
from tenants.invalidation import stage_invalidation
from tenants.keys import read_tenant_keys, stage_key_purge
from tenants.records import (
    Adapter,
    AdapterCreate,
    Budget,
    Policy,
    PolicyPatch,
    Price,
    RecordError,
    Tenant,
    TenantCreate,
    TenantUpdate,
)

_adapter_decoder = msgspec.json.Decoder(Adapter)
_price_decoder = msgspec.json.Decoder(Price | list[Price])

# how far in the past an `effective_at` may lie (clock skew) before a price is refused
PRICE_PAST_SLACK_S = 60.0


def _versions(raw: bytes | str) -> list[Price]:
    found = _price_decoder.decode(raw)
    return found if isinstance(found, list) else [found]  # a single record: stored unversioned


# create a tenant only if its id is free and was never a deleted tenant's: SET NX plus the
# listing index, atomically
_CREATE_TENANT = """
if redis.call('SISMEMBER', KEYS[3], ARGV[3]) == 1 then return -1 end
if not redis.call('SET', KEYS[1], ARGV[1], 'NX') then return 0 end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
return 1
"""


class TenantRegistry:
    """Admin-side CRUD over tenants, policies, adapters and prices (no caching here; the
    request path reads tenants through `KeyManager.authenticate`)."""

    def __init__(self, redis: aioredis.Redis, *, clock: Callable[[], float] = time.time) -> None:
        self._redis = redis
        self._clock = clock
        self._create_tenant = redis.register_script(_CREATE_TENANT)
        # called after this registry changes a price (a replica's price cache listens)
        self.price_listeners: list[Callable[[], None]] = []

    # -- tenants ---------------------------------------------------------------------------

    async def create_tenant(self, spec: TenantCreate) -> Tenant:
        """Store a new tenant with a fresh random `cache_salt`. Raises ConflictError if the id
        is taken or belonged to a deleted tenant (a new tenant never inherits a deleted one's
        usage, counters or adapter access)."""
        tenant = Tenant(
            id=spec.id or "t_" + secrets.token_hex(8),
            name=spec.name,
            created_at=self._clock(),
            policy=spec.policy,
            cache_salt=secrets.token_hex(16),
        )
        created = await self._create_tenant(
            keys=[keyspace.tenant(tenant.id), keyspace.TENANTS, keyspace.RETIRED_TENANTS],
            args=[msgspec.json.encode(tenant), repr(tenant.created_at), tenant.id],
        )
        if created == -1:
            raise ConflictError(
                f"tenant id {tenant.id!r} belonged to a deleted tenant; ids are never reused"
            )
        if not created:
            raise ConflictError(f"tenant {tenant.id!r} already exists")
        return tenant

    async def get_tenant(self, tenant_id: str) -> Tenant:
        return await keyspace.read_tenant(self._redis, tenant_id)

    async def list_tenants(self) -> list[Tenant]:
        """Every tenant, oldest first."""
        ids = await self._redis.zrange(keyspace.TENANTS, 0, -1)
        if not ids:
            return []
        raws = await self._redis.mget([keyspace.tenant(keyspace.as_str(i)) for i in ids])
        return [keyspace.decode_tenant(raw) for raw in raws if raw is not None]

    async def update_tenant(self, tenant_id: str, spec: TenantUpdate) -> Tenant:
        """Rename and/or (dis)able a tenant; invalidates its cached authentications."""
        changes = {
            f: getattr(spec, f)
            for f in spec.__struct_fields__
            if getattr(spec, f) is not msgspec.UNSET
        }
        return await self._modify(tenant_id, lambda t: msgspec.structs.replace(t, **changes))

    async def delete_tenant(self, tenant_id: str) -> None:
        """Delete the tenant and all of its API keys (records and hash lookups) in one
        transaction, retire its id, and invalidate every replica's cache for it. Its usage
        records stay in the ledger. Raises NotFoundError."""

        async def write(pipe: Pipeline) -> None:
            await pipe.watch(keyspace.tenant(tenant_id))
            await keyspace.read_tenant(pipe, tenant_id)
            keys = await read_tenant_keys(pipe, tenant_id)
            pipe.multi()
            pipe.delete(keyspace.tenant(tenant_id))
            pipe.zrem(keyspace.TENANTS, tenant_id)
            pipe.sadd(keyspace.RETIRED_TENANTS, tenant_id)
            stage_key_purge(pipe, tenant_id, keys)
            stage_invalidation(pipe, "tenant", tenant_id)

        await self._redis.transaction(write)

    async def rotate_cache_salt(self, tenant_id: str) -> Tenant:
        """Give the tenant a fresh cache salt: its prefix-cache entries made under the old
        one are never hit again (and age out). Invalidates cached authentications."""
        salt = secrets.token_hex(16)
        return await self._modify(tenant_id, lambda t: msgspec.structs.replace(t, cache_salt=salt))

    # -- policies --------------------------------------------------------------------------

    async def get_policy(self, tenant_id: str) -> Policy:
        return (await self.get_tenant(tenant_id)).policy

    async def put_policy(self, tenant_id: str, policy: Policy) -> Policy:
        """Replace the tenant's policy (atomically; invalidates cached authentications).
        The policy is re-validated first (a Struct mutated after construction skipped its
        checks): RecordError leaves the store untouched."""
        checked = msgspec.structs.replace(policy)
        tenant = await self._modify(tenant_id, lambda t: msgspec.structs.replace(t, policy=checked))
        return tenant.policy

    async def patch_policy(self, tenant_id: str, patch: PolicyPatch) -> Policy:
        """Apply `patch` to the current policy under WATCH/MULTI, so concurrent patches of
        different fields all land. RecordError (invalid result) leaves the store untouched."""
        tenant = await self._modify(
            tenant_id, lambda t: msgspec.structs.replace(t, policy=patch.apply(t.policy))
        )
        return tenant.policy

    async def set_budget(self, tenant_id: str, budget: Budget | None) -> Tenant:
        """Set (or clear, with None) the tenant's budget; invalidates cached
        authentications, so every replica admits against it at once."""
        return await self._modify(tenant_id, lambda t: msgspec.structs.replace(t, budget=budget))

    async def _modify(self, tenant_id: str, change: Callable[[Tenant], Tenant]) -> Tenant:
        """Read, `change`, write back the tenant record and publish its invalidation, retried
        on concurrent modification. Exceptions from `change` abort without writing."""

        async def write(pipe: Pipeline) -> Tenant:
            await pipe.watch(keyspace.tenant(tenant_id))
            updated = change(await keyspace.read_tenant(pipe, tenant_id))
            assert updated.id == tenant_id
            pipe.multi()
            pipe.set(keyspace.tenant(tenant_id), msgspec.json.encode(updated))
            stage_invalidation(pipe, "tenant", tenant_id)
            return updated

        tenant: Tenant = await self._redis.transaction(write, value_from_callable=True)
        return tenant

    # -- adapters --------------------------------------------------------------------------

    async def register_adapter(self, spec: AdapterCreate, base_model: str) -> Adapter:
        """Store a new version of adapter `spec.name`: one more than the highest version ever
        issued for that name (an atomic INCR, so concurrent registrations get distinct
        versions and a deleted adapter's versions are never reused)."""
        version = int(await self._redis.incr(keyspace.adapter_seq(spec.name)))
        adapter = Adapter(
            name=spec.name,
            version=version,
            path=spec.path,
            base_model=base_model,
            created_at=self._clock(),
            allowed_tenants=spec.allowed_tenants,
        )
        async with self._redis.pipeline(transaction=True) as pipe:
            record = msgspec.json.encode(adapter)
            pipe.hset(keyspace.adapter_versions(spec.name), str(version), record)
            pipe.sadd(keyspace.ADAPTER_NAMES, spec.name)
            await pipe.execute()
        return adapter

    async def list_adapters(self, tenant_id: str | None = None) -> list[Adapter]:
        """The latest version of every adapter, by name; with `tenant_id`, only those that
        tenant may use."""
        names = sorted(map(keyspace.as_str, await self._redis.smembers(keyspace.ADAPTER_NAMES)))
        async with self._redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hvals(keyspace.adapter_versions(name))
            all_versions = await pipe.execute()
        adapters = []
        for raws in all_versions:
            if not raws:
                continue
            latest = max((_adapter_decoder.decode(r) for r in raws), key=lambda a: a.version)
            if tenant_id is None or tenant_may_use(latest, tenant_id):
                adapters.append(latest)
        return adapters

    async def get_adapter(self, name: str, version: int | None = None) -> Adapter:
        """One version of an adapter (the latest by default); raises NotFoundError."""
        ident = name if version is None else f"{name}@{version}"
        if version is not None:
            raw = await self._redis.hget(keyspace.adapter_versions(name), str(version))
            if raw is None:
                raise NotFoundError("adapter", ident)
            return _adapter_decoder.decode(raw)
        raws = await self._redis.hvals(keyspace.adapter_versions(name))
        if not raws:
            raise NotFoundError("adapter", ident)
        return max((_adapter_decoder.decode(r) for r in raws), key=lambda a: a.version)

    async def adapter_known(self, name: str) -> bool:
        """Whether `name` was ever registered (its version counter outlives deletion)."""
        return bool(await self._redis.exists(keyspace.adapter_seq(name)))

    async def delete_adapter(self, name: str) -> None:
        """Delete every version of the adapter (its version counter is kept)."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(keyspace.adapter_versions(name))
            pipe.srem(keyspace.ADAPTER_NAMES, name)
            num_deleted, _ = await pipe.execute()
        if not num_deleted:
            raise NotFoundError("adapter", name)

    # -- prices ----------------------------------------------------------------------------

    async def put_price(self, price: Price) -> Price:
        """Add a version to `price.model`'s price history, in force from `effective_at`
        (now when absent; one already at that time is replaced). Past usage is never
        repriced: RecordError for an `effective_at` more than a minute in the past, and
        every later version keeps its place."""
        now = self._clock()
        at = now if price.effective_at is None else price.effective_at
        if at < now - PRICE_PAST_SLACK_S:
            raise RecordError("effective_at must not be in the past")
        version = msgspec.structs.replace(price, effective_at=max(at, now))

        async def write(pipe: Pipeline) -> None:
            await pipe.watch(keyspace.PRICES)
            raw = await pipe.hget(keyspace.PRICES, price.model)
            versions = [] if raw is None else _versions(raw)
            kept = [v for v in versions if v.effective_at != version.effective_at]
            kept.append(version)
            kept.sort(key=lambda v: v.effective_at or 0.0)
            pipe.multi()
            pipe.hset(keyspace.PRICES, price.model, msgspec.json.encode(kept))

        await self._redis.transaction(write)
        self._prices_changed()
        return version

    def _prices_changed(self) -> None:
        for listener in self.price_listeners:
            listener()

    async def list_prices(self) -> list[Price]:
        """Every price version, by model, then effective time."""
        raws = await self._redis.hgetall(keyspace.PRICES)
        versions = [v for raw in raws.values() for v in _versions(raw)]
        return sorted(versions, key=lambda p: (p.model, p.effective_at or 0.0))

    async def delete_price(self, model: str) -> None:
        """Forget every version of the model's price (recorded costs stay as they are)."""
        if not await self._redis.hdel(keyspace.PRICES, model):
            raise NotFoundError("price", model)
        self._prices_changed()


def tenant_may_use(adapter: Adapter, tenant_id: str) -> bool:
    """Whether the adapter's ACL admits the tenant."""
    return adapter.allowed_tenants is None or tenant_id in adapter.allowed_tenants

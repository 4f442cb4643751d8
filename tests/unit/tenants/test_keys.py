"""KeyManager against a real valkey-server: secrets, hashing, authentication, rotation, and
cache coherence between replicas through pub/sub invalidation."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import time
from collections.abc import Awaitable, Callable

import msgspec
import pytest
import redis.asyncio as redis

from tenants import keyspace
from tenants.auth_cache import AuthCache, AuthContext
from tenants.errors import AuthError, ConflictError, NotFoundError, TenantDisabledError
from tenants.keys import KeyManager, new_secret
from tenants.records import (
    ApiKey,
    KeyCreate,
    KeyRotate,
    Policy,
    PolicyPatch,
    RecordError,
    Tenant,
    TenantCreate,
    TenantUpdate,
)
from tenants.registry import TenantRegistry
from tenants.store import connect
from tests.unit.tenants.test_registry import dump_store


class FakeClock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def tenant(redis_client) -> Tenant:
    return await TenantRegistry(redis_client).create_tenant(
        TenantCreate(name="acme", id="acme", policy=Policy(rpm=60))
    )


@pytest.fixture
def keys(redis_client) -> KeyManager:
    return KeyManager(redis_client)


async def auth_reason(manager: KeyManager, secret: str | None) -> str:
    with pytest.raises(AuthError) as info:
        await manager.authenticate(secret)
    return info.value.reason


async def within(seconds: float, check: Callable[[], Awaitable[bool]]) -> float:
    """Poll `check` until it is true; returns the time it took, fails after `seconds`."""
    start = time.monotonic()
    while not await check():
        assert time.monotonic() - start < seconds, f"not within {seconds}s"
        await asyncio.sleep(0.01)
    return time.monotonic() - start


def rejects(manager: KeyManager, secret: str, reason: str) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        try:
            await manager.authenticate(secret)
        except AuthError as exc:
            got = exc.reason
        else:
            return False
        assert got == reason
        return True

    return check


# -- secrets and storage -------------------------------------------------------------------


def test_secret_format_and_entropy():
    secrets_ = [new_secret() for _ in range(2000)]
    assert len(set(secrets_)) == len(secrets_)
    for secret in secrets_:
        assert secret.startswith("sk-strata-") and len(secret) == 53
        body = secret.removeprefix("sk-strata-")
        assert len(base64.urlsafe_b64decode(body + "=")) == 32  # 256 random bits
    alphabet = set("".join(s[10:] for s in secrets_))
    assert len(alphabet) == 64  # the whole url-safe alphabet shows up, nothing else


async def test_create_key_returns_secret_once_and_stores_only_its_hash(keys, tenant, redis_client):
    created = [await keys.create_key("acme", KeyCreate(name=f"k{i}")) for i in range(5)]
    store = msgspec.json.encode(
        {k.decode(): repr(v) for k, v in (await dump_store(redis_client)).items()}
    ).decode()
    for c in created:
        assert c.key.id.startswith("key_") and len(c.key.id) == 20
        assert c.key.prefix == c.secret[:14] and c.key.tenant_id == "acme"
        assert c.secret not in store and c.secret[10:] not in store and c.secret[14:30] not in store
        assert hashlib.sha256(c.secret.encode()).hexdigest() in store
    assert "secret" not in msgspec.json.encode(created[0].key).decode()


async def test_list_get_revoke(redis_client, tenant):
    clock = FakeClock()
    keys = KeyManager(redis_client, clock=clock)
    first = await keys.create_key("acme", KeyCreate(name="first"))
    clock.now += 1
    second = await keys.create_key("acme", KeyCreate(name="second"))
    assert await keys.list_keys("acme") == [first.key, second.key]
    assert await keys.get_key(second.key.id) == second.key

    clock.now += 1
    revoked = await keys.revoke_key(first.key.id)
    assert revoked.revoked_at == clock.now
    clock.now += 5
    again = await keys.revoke_key(first.key.id)  # idempotent: the first revocation stands
    assert again.revoked_at == revoked.revoked_at
    assert [k.revoked_at for k in await keys.list_keys("acme")] == [revoked.revoked_at, None]

    with pytest.raises(NotFoundError):
        await keys.get_key("key_0000000000000000")
    with pytest.raises(NotFoundError):
        await keys.revoke_key("key_0000000000000000")
    with pytest.raises(NotFoundError):
        await keys.list_keys("nope")


async def test_create_key_checks_tenant_and_expiry(keys, tenant, redis_client):
    with pytest.raises(NotFoundError):
        await keys.create_key("nope", KeyCreate())
    with pytest.raises(RecordError):
        await keys.create_key("acme", KeyCreate(expires_at=time.time() + 60, expires_in_s=60))
    with pytest.raises(RecordError):
        await keys.create_key("acme", KeyCreate(expires_at=time.time() - 1))
    await TenantRegistry(redis_client).update_tenant("acme", TenantUpdate(disabled=True))
    with pytest.raises(TenantDisabledError):
        await keys.create_key("acme", KeyCreate())
    assert await keys.list_keys("acme") == []


# -- authenticate --------------------------------------------------------------------------


async def test_authenticate_success(keys, tenant):
    created = await keys.create_key("acme", KeyCreate())
    ctx = await keys.authenticate(created.secret)
    assert ctx == AuthContext(tenant=tenant, key=created.key)
    assert ctx.tenant.policy.rpm == 60


async def test_each_failure_reason(redis_client, tenant):
    clock = FakeClock(time.time())
    keys = KeyManager(redis_client, clock=clock)
    good = await keys.create_key("acme", KeyCreate())
    assert await auth_reason(keys, None) == "missing"
    assert await auth_reason(keys, "") == "missing"
    for bad in (
        "sk-strata-short",
        "Bearer " + good.secret,
        good.secret + "x",
        "sk-other-" + good.secret[9:],
        good.secret[:-1] + "!",
    ):
        assert await auth_reason(keys, bad) == "malformed"
    assert await auth_reason(keys, new_secret()) == "unknown"

    expiring = await keys.create_key("acme", KeyCreate(expires_in_s=30))
    await keys.authenticate(expiring.secret)
    clock.now += 30
    assert await auth_reason(keys, expiring.secret) == "expired"

    revoked = await keys.create_key("acme", KeyCreate())
    await keys.revoke_key(revoked.key.id)
    assert await auth_reason(keys, revoked.secret) == "revoked"

    await TenantRegistry(redis_client).update_tenant("acme", TenantUpdate(disabled=True))
    assert await auth_reason(keys, good.secret) == "tenant_disabled"
    with pytest.raises(AuthError) as info:
        await keys.authenticate(good.secret)
    assert good.secret not in str(info.value) and good.secret[10:] not in repr(info.value)


async def test_deleted_tenant_keys_are_gone_and_its_id_retired(keys, tenant, redis_client):
    created = await keys.create_key("acme", KeyCreate())
    registry = TenantRegistry(redis_client)
    await registry.delete_tenant("acme")
    assert await auth_reason(keys, created.secret) == "unknown"
    assert not [k async for k in redis_client.scan_iter(match="strata:k:*")]
    with pytest.raises(ConflictError, match="never reused"):
        await registry.create_tenant(TenantCreate(name="acme", id="acme"))
    assert await auth_reason(keys, created.secret) == "unknown"


async def test_rotation_grace_period(redis_client, tenant):
    keys = KeyManager(redis_client)
    assert await keys.start()
    try:
        old = await keys.create_key("acme", KeyCreate(name="ci"))
        await keys.authenticate(old.secret)  # cached: the deadline must still be enforced
        before = time.time()
        new = await keys.rotate_key(old.key.id, KeyRotate(grace_seconds=0.5))
        after = time.time()
        assert new.secret != old.secret and new.key.id != old.key.id
        assert (new.key.tenant_id, new.key.name) == ("acme", "ci")
        retired = await keys.get_key(old.key.id)
        assert retired.revoked_at is not None
        assert before + 0.5 <= retired.revoked_at <= after + 0.5

        assert (await keys.authenticate(old.secret)).key.id == old.key.id
        assert (await keys.authenticate(new.secret)).key.id == new.key.id
        await asyncio.sleep(max(0.0, retired.revoked_at - time.time()) + 0.02)
        assert await auth_reason(keys, old.secret) == "revoked"
        assert (await keys.authenticate(new.secret)).key.id == new.key.id

        with pytest.raises(ConflictError):
            await keys.rotate_key(old.key.id, KeyRotate())
        newest = await keys.rotate_key(new.key.id, KeyRotate())  # grace 0: revoked at once
        assert await auth_reason(keys, new.secret) == "revoked"
        await keys.authenticate(newest.secret)
    finally:
        await keys.stop()


async def test_unstarted_manager_serves_no_cached_hit(keys, tenant, redis_client):
    created = await keys.create_key("acme", KeyCreate())
    await keys.authenticate(created.secret)
    await _revoke_silently(redis_client, created.key.id)
    assert await auth_reason(keys, created.secret) == "revoked"


# -- the cache and its invalidation --------------------------------------------------------


async def _revoke_silently(redis, key_id: str) -> None:
    """Revoke in the store without publishing (what a lost invalidation looks like)."""
    stored = await keyspace.read_key(redis, key_id)
    key = msgspec.structs.replace(stored.key, revoked_at=time.time())
    await redis.set(
        keyspace.key(key_id), msgspec.json.encode(msgspec.structs.replace(stored, key=key))
    )


def test_auth_cache_refuses_entries_read_before_an_invalidation():
    now = [0.0]
    cache = AuthCache(ttl_s=10.0, monotonic=lambda: now[0])
    tenant = Tenant(id="t", name="t", created_at=0.0, policy=Policy())
    ctx = AuthContext(
        tenant=tenant, key=ApiKey(id="k", tenant_id="t", prefix="p", name="n", created_at=0.0)
    )
    generation = cache.generation
    cache.drop_key("unrelated")  # any invalidation while the store read was in flight
    assert not cache.put("h", ctx, generation)
    assert cache.put("h", ctx, cache.generation) and cache.get("h") == ctx
    now[0] = 10.0
    assert cache.get("h") is None  # past its TTL for normal use...
    assert cache.get("h", max_age_s=60.0) == ctx  # ...but kept for store outages
    now[0] = 61.0
    assert cache.get("h", max_age_s=60.0) is None

    small = AuthCache(max_entries=2)
    for name in ("a", "b", "c"):
        small.put(name, ctx, small.generation)
    assert small.get("a") is None and small.get("c") == ctx
    small.drop_tenant("t")
    assert len(small) == 0


@pytest.fixture
async def replicas(redis_client, store_server):
    """Two gateway replicas: separate clients and caches on one store, both subscribed."""
    other_client = connect(store_server.url)
    a, b = KeyManager(redis_client), KeyManager(other_client)
    assert await a.start() and await b.start()
    yield a, b
    await a.stop()
    await b.stop()
    await other_client.aclose()


async def test_the_cache_is_really_used(replicas, tenant, redis_client):
    """Control for the tests below: without an invalidation, a warm replica keeps accepting."""
    a, b = replicas
    created = await a.create_key("acme", KeyCreate())
    await b.authenticate(created.secret)
    assert len(b.cache) == 1
    await _revoke_silently(redis_client, created.key.id)
    await asyncio.sleep(0.2)
    assert (await b.authenticate(created.secret)).key.id == created.key.id


async def test_revocation_reaches_the_other_replica_within_a_second(replicas, tenant):
    a, b = replicas
    created = await a.create_key("acme", KeyCreate())
    bystander = await a.create_key("acme", KeyCreate())
    for manager in (a, b):
        await manager.authenticate(created.secret)
        await manager.authenticate(bystander.secret)
    assert len(b.cache) == 2
    await a.revoke_key(created.key.id)
    await within(1.0, rejects(b, created.secret, "revoked"))
    assert len(b.cache) == 1  # only the revoked key's entry was dropped
    await b.authenticate(bystander.secret)


async def test_rotation_reaches_the_other_replica(replicas, tenant):
    a, b = replicas
    created = await a.create_key("acme", KeyCreate())
    await b.authenticate(created.secret)
    await a.rotate_key(created.key.id, KeyRotate())
    await within(1.0, rejects(b, created.secret, "revoked"))


async def test_disabling_the_tenant_reaches_the_other_replica(replicas, tenant, redis_client):
    a, b = replicas
    created = await a.create_key("acme", KeyCreate())
    await a.authenticate(created.secret)
    await b.authenticate(created.secret)
    await TenantRegistry(redis_client).update_tenant("acme", TenantUpdate(disabled=True))
    await within(1.0, rejects(b, created.secret, "tenant_disabled"))


async def test_deleting_the_tenant_reaches_the_other_replica(replicas, tenant, redis_client):
    a, b = replicas
    created = await a.create_key("acme", KeyCreate())
    await b.authenticate(created.secret)
    await TenantRegistry(redis_client).delete_tenant("acme")
    await within(1.0, rejects(b, created.secret, "unknown"))


async def test_policy_change_reaches_the_other_replica(replicas, tenant, redis_client):
    a, b = replicas
    created = await a.create_key("acme", KeyCreate())
    assert (await b.authenticate(created.secret)).tenant.policy.rpm == 60
    await TenantRegistry(redis_client).patch_policy("acme", PolicyPatch(rpm=7))

    async def sees_new_policy() -> bool:
        return (await b.authenticate(created.secret)).tenant.policy.rpm == 7

    await within(1.0, sees_new_policy)


async def test_subscriber_survives_a_store_restart(private_store):
    client_a = connect(private_store.url, timeout=0.5)
    client_b = connect(private_store.url, timeout=0.5)
    a, b = KeyManager(client_a), KeyManager(client_b)
    try:
        await TenantRegistry(client_a).create_tenant(TenantCreate(name="acme", id="acme"))
        assert await a.start() and await b.start()
        created = await a.create_key("acme", KeyCreate())
        await b.authenticate(created.secret)
        assert len(b.cache) == 1
        num_before = b.subscriber.num_resubscribes

        private_store.stop()  # a real outage: the subscriber must notice and keep retrying

        async def noticed() -> bool:
            return not b.subscriber.is_live

        await within(5.0, noticed)
        await asyncio.sleep(0.3)
        private_store.start()

        async def resubscribed() -> bool:
            return b.subscriber.num_resubscribes > num_before and b.subscriber.is_live

        await within(15.0, resubscribed)
        assert len(b.cache) == 0  # anything published while it was away is lost: start over
        await a.subscriber.wait_live(15.0)

        await b.authenticate(created.secret)  # warm again, then revoke on the other replica
        assert len(b.cache) == 1
        await a.revoke_key(created.key.id)
        await within(1.0, rejects(b, created.secret, "revoked"))
    finally:
        await a.stop()
        await b.stop()
        await client_a.aclose()
        await client_b.aclose()


async def test_a_silent_subscription_is_detected_by_ping(private_store):
    """A subscription whose server stops answering (CLIENT PAUSE here, a half-open TCP
    connection in production) is dropped and re-made, which also clears the cache."""
    client = connect(private_store.url, timeout=2.0)
    keys = KeyManager(client, ping_interval_s=0.1)
    try:
        assert await keys.start()
        num_before = keys.subscriber.num_resubscribes
        await client.execute_command("CLIENT", "PAUSE", "600", "ALL")

        async def went_down() -> bool:
            return not keys.subscriber.is_live

        await within(2.0, went_down)

        async def came_back() -> bool:
            return keys.subscriber.is_live and keys.subscriber.num_resubscribes > num_before

        await within(5.0, came_back)
    finally:
        await keys.stop()
        await client.aclose()


async def test_outage_keeps_recent_keys_of_fail_open_tenants_only(private_store):
    client = connect(private_store.url, timeout=0.5)
    registry, keys = TenantRegistry(client), KeyManager(client, cache_ttl_s=0.1)
    await keys.start()
    open_t = await registry.create_tenant(
        TenantCreate(name="open", policy=Policy(on_store_unavailable="fail_open"))
    )
    closed_t = await registry.create_tenant(TenantCreate(name="closed"))
    open_key = (await keys.create_key(open_t.id, KeyCreate())).secret
    closed_key = (await keys.create_key(closed_t.id, KeyCreate())).secret
    for secret in (open_key, closed_key):
        await keys.authenticate(secret)  # verified once while the store is up
    await asyncio.sleep(0.2)  # past the normal cache TTL
    private_store.kill()
    assert (await keys.authenticate(open_key)).tenant.id == open_t.id
    with pytest.raises(redis.RedisError):
        await keys.authenticate(closed_key)
    await keys.stop()
    await client.aclose()


async def test_a_key_verified_while_invalidations_are_not_heard_survives_an_outage(
    private_store,
):
    client = connect(private_store.url, timeout=0.5)
    registry = TenantRegistry(client)
    keys = KeyManager(client)  # never subscribed: invalidations are not heard
    tenant = await registry.create_tenant(
        TenantCreate(name="open", policy=Policy(on_store_unavailable="fail_open"))
    )
    secret = (await keys.create_key(tenant.id, KeyCreate())).secret
    assert not keys.subscriber.is_live
    await keys.authenticate(secret)  # from the store: no cache hit is served without them
    private_store.kill()
    assert (await keys.authenticate(secret)).tenant.id == tenant.id  # the fail_open fallback
    await keys.stop()
    await client.aclose()

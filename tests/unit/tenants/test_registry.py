"""TenantRegistry against a real valkey-server: tenants, policies, adapters, prices."""

from __future__ import annotations

import asyncio
import re

import msgspec
import pytest

from tenants.errors import ConflictError, NotFoundError, TenantsError
from tenants.invalidation import CHANNEL, Invalidation
from tenants.records import (
    AdapterCreate,
    Policy,
    PolicyPatch,
    Price,
    RecordError,
    TenantCreate,
    TenantUpdate,
)
from tenants.registry import TenantRegistry
from tenants.store import connect


@pytest.fixture
def registry(redis_client) -> TenantRegistry:
    return TenantRegistry(redis_client)


async def dump_store(redis) -> dict[bytes, object]:
    """Every key in the store with its value (for 'nothing was written' checks)."""
    out: dict[bytes, object] = {}
    async for name in redis.scan_iter():
        kind = (await redis.type(name)).decode()
        if kind == "string":
            out[name] = await redis.get(name)
        elif kind == "hash":
            out[name] = await redis.hgetall(name)
        elif kind == "set":
            out[name] = await redis.smembers(name)
        elif kind == "zset":
            out[name] = await redis.zrange(name, 0, -1, withscores=True)
        else:
            raise AssertionError(f"unexpected type {kind} for {name!r}")
    return out


# -- tenants -------------------------------------------------------------------------------


async def test_create_get_round_trip(registry):
    policy = Policy(rpm=60, allowed_models=["m1"])
    created = await registry.create_tenant(TenantCreate(name="acme", policy=policy))
    assert re.fullmatch(r"t_[0-9a-f]{16}", created.id)
    assert re.fullmatch(r"[0-9a-f]{32}", created.cache_salt)
    assert created.policy == policy and not created.disabled
    assert await registry.get_tenant(created.id) == created

    other = await registry.create_tenant(TenantCreate(name="acme"))
    assert other.id != created.id and other.cache_salt != created.cache_salt


async def test_list_is_sorted_by_creation_time(redis_client):
    times = iter([30.0, 10.0, 20.0])
    registry = TenantRegistry(redis_client, clock=lambda: next(times))
    for tenant_id in ("a", "b", "c"):
        await registry.create_tenant(TenantCreate(name="n", id=tenant_id))
    assert [t.id for t in await registry.list_tenants()] == ["b", "c", "a"]
    assert await TenantRegistry(redis_client).list_tenants() != []


async def test_duplicate_id_conflicts_and_keeps_the_original(registry):
    first = await registry.create_tenant(TenantCreate(name="one", id="acme"))
    with pytest.raises(ConflictError):
        await registry.create_tenant(TenantCreate(name="two", id="acme"))
    assert await registry.get_tenant("acme") == first
    assert len(await registry.list_tenants()) == 1


async def test_ids_with_colons_do_not_collide_with_other_families(registry):
    await registry.create_tenant(TenantCreate(name="x", id="x"))
    await registry.create_tenant(TenantCreate(name="y", id="x:keys"))
    assert {t.id for t in await registry.list_tenants()} == {"x", "x:keys"}


async def test_missing_tenant_is_not_found(registry):
    calls = [
        registry.get_tenant("nope"),
        registry.update_tenant("nope", TenantUpdate(name="n")),
        registry.delete_tenant("nope"),
        registry.get_policy("nope"),
        registry.put_policy("nope", Policy()),
        registry.patch_policy("nope", PolicyPatch(rpm=5)),
    ]
    for call in calls:
        with pytest.raises(NotFoundError) as info:
            await call
        assert info.value.kind == "tenant" and info.value.ident == "nope"
        assert isinstance(info.value, TenantsError)


async def test_update_and_delete(registry):
    tenant = await registry.create_tenant(TenantCreate(name="acme", id="acme"))
    renamed = await registry.update_tenant("acme", TenantUpdate(name="acme-2"))
    assert renamed.name == "acme-2" and not renamed.disabled
    disabled = await registry.update_tenant("acme", TenantUpdate(disabled=True))
    assert disabled.disabled and disabled.name == "acme-2"
    assert disabled.cache_salt == tenant.cache_salt and disabled.created_at == tenant.created_at
    assert await registry.get_tenant("acme") == disabled

    await registry.delete_tenant("acme")
    with pytest.raises(NotFoundError):
        await registry.get_tenant("acme")
    assert await registry.list_tenants() == []
    with pytest.raises(NotFoundError):
        await registry.delete_tenant("acme")


# -- policies ------------------------------------------------------------------------------


async def test_put_and_patch_policy(registry):
    await registry.create_tenant(TenantCreate(name="acme", id="acme", policy=Policy(rpm=10)))
    put = await registry.put_policy("acme", Policy(tpm=1000, weight=2.0))
    assert put == Policy(tpm=1000, weight=2.0)
    assert await registry.get_policy("acme") == put

    patched = await registry.patch_policy("acme", PolicyPatch(rpm=5, allowed_models=["m"]))
    assert patched == Policy(rpm=5, tpm=1000, weight=2.0, allowed_models=["m"])
    cleared = await registry.patch_policy("acme", PolicyPatch(tpm=None))
    assert cleared.tpm is None and cleared.rpm == 5
    assert (await registry.get_tenant("acme")).policy == cleared


@pytest.mark.parametrize(
    "patch",
    [
        PolicyPatch(rpm=0),
        PolicyPatch(weight=0.0),
        PolicyPatch(priority=5000),
        PolicyPatch(allowed_adapters=["bad name"]),
    ],
)
async def test_invalid_patch_writes_nothing(registry, redis_client, patch):
    await registry.create_tenant(TenantCreate(name="acme", id="acme", policy=Policy(rpm=10)))
    before = await dump_store(redis_client)
    with pytest.raises(RecordError):
        await registry.patch_policy("acme", patch)
    assert await dump_store(redis_client) == before


async def test_invalid_put_writes_nothing(registry, redis_client):
    await registry.create_tenant(TenantCreate(name="acme", id="acme", policy=Policy(rpm=10)))
    before = await dump_store(redis_client)
    policy = Policy()
    policy.max_concurrent = -3  # mutation skips __post_init__; put must re-check
    with pytest.raises(RecordError, match="max_concurrent"):
        await registry.put_policy("acme", policy)
    assert await dump_store(redis_client) == before


async def test_concurrent_writers_do_not_lose_updates(registry, store_server):
    """11 patches of different policy fields and 9 renames, all at once from two clients:
    every patch must land (a plain read-modify-write loses most of them)."""
    await registry.create_tenant(TenantCreate(name="acme", id="acme"))
    other_client = connect(store_server.url)
    other = TenantRegistry(other_client)
    patches = [
        PolicyPatch(rpm=11),
        PolicyPatch(tpm=22),
        PolicyPatch(max_concurrent=3),
        PolicyPatch(max_tokens=44),
        PolicyPatch(max_context_tokens=55),
        PolicyPatch(kv_budget_tokens=66),
        PolicyPatch(allowed_models=["m7"]),
        PolicyPatch(allowed_adapters=["a8"]),
        PolicyPatch(priority=-9),
        PolicyPatch(weight=10.5),
        PolicyPatch(on_store_unavailable="fail_open"),
    ]
    names = [f"name-{i}" for i in range(9)]
    try:
        writes = [
            (registry if i % 2 else other).patch_policy("acme", p) for i, p in enumerate(patches)
        ] + [
            (registry if i % 2 else other).update_tenant("acme", TenantUpdate(name=n))
            for i, n in enumerate(names)
        ]
        await asyncio.gather(*writes)
    finally:
        await other_client.aclose()
    tenant = await registry.get_tenant("acme")
    assert tenant.policy == Policy(
        rpm=11,
        tpm=22,
        max_concurrent=3,
        max_tokens=44,
        max_context_tokens=55,
        kv_budget_tokens=66,
        allowed_models=["m7"],
        allowed_adapters=["a8"],
        priority=-9,
        weight=10.5,
        on_store_unavailable="fail_open",
    )
    assert tenant.name in names


async def test_changes_publish_tenant_invalidations(registry, redis_client):
    await registry.create_tenant(TenantCreate(name="acme", id="acme"))
    pubsub = redis_client.pubsub()
    await pubsub.subscribe(CHANNEL)
    assert (await pubsub.get_message(timeout=1.0))["type"] == "subscribe"
    await registry.patch_policy("acme", PolicyPatch(rpm=3))
    await registry.put_policy("acme", Policy())
    await registry.update_tenant("acme", TenantUpdate(disabled=True))
    await registry.delete_tenant("acme")
    seen = []
    for _ in range(4):
        message = await pubsub.get_message(timeout=1.0)
        assert message is not None and message["type"] == "message"
        seen.append(msgspec.json.decode(message["data"], type=Invalidation))
    assert seen == [Invalidation("tenant", "acme")] * 4
    await pubsub.aclose()


# -- adapters ------------------------------------------------------------------------------


async def test_adapter_versions(registry):
    v1 = await registry.register_adapter(AdapterCreate(name="sql", path="/a/1"), "base")
    v2 = await registry.register_adapter(AdapterCreate(name="sql", path="/a/2"), "base")
    assert (v1.version, v2.version) == (1, 2)
    assert v2.path == "/a/2" and v2.base_model == "base"
    assert await registry.get_adapter("sql") == v2
    assert await registry.get_adapter("sql", 1) == v1
    with pytest.raises(NotFoundError):
        await registry.get_adapter("sql", 3)
    with pytest.raises(NotFoundError):
        await registry.get_adapter("nope")

    await registry.delete_adapter("sql")
    with pytest.raises(NotFoundError):
        await registry.get_adapter("sql")
    assert await registry.list_adapters() == []
    with pytest.raises(NotFoundError):
        await registry.delete_adapter("sql")
    again = await registry.register_adapter(AdapterCreate(name="sql", path="/a/3"), "base")
    assert again.version == 3  # versions are never reused (they key the KV cache)


async def test_concurrent_registrations_get_distinct_versions(registry):
    adapters = await asyncio.gather(
        *(registry.register_adapter(AdapterCreate(name="x", path=f"/p{i}"), "b") for i in range(10))
    )
    assert sorted(a.version for a in adapters) == list(range(1, 11))
    latest = await registry.get_adapter("x")
    assert latest.version == 10
    assert latest.path == next(a.path for a in adapters if a.version == 10)


async def test_list_adapters_latest_and_acl(registry):
    await registry.register_adapter(AdapterCreate(name="open", path="/o1"), "base")
    await registry.register_adapter(AdapterCreate(name="open", path="/o2"), "base")
    await registry.register_adapter(
        AdapterCreate(name="private", path="/p1", allowed_tenants=["t1"]), "base"
    )
    # the latest version's ACL decides: v1 was open to everyone, v2 only to t2
    await registry.register_adapter(AdapterCreate(name="moved", path="/m1"), "base")
    await registry.register_adapter(
        AdapterCreate(name="moved", path="/m2", allowed_tenants=["t2"]), "base"
    )

    everything = await registry.list_adapters()
    assert [(a.name, a.version) for a in everything] == [("moved", 2), ("open", 2), ("private", 1)]
    assert [a.name for a in await registry.list_adapters("t1")] == ["open", "private"]
    assert [a.name for a in await registry.list_adapters("t2")] == ["moved", "open"]
    assert [a.name for a in await registry.list_adapters("t3")] == ["open"]


# -- prices --------------------------------------------------------------------------------


async def test_prices_form_a_history_by_effective_time(redis_client):
    now = iter([1000.0, 1001.0, 1002.0, 1003.0, 1004.0])
    registry = TenantRegistry(redis_client, clock=lambda: next(now))
    assert await registry.list_prices() == []
    await registry.put_price(Price(model="zeta", prompt_per_m=1.0))
    await registry.put_price(Price(model="alpha", completion_per_m=2.0))
    await registry.put_price(Price(model="zeta", prompt_per_m=3.0, cached_per_m=0.5))
    # a change scheduled ahead, and one at the same time replacing it
    await registry.put_price(Price(model="zeta", prompt_per_m=4.0, effective_at=5000.0))
    await registry.put_price(Price(model="zeta", prompt_per_m=5.0, effective_at=5000.0))
    assert await registry.list_prices() == [
        Price(model="alpha", completion_per_m=2.0, effective_at=1001.0),
        Price(model="zeta", prompt_per_m=1.0, effective_at=1000.0),
        Price(model="zeta", prompt_per_m=3.0, cached_per_m=0.5, effective_at=1002.0),
        Price(model="zeta", prompt_per_m=5.0, effective_at=5000.0),
    ]
    await registry.delete_price("zeta")
    assert [p.model for p in await registry.list_prices()] == ["alpha"]
    with pytest.raises(NotFoundError):
        await registry.delete_price("zeta")


async def test_a_price_never_takes_effect_in_the_past(redis_client):
    registry = TenantRegistry(redis_client, clock=lambda: 10_000.0)
    with pytest.raises(RecordError, match="effective_at"):
        await registry.put_price(Price(model="m", prompt_per_m=1.0, effective_at=9_000.0))
    # within a minute of now (clock skew) it takes effect now
    price = await registry.put_price(Price(model="m", prompt_per_m=1.0, effective_at=9_990.0))
    assert price.effective_at == 10_000.0

"""The admission scripts' budget and key-scope paths against a real valkey-server: worst-case
holds, settlement into spend, threshold events, key limits and races between replicas."""

import asyncio
import time
from decimal import Decimal

import pytest
import redis.asyncio as aioredis

from policies.admission import (
    BUDGET_EVENTS,
    Admission,
    Charge,
    DenyReason,
    LeaseState,
    key_scope_keys,
)
from policies.budgets import BudgetHold, budget_key, period_at
from tenants.records import Budget, KeyLimits, Policy

TENANT = "acme"
KEY = "key_1"
NOW = time.time()


def hold(limit_usd: str, owner: str = "tenant", **budget) -> BudgetHold:
    return BudgetHold.of(TENANT, owner, Budget(limit_usd=Decimal(limit_usd), **budget), NOW)


async def reserve(adm, rid, *, cost_nanos=0, tenant=None, key=None, limits=None, policy=None):
    return await adm.reserve(
        TENANT,
        policy or Policy(),
        rid,
        prompt_tokens=10,
        max_tokens=0,
        kv_tokens=0,
        key_id=KEY,
        key_limits=limits,
        charge=Charge(cost_nanos=cost_nanos, tenant_budget=tenant, key_budget=key),
    )


async def counters(client, h: BudgetHold) -> tuple[int, int]:
    spent, reserved = await client.hmget(h.key, ["spent", "reserved"])
    return int(spent or 0), int(reserved or 0)


async def test_a_budget_holds_the_worst_case_and_settles_the_real_cost(redis_client):
    adm = Admission(redis_client)
    budget = hold("0.000100")  # 100_000 nano-dollars
    assert (await reserve(adm, "r1", cost_nanos=60_000, tenant=budget)).allowed
    assert await counters(redis_client, budget) == (0, 60_000)
    refused = await reserve(adm, "r2", cost_nanos=50_000, tenant=budget)
    assert (refused.allowed, refused.reason, refused.hard) == (
        False,
        DenyReason.TENANT_BUDGET,
        True,
    )
    assert refused.budget_left_nanos == 40_000
    assert await counters(redis_client, budget) == (0, 60_000)  # a denial changes nothing
    await adm.release(
        TENANT,
        "r1",
        used_tokens=10,
        key_id=KEY,
        cost_nanos=15_000,
        charge=Charge(tenant_budget=budget),
    )
    assert await counters(redis_client, budget) == (15_000, 0)
    assert (await reserve(adm, "r2", cost_nanos=50_000, tenant=budget)).allowed
    # a second release of the same request changes nothing
    await adm.release(
        TENANT,
        "r1",
        used_tokens=10,
        key_id=KEY,
        cost_nanos=15_000,
        charge=Charge(tenant_budget=budget),
    )
    assert await counters(redis_client, budget) == (15_000, 50_000)


async def test_a_key_budget_refuses_within_the_tenants(redis_client):
    adm = Admission(redis_client)
    tenant, key = hold("1"), hold("0.00001", owner=f"key:{KEY}")
    refused = await reserve(adm, "r1", cost_nanos=20_000, tenant=tenant, key=key)
    assert (refused.reason, refused.budget_left_nanos) == (DenyReason.KEY_BUDGET, 10_000)
    assert await counters(redis_client, tenant) == (0, 0)
    assert (await reserve(adm, "r2", cost_nanos=10_000, tenant=tenant, key=key)).allowed
    assert await counters(redis_client, tenant) == (0, 10_000)
    assert await counters(redis_client, key) == (0, 10_000)


async def test_crossing_a_threshold_is_recorded_once(redis_client):
    adm = Admission(redis_client)
    budget = hold("0.0001", thresholds=[50, 80])
    charge = Charge(tenant_budget=budget)
    for i, cost in enumerate([40_000, 20_000, 10_000, 15_000]):  # 40, 60, 70, 85 % spent
        assert (await reserve(adm, f"r{i}", cost_nanos=cost, tenant=budget)).allowed
        await adm.release(
            TENANT, f"r{i}", used_tokens=0, key_id=KEY, cost_nanos=cost, charge=charge
        )
    events = await redis_client.xrange(BUDGET_EVENTS)
    fields = [{k.decode(): v.decode() for k, v in f.items()} for _, f in events]
    assert [(f["threshold_pct"], f["spent_nanos"]) for f in fields] == [
        ("50", "60000"),
        ("80", "85000"),
    ]
    assert all(f["scope"] == "tenant" and f["period"] == budget.label for f in fields)


async def test_an_expired_lease_frees_its_hold_and_still_counts_its_spend(redis_client):
    adm = Admission(redis_client, lease_ttl_s=0.05)
    budget = hold("0.0001")
    assert (await reserve(adm, "r1", cost_nanos=90_000, tenant=budget)).allowed
    await asyncio.sleep(0.1)
    assert (await reserve(adm, "r2", cost_nanos=90_000, tenant=budget)).allowed  # r1 lapsed
    assert await counters(redis_client, budget) == (0, 90_000)
    assert await adm.renew(TENANT, "r1", KEY) is LeaseState.RESTORED  # holds it again
    assert await counters(redis_client, budget) == (0, 180_000)
    await adm.release(
        TENANT,
        "r1",
        used_tokens=0,
        key_id=KEY,
        cost_nanos=5_000,
        charge=Charge(tenant_budget=budget),
    )
    assert await counters(redis_client, budget) == (5_000, 90_000)


async def test_key_limits_apply_on_top_of_the_tenants(redis_client):
    adm = Admission(redis_client)
    limits = KeyLimits(rpm=2, max_concurrent=1)
    assert (await reserve(adm, "r1", limits=limits)).allowed
    busy = await reserve(adm, "r2", limits=limits)
    assert (busy.reason, busy.hard) == (DenyReason.KEY_CONCURRENCY, False)
    await adm.release(TENANT, "r1", used_tokens=10, key_id=KEY)
    assert (await reserve(adm, "r2", limits=limits)).allowed
    await adm.release(TENANT, "r2", used_tokens=10, key_id=KEY)
    assert (await reserve(adm, "r3", limits=limits)).reason is DenyReason.KEY_RPM
    # a hard key tpm: the request can never fit
    big = await reserve(adm, "r4", limits=KeyLimits(tpm=5))
    assert (big.reason, big.hard) == (DenyReason.KEY_TPM, True)
    used = await redis_client.hget(key_scope_keys(TENANT, KEY)["used"], KEY)
    assert abs(int(used) / 1e6 - time.time()) < 60


@pytest.fixture
async def replicas(store_server, redis_client):
    clients = [aioredis.Redis.from_url(store_server.url) for _ in range(2)]
    yield [Admission(c) for c in clients]
    for c in clients:
        await c.aclose()


async def test_concurrent_reservations_on_two_replicas_never_pass_the_budget(
    redis_client, replicas
):
    budget = hold("0.001")  # room for 33 of 30_000
    decisions = await asyncio.gather(
        *(reserve(replicas[i % 2], f"r{i}", cost_nanos=30_000, tenant=budget) for i in range(100))
    )
    assert sum(d.allowed for d in decisions) == 33
    assert await counters(redis_client, budget) == (0, 990_000)


def test_periods_roll_over_by_utc_day_and_month():
    at = 1_798_761_599.0  # 2026-12-31T23:59:59Z
    assert period_at("day", at).label == "d2026-12-31"
    assert period_at("day", at + 1).label == "d2027-01-01"
    assert period_at("month", at).label == "m2026-12"
    assert period_at("month", at + 1).label == "m2027-01"
    assert period_at("month", at).end == at + 1
    assert period_at("none", at).label == "life" and period_at("none", at).end is None
    assert (
        budget_key(TENANT, "tenant", "d2026-12-31") == "strata:rl:{acme}:budget:tenant:d2026-12-31"
    )

"""Budgets as the admin API and the console both change and read them: a tenant's or a
key's budget set (seeded from what the ledger already holds of the current period),
cleared (its counters dropped) and shown with its current period's counters."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from policies.admission import key_scope_keys
from policies.budgets import budget_key, read_usage, seed_spent
from tenants.keys import KeyManager
from tenants.ledger import Ledger
from tenants.records import ApiKey, Budget, nanos_to_usd
from tenants.registry import TenantRegistry

TENANT = "tenant"  # the budget owner of a tenant's own budget


def key_owner(key_id: str) -> str:
    return f"key:{key_id}"


class BudgetStatus(msgspec.Struct, kw_only=True):
    """A budget and its current period's counters (dollars as exact decimal strings).
    `reserved_usd` is the worst-case cost of requests still running."""

    budget: Budget | None
    period: str | None = None
    period_start: float | None = None
    period_end: float | None = None
    spent_usd: str | None = None
    reserved_usd: str | None = None
    remaining_usd: str | None = None


class KeyStatus(msgspec.Struct, kw_only=True):
    """A key, when it last passed admission (unix seconds), and its budget."""

    key: ApiKey
    last_used_at: float | None
    budget: BudgetStatus


async def budget_status(
    store: Any, tenant_id: str, owner: str, budget: Budget | None, now: float | None = None
) -> BudgetStatus:
    """`budget` of `owner` (TENANT or `key_owner(id)`) with its current counters."""
    if budget is None:
        return BudgetStatus(budget=None)
    usage = await read_usage(store, tenant_id, owner, budget, time.time() if now is None else now)
    left = budget.limit_nanos - usage.spent_nanos - usage.reserved_nanos
    return BudgetStatus(
        budget=budget,
        period=usage.period.label,
        period_start=usage.period.start,
        period_end=usage.period.end,
        spent_usd=nanos_to_usd(usage.spent_nanos),
        reserved_usd=nanos_to_usd(usage.reserved_nanos),
        remaining_usd=nanos_to_usd(max(left, 0)),
    )


async def key_status(store: Any, key: ApiKey) -> KeyStatus:
    used = await store.hget(key_scope_keys(key.tenant_id, key.id)["used"], key.id)
    return KeyStatus(
        key=key,
        last_used_at=None if used is None else int(used) / 1e6,
        budget=await budget_status(store, key.tenant_id, key_owner(key.id), key.budget),
    )


async def _ledger_spend(
    ledger: Ledger, tenant_id: str, key_id: str | None, start: float, end: float
) -> int:
    total = 0
    async for rec in ledger.iter_records(tenant_id, start, end):
        if key_id is None or rec.key_id == key_id:
            total += rec.cost_nanos or 0
    return total


async def _seed(
    store: Any, ledger: Ledger, tenant_id: str, key_id: str | None, budget: Budget
) -> None:
    """Count what the ledger holds of the current period when a budget starts counting."""
    owner = TENANT if key_id is None else key_owner(key_id)
    now = time.time()
    usage = await read_usage(store, tenant_id, owner, budget, now)
    spent = await _ledger_spend(ledger, tenant_id, key_id, usage.period.start, now + 1)
    await seed_spent(store, tenant_id, owner, budget, now, spent)


async def _forget(store: Any, tenant_id: str, owner: str, budget: Budget | None) -> None:
    """Drop a cleared budget's current counters: set again, it recounts from the ledger."""
    if budget is not None:
        usage = await read_usage(store, tenant_id, owner, budget, time.time())
        await store.delete(budget_key(tenant_id, owner, usage.period.label))


async def set_tenant_budget(
    registry: TenantRegistry, ledger: Ledger, store: Any, tenant_id: str, budget: Budget
) -> BudgetStatus:
    """Set the tenant's budget; spend already in the ledger for the current period counts
    against it."""
    tenant = await registry.set_budget(tenant_id, budget)
    await _seed(store, ledger, tenant_id, None, budget)
    return await budget_status(store, tenant_id, TENANT, tenant.budget)


async def clear_tenant_budget(registry: TenantRegistry, store: Any, tenant_id: str) -> None:
    old = (await registry.get_tenant(tenant_id)).budget
    await registry.set_budget(tenant_id, None)
    await _forget(store, tenant_id, TENANT, old)


async def set_key_budget(
    keys: KeyManager, ledger: Ledger, store: Any, key_id: str, budget: Budget
) -> BudgetStatus:
    """Set the key's budget, counted as the tenant's is (see set_tenant_budget)."""
    key = await keys.set_key_budget(key_id, budget)
    await _seed(store, ledger, key.tenant_id, key.id, budget)
    return await budget_status(store, key.tenant_id, key_owner(key.id), key.budget)


async def clear_key_budget(keys: KeyManager, store: Any, key_id: str) -> None:
    old = (await keys.get_key(key_id)).budget
    key = await keys.set_key_budget(key_id, None)
    await _forget(store, key.tenant_id, key_owner(key.id), old)

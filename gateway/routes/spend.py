"""Budgets and live spend over REST: the operator sets, reads and clears a tenant's and a
key's budget, updates a key's own limits and metadata, reads spend (grouped by hour or day,
key, model and adapter) and the budget event stream (billing tokens may read budgets and
spend); a tenant reads its own spend and budgets with its API key. Handlers delegate to
gateway/budgets.py and tenants/."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Controller, Request, delete, get, put
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, JSONBody
from redis.exceptions import ResponseError

from gateway import budgets
from gateway.admin_access import BILLING
from gateway.auth import auth_of, requires_admin_token, requires_api_key
from gateway.budgets import TENANT, BudgetStatus, KeyStatus, budget_status, key_owner, key_status
from gateway.errors import bad_request
from gateway.routes import time_window
from policies.admission import BUDGET_EVENTS
from tenants.keys import KeyManager
from tenants.ledger import Ledger
from tenants.records import ApiKey, Budget, KeyLimits, KeyUpdate
from tenants.registry import TenantRegistry
from tenants.residency import ResidencyLedger, residency_rows
from tenants.spend import SpendGrouping, SpendReport, spend_report, with_kv_residency


class BudgetEvent(msgspec.Struct, kw_only=True):
    """A soft threshold crossed by settled spend, from the `strata:events:budget` stream."""

    id: str
    scope: str  # tenant | key
    tenant_id: str
    key_id: str
    period: str
    threshold_pct: int
    limit_nanos: int
    spent_nanos: int
    at: float


async def _report(
    ledger: Ledger,
    residency: ResidencyLedger,
    tenant_id: str,
    start: str | None,
    end: str | None,
    group_by: SpendGrouping,
    key_id: str | None,
) -> SpendReport:
    """The spend report over [start, end), with the tenant's KV residency unless it is
    one key's."""
    begin, stop = time_window(start, end, span_s=30 * 86400)
    records = ledger.iter_records(tenant_id, begin, stop)
    report = await spend_report(records, tenant_id, begin, stop, group_by=group_by, key_id=key_id)
    if key_id is not None:
        return report
    try:
        hours = await residency.hours([tenant_id], begin, stop)
    except ValueError as exc:
        raise bad_request(str(exc), param="start") from exc
    rows = residency_rows(hours, await residency.prices(), 3600)
    return with_kv_residency(report, rows, group_by)


class TenantBudgetController(Controller):
    path = "/admin/tenants/{tenant_id:str}"
    guards = [requires_admin_token]  # noqa: RUF012
    tags = ["admin"]  # noqa: RUF012

    @get("/budget", opt=BILLING)
    async def read_budget(
        self,
        registry: NamedDependency[TenantRegistry],
        store: NamedDependency[Any],
        tenant_id: FromPath[str],
    ) -> BudgetStatus:
        tenant = await registry.get_tenant(tenant_id)
        return await budget_status(store, tenant_id, TENANT, tenant.budget)

    @put("/budget", status_code=200)
    async def set_budget(
        self,
        registry: NamedDependency[TenantRegistry],
        ledger: NamedDependency[Ledger],
        store: NamedDependency[Any],
        tenant_id: FromPath[str],
        data: JSONBody[Budget],
    ) -> BudgetStatus:
        """Set the tenant's budget; spend already in the ledger for the current period
        counts against it."""
        return await budgets.set_tenant_budget(registry, ledger, store, tenant_id, data)

    @delete("/budget")
    async def clear_budget(
        self,
        registry: NamedDependency[TenantRegistry],
        store: NamedDependency[Any],
        tenant_id: FromPath[str],
    ) -> None:
        await budgets.clear_tenant_budget(registry, store, tenant_id)

    @get("/spend", opt=BILLING)
    async def spend(
        self,
        registry: NamedDependency[TenantRegistry],
        ledger: NamedDependency[Ledger],
        residency: NamedDependency[ResidencyLedger],
        tenant_id: FromPath[str],
        start: FromQuery[str | None] = None,
        end: FromQuery[str | None] = None,
        group_by: FromQuery[SpendGrouping] = "day",
        key_id: FromQuery[str | None] = None,
    ) -> SpendReport:
        """The tenant's spend over [start, end) (the last 30 days by default), from the
        costs its ledger records carry."""
        await registry.get_tenant(tenant_id)  # 404 for an unknown tenant
        return await _report(ledger, residency, tenant_id, start, end, group_by, key_id)


class KeyBudgetController(Controller):
    path = "/admin/keys/{key_id:str}"
    guards = [requires_admin_token]  # noqa: RUF012
    tags = ["admin"]  # noqa: RUF012

    @put("/limits", status_code=200)
    async def set_limits(
        self, keys: NamedDependency[KeyManager], key_id: FromPath[str], data: JSONBody[KeyLimits]
    ) -> ApiKey:
        """Replace the key's own limits (enforced within its tenant's)."""
        return await keys.update_key(key_id, KeyUpdate(limits=data))

    @delete("/limits")
    async def clear_limits(self, keys: NamedDependency[KeyManager], key_id: FromPath[str]) -> None:
        await keys.update_key(key_id, KeyUpdate(limits=None))

    @put("/metadata", status_code=200)
    async def set_metadata(
        self,
        keys: NamedDependency[KeyManager],
        key_id: FromPath[str],
        data: JSONBody[dict[str, str]],
    ) -> ApiKey:
        """Replace the key's metadata (free-form string pairs)."""
        return await keys.update_key(key_id, KeyUpdate(metadata=data))

    @get("/status")
    async def status(
        self, keys: NamedDependency[KeyManager], store: NamedDependency[Any], key_id: FromPath[str]
    ) -> KeyStatus:
        key = await keys.get_key(key_id)
        return await key_status(store, key)

    @get("/budget", opt=BILLING)
    async def read_budget(
        self, keys: NamedDependency[KeyManager], store: NamedDependency[Any], key_id: FromPath[str]
    ) -> BudgetStatus:
        key = await keys.get_key(key_id)
        return await budget_status(store, key.tenant_id, key_owner(key.id), key.budget)

    @put("/budget", status_code=200)
    async def set_budget(
        self,
        keys: NamedDependency[KeyManager],
        ledger: NamedDependency[Ledger],
        store: NamedDependency[Any],
        key_id: FromPath[str],
        data: JSONBody[Budget],
    ) -> BudgetStatus:
        return await budgets.set_key_budget(keys, ledger, store, key_id, data)

    @delete("/budget")
    async def clear_budget(
        self, keys: NamedDependency[KeyManager], store: NamedDependency[Any], key_id: FromPath[str]
    ) -> None:
        await budgets.clear_key_budget(keys, store, key_id)


class BudgetEventController(Controller):
    path = "/admin/budget-events"
    guards = [requires_admin_token]  # noqa: RUF012
    tags = ["admin"]  # noqa: RUF012

    @get("/", opt=BILLING)
    async def budget_events(
        self,
        store: NamedDependency[Any],
        after: FromQuery[str] = "0",
        limit: FromQuery[int] = 100,
    ) -> list[BudgetEvent]:
        """Soft-threshold crossings, oldest first, after the stream id `after` (pass the
        last id seen to read on)."""
        if not 1 <= limit <= 1000:
            raise bad_request("limit must be between 1 and 1000", param="limit")
        try:
            entries = await store.xrange(
                BUDGET_EVENTS, min=f"({after}" if after != "0" else "-", count=limit
            )
        except ResponseError:
            raise bad_request(f"after is not a stream id: {after!r}", param="after") from None
        return [_event(entry_id, fields) for entry_id, fields in entries]


def _event(entry_id: bytes, fields: dict[bytes, bytes]) -> BudgetEvent:
    f = {k.decode(): v.decode() for k, v in fields.items()}
    return BudgetEvent(
        id=entry_id.decode(),
        scope=f["scope"],
        tenant_id=f["tenant_id"],
        key_id=f["key_id"],
        period=f["period"],
        threshold_pct=int(f["threshold_pct"]),
        limit_nanos=int(f["limit_nanos"]),
        spent_nanos=int(f["spent_nanos"]),
        at=int(f["at_us"]) / 1e6,
    )


class TenantSpend(msgspec.Struct, kw_only=True):
    """What a tenant sees of its own spend: the report, its budget and its key's."""

    spend: SpendReport
    tenant_budget: BudgetStatus
    key: KeyStatus


class TenantSpendController(Controller):
    path = "/v1/usage"
    guards = [requires_api_key]  # noqa: RUF012
    tags = ["openai"]  # noqa: RUF012

    @get("/spend")
    async def spend(
        self,
        request: Request[Any, Any, Any],
        ledger: NamedDependency[Ledger],
        residency: NamedDependency[ResidencyLedger],
        store: NamedDependency[Any],
        start: FromQuery[str | None] = None,
        end: FromQuery[str | None] = None,
        group_by: FromQuery[SpendGrouping] = "day",
    ) -> TenantSpend:
        """The caller's own tenant's spend (never another's) and budgets."""
        auth = auth_of(request)
        tenant = auth.tenant
        report = await _report(ledger, residency, tenant.id, start, end, group_by, None)
        return TenantSpend(
            spend=report,
            tenant_budget=await budget_status(store, tenant.id, TENANT, tenant.budget),
            key=await key_status(store, auth.key),
        )

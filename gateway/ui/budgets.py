"""Console forms for what a tenant may spend and send, on the tenant's page: its budget
(set, removed) and each key's limits and budget, through the same services the admin API
calls (gateway/budgets.py, KeyManager)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from decimal import Decimal
from typing import Annotated, Any

from litestar import Controller, Request, post
from litestar.di import NamedDependency
from litestar.enums import RequestEncodingType
from litestar.params import Body, FromPath
from litestar.response import Template

from gateway import budgets
from gateway.budgets import TENANT, BudgetStatus, KeyStatus
from gateway.ui import forms
from gateway.ui.render import FORM_ERRORS, page, refusal
from gateway.ui.session import requires_console_session
from tenants.keys import KeyManager
from tenants.ledger import Ledger
from tenants.records import Budget, KeyLimits, KeyUpdate
from tenants.registry import TenantRegistry

FormBody = Annotated[dict[str, Any], Body(media_type=RequestEncodingType.URL_ENCODED)]
KEY_LIMIT_FIELDS = ("rpm", "tpm", "max_concurrent")
KEY_NAME_FIELDS = ("allowed_models", "allowed_adapters")


@dataclass(frozen=True)
class BudgetView:
    """A budget's figures as the page shows them: `used_pct` is spent plus reserved, as a
    percentage of the limit (capped at 100 for the bar)."""

    status: BudgetStatus
    used_pct: float
    thresholds: tuple[tuple[int, str], ...]  # (percent, dollars at that percent)


def budget_view(status: BudgetStatus) -> BudgetView | None:
    budget = status.budget
    if budget is None:
        return None
    used = Decimal(status.spent_usd or "0") + Decimal(status.reserved_usd or "0")
    pct = float(used / budget.limit_usd * 100) if budget.limit_usd else 100.0
    marks = tuple(
        (t, f"{(budget.limit_usd * t / 100).quantize(Decimal('0.01'))}") for t in budget.thresholds
    )
    return BudgetView(status=status, used_pct=min(pct, 100.0), thresholds=marks)


def budget_from_form(form: forms.Form) -> Budget:
    values: dict[str, Any] = {
        "limit_usd": forms.text(form, "limit_usd", required=True),
        "period": forms.text(form, "period") or "month",
    }
    thresholds = forms.whole_numbers(form, "thresholds")
    values["thresholds"] = thresholds if thresholds is not None else []
    return forms.build(Budget, values)


def limits_from_form(form: forms.Form) -> KeyLimits:
    values: dict[str, Any] = {f: forms.limit(form, f) for f in KEY_LIMIT_FIELDS}
    values.update({f: forms.names(form, f) for f in KEY_NAME_FIELDS})
    return forms.build(KeyLimits, values)


async def key_rows(
    keys: KeyManager, store: Any, tenant_id: str
) -> list[tuple[KeyStatus, BudgetView | None]]:
    """The tenant's keys in use, newest first, with when each was last used and its budget."""
    now = time.time()
    rows = []
    for key in reversed(await keys.list_keys(tenant_id)):
        if key.is_active(now):
            row = await budgets.key_status(store, key)
            rows.append((row, budget_view(row.budget)))
    return rows


class BudgetForms(Controller):
    path = "/tenants/{tenant_id:str}"
    guards = [requires_console_session]  # noqa: RUF012

    @post("/budget", opt={"audit_action": "tenants.set_budget"})
    async def set_budget(
        self,
        request: Request[Any, Any, Any],
        registry: NamedDependency[TenantRegistry],
        ledger: NamedDependency[Ledger],
        store: NamedDependency[Any],
        tenant_id: FromPath[str],
        data: FormBody,
    ) -> Template:
        tenant = await registry.get_tenant(tenant_id)
        try:
            budget = budget_from_form(data)
            status = await budgets.set_tenant_budget(registry, ledger, store, tenant_id, budget)
        except FORM_ERRORS as exc:
            status = await budgets.budget_status(store, tenant_id, TENANT, tenant.budget)
            return _budget_card(request, tenant_id, status, 400, error=refusal(exc), form=data)
        return _budget_card(request, tenant_id, status, saved="Budget saved.")

    @post("/budget/remove", opt={"audit_action": "tenants.clear_budget"})
    async def clear_budget(
        self,
        request: Request[Any, Any, Any],
        registry: NamedDependency[TenantRegistry],
        store: NamedDependency[Any],
        tenant_id: FromPath[str],
    ) -> Template:
        await budgets.clear_tenant_budget(registry, store, tenant_id)
        status = BudgetStatus(budget=None)
        return _budget_card(request, tenant_id, status, saved="Budget removed.")

    @post("/keys/{key_id:str}/limits", opt={"audit_action": "keys.set_limits"})
    async def set_key_limits(
        self,
        request: Request[Any, Any, Any],
        keys: NamedDependency[KeyManager],
        store: NamedDependency[Any],
        tenant_id: FromPath[str],
        key_id: FromPath[str],
        data: FormBody,
    ) -> Template:
        try:
            await _owned(keys, tenant_id, key_id)
            await keys.update_key(key_id, KeyUpdate(limits=limits_from_form(data)))
        except FORM_ERRORS as exc:
            return await _key_card(request, keys, store, key_id, 400, error=refusal(exc), form=data)
        return await _key_card(request, keys, store, key_id, saved="Limits saved.")

    @post("/keys/{key_id:str}/budget", opt={"audit_action": "keys.set_budget"})
    async def set_key_budget(
        self,
        request: Request[Any, Any, Any],
        keys: NamedDependency[KeyManager],
        ledger: NamedDependency[Ledger],
        store: NamedDependency[Any],
        tenant_id: FromPath[str],
        key_id: FromPath[str],
        data: FormBody,
    ) -> Template:
        """Set the key's budget; a blank limit removes it."""
        try:
            await _owned(keys, tenant_id, key_id)
            if forms.text(data, "limit_usd") is None:
                await budgets.clear_key_budget(keys, store, key_id)
                saved = "Key budget removed."
            else:
                await budgets.set_key_budget(keys, ledger, store, key_id, budget_from_form(data))
                saved = "Key budget saved."
        except FORM_ERRORS as exc:
            return await _key_card(request, keys, store, key_id, 400, error=refusal(exc), form=data)
        return await _key_card(request, keys, store, key_id, saved=saved)


async def _owned(keys: KeyManager, tenant_id: str, key_id: str) -> None:
    """A key is changed only from its own tenant's page."""
    if (await keys.get_key(key_id)).tenant_id != tenant_id:
        raise forms.FormError(None, f"key {key_id} belongs to another tenant")


def _budget_card(
    request: Request[Any, Any, Any],
    tenant_id: str,
    status: BudgetStatus,
    code: int = 200,
    **context: Any,
) -> Template:
    return page(
        request,
        "_budget.html",
        status=code,
        tenant_id=tenant_id,
        budget=budget_view(status),
        **context,
    )


async def _key_card(
    request: Request[Any, Any, Any],
    keys: KeyManager,
    store: Any,
    key_id: str,
    code: int = 200,
    **context: Any,
) -> Template:
    row = await budgets.key_status(store, await keys.get_key(key_id))
    return page(
        request,
        "_key_budget.html",
        status=code,
        k=row,
        view=budget_view(row.budget),
        **context,
    )

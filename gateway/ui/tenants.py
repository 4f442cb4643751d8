"""Console pages for tenants: the list (search, pagination, create) and one tenant (its
details, enable/disable, its policy form, its budget and its keys' limits and budgets)."""

from __future__ import annotations

from typing import Annotated, Any

from litestar import Controller, Request, Response, get, post
from litestar.di import NamedDependency
from litestar.enums import RequestEncodingType
from litestar.params import Body, FromPath, FromQuery, QueryParameter
from litestar.response import Template

from gateway.audit import note_created
from gateway.budgets import TENANT, budget_status
from gateway.ui import forms
from gateway.ui.budgets import budget_view, key_rows
from gateway.ui.render import FORM_ERRORS, go_to, page, paginate, refusal
from gateway.ui.session import requires_console_session
from tenants.keys import KeyManager
from tenants.records import LIMIT_FIELDS, Policy, Tenant, TenantCreate, TenantUpdate
from tenants.registry import TenantRegistry

FormBody = Annotated[dict[str, Any], Body(media_type=RequestEncodingType.URL_ENCODED)]

# the policy form's fields, as the Policy record names them
CACHE_FIELDS = ("kv_host_tokens", "kv_disk_tokens", "kv_remote_tokens")
NAME_LIST_FIELDS = ("allowed_models", "allowed_adapters")


def matches(tenant: Tenant, query: str) -> bool:
    q = query.casefold()
    return q in tenant.id.casefold() or q in tenant.name.casefold()


def policy_from_form(form: forms.Form) -> Policy:
    values: dict[str, Any] = {f: forms.limit(form, f) for f in (*LIMIT_FIELDS, *CACHE_FIELDS)}
    values.update({f: forms.names(form, f) for f in NAME_LIST_FIELDS})
    values["priority"] = forms.integer(form, "priority", 0)
    values["weight"] = forms.decimal(form, "weight", 1.0)
    values["on_store_unavailable"] = forms.text(form, "on_store_unavailable") or "fail_closed"
    values["shared_cache_namespace"] = forms.text(form, "shared_cache_namespace")
    return forms.build(Policy, values)


class TenantPages(Controller):
    path = "/tenants"
    guards = [requires_console_session]  # noqa: RUF012

    @get("/", opt={"nav": "Tenants", "nav_order": 20})
    async def list_all(
        self,
        request: Request[Any, Any, Any],
        registry: NamedDependency[TenantRegistry],
        q: FromQuery[str] = "",
        page_no: Annotated[int, QueryParameter(name="page")] = 1,
    ) -> Template:
        tenants = await registry.list_tenants()
        shown = [t for t in reversed(tenants) if matches(t, q)] if q else tenants[::-1]
        return page(
            request,
            "tenants.html",
            tenants=paginate(shown, page_no),
            q=q,
            num_tenants=len(tenants),
        )

    @post("/")
    async def create(
        self,
        request: Request[Any, Any, Any],
        registry: NamedDependency[TenantRegistry],
        data: FormBody,
    ) -> Response[Any]:
        try:
            spec = forms.build(
                TenantCreate,
                {"name": forms.text(data, "name", required=True), "id": forms.text(data, "id")},
            )
            tenant = await registry.create_tenant(spec)
        except FORM_ERRORS as exc:
            return page(request, "_tenant_create.html", status=400, error=refusal(exc), form=data)
        note_created(request, tenant.id)
        return go_to(request, f"/ui/tenants/{tenant.id}")

    @get("/{tenant_id:str}")
    async def read(
        self,
        request: Request[Any, Any, Any],
        registry: NamedDependency[TenantRegistry],
        keys: NamedDependency[KeyManager],
        store: NamedDependency[Any],
        tenant_id: FromPath[str],
    ) -> Template:
        tenant = await registry.get_tenant(tenant_id)
        status = await budget_status(store, tenant_id, TENANT, tenant.budget)
        return page(
            request,
            "tenant.html",
            tenant=tenant,
            tenant_id=tenant_id,
            policy=tenant.policy,
            budget=budget_view(status),
            key_rows=await key_rows(keys, store, tenant_id),
        )

    @post("/{tenant_id:str}/policy", opt={"audit_action": "tenants.put_policy"})
    async def save_policy(
        self,
        request: Request[Any, Any, Any],
        registry: NamedDependency[TenantRegistry],
        tenant_id: FromPath[str],
        data: FormBody,
    ) -> Template:
        tenant = await registry.get_tenant(tenant_id)
        try:
            policy = await registry.put_policy(tenant_id, policy_from_form(data))
        except FORM_ERRORS as exc:
            return page(
                request,
                "_policy_form.html",
                status=400,
                tenant=tenant,
                policy=tenant.policy,
                form=data,
                error=refusal(exc),
            )
        return page(request, "_policy_form.html", tenant=tenant, policy=policy, saved=True)

    @post("/{tenant_id:str}/status", opt={"audit_action": "tenants.update"})
    async def set_status(
        self,
        request: Request[Any, Any, Any],
        registry: NamedDependency[TenantRegistry],
        tenant_id: FromPath[str],
        data: FormBody,
    ) -> Response[Any]:
        disabled = data.get("disabled") == "true"
        await registry.update_tenant(tenant_id, TenantUpdate(disabled=disabled))
        return go_to(request, f"/ui/tenants/{tenant_id}")

"""Console page for a tenant's API keys: list, issue (the secret is shown once, in the
response that issued it, and never stored), rotate and revoke."""

from __future__ import annotations

import time
from typing import Annotated, Any

from litestar import Controller, Request, get, post
from litestar.di import NamedDependency
from litestar.enums import RequestEncodingType
from litestar.params import Body, FromPath
from litestar.response import Template

from gateway.audit import note_created
from gateway.ui import forms
from gateway.ui.render import FORM_ERRORS, page, refusal
from gateway.ui.session import requires_console_session
from tenants.keys import KeyManager
from tenants.records import ApiKeyCreated, KeyCreate, KeyRotate
from tenants.registry import TenantRegistry

FormBody = Annotated[dict[str, Any], Body(media_type=RequestEncodingType.URL_ENCODED)]
DAY_S = 86400.0


def key_spec(form: forms.Form) -> KeyCreate:
    days = forms.decimal(form, "expires_in_days", 0.0)
    if days < 0:
        raise forms.FormError("expires_in_days", "expires_in_days must not be negative")
    values = {
        "name": forms.text(form, "name") or "default",
        "expires_in_s": days * DAY_S if days else None,
    }
    return forms.build(KeyCreate, values)


class KeyPages(Controller):
    path = "/tenants/{tenant_id:str}/keys"
    guards = [requires_console_session]  # noqa: RUF012

    async def _keys_section(
        self,
        request: Request[Any, Any, Any],
        keys: KeyManager,
        tenant_id: str,
        *,
        template: str = "_keys.html",
        status: int = 200,
        created: ApiKeyCreated | None = None,
        error: forms.FormError | None = None,
        tenant_name: str | None = None,
    ) -> Template:
        return page(
            request,
            template,
            status=status,
            tenant_id=tenant_id,
            tenant_name=tenant_name,
            keys=await keys.list_keys(tenant_id),
            now=time.time(),
            created=created,
            error=error,
        )

    @get("/")
    async def list_all(
        self,
        request: Request[Any, Any, Any],
        registry: NamedDependency[TenantRegistry],
        keys: NamedDependency[KeyManager],
        tenant_id: FromPath[str],
    ) -> Template:
        tenant = await registry.get_tenant(tenant_id)
        return await self._keys_section(
            request, keys, tenant_id, template="keys.html", tenant_name=tenant.name
        )

    @post("/", opt={"audit_action": "tenants.create_key"})
    async def issue(
        self,
        request: Request[Any, Any, Any],
        keys: NamedDependency[KeyManager],
        tenant_id: FromPath[str],
        data: FormBody,
    ) -> Template:
        try:
            created = await keys.create_key(tenant_id, key_spec(data))
        except FORM_ERRORS as exc:
            return await self._keys_section(
                request, keys, tenant_id, status=400, error=refusal(exc)
            )
        note_created(request, created.key.id)
        return await self._keys_section(request, keys, tenant_id, created=created)

    @post("/{key_id:str}/rotate", opt={"audit_action": "keys.rotate"})
    async def rotate(
        self,
        request: Request[Any, Any, Any],
        keys: NamedDependency[KeyManager],
        tenant_id: FromPath[str],
        key_id: FromPath[str],
        data: FormBody,
    ) -> Template:
        try:
            await self._owned(keys, tenant_id, key_id)
            grace = forms.decimal(data, "grace_seconds", 0.0)
            spec = forms.build(KeyRotate, {"grace_seconds": grace})
            created = await keys.rotate_key(key_id, spec)
        except FORM_ERRORS as exc:
            return await self._keys_section(
                request, keys, tenant_id, status=400, error=refusal(exc)
            )
        note_created(request, created.key.id)
        return await self._keys_section(request, keys, tenant_id, created=created)

    @post("/{key_id:str}/revoke", opt={"audit_action": "keys.revoke"})
    async def revoke(
        self,
        request: Request[Any, Any, Any],
        keys: NamedDependency[KeyManager],
        tenant_id: FromPath[str],
        key_id: FromPath[str],
    ) -> Template:
        try:
            await self._owned(keys, tenant_id, key_id)
            await keys.revoke_key(key_id)
        except FORM_ERRORS as exc:
            return await self._keys_section(
                request, keys, tenant_id, status=400, error=refusal(exc)
            )
        return await self._keys_section(request, keys, tenant_id)

    @staticmethod
    async def _owned(keys: KeyManager, tenant_id: str, key_id: str) -> None:
        """A key is changed only from its own tenant's page."""
        if (await keys.get_key(key_id)).tenant_id != tenant_id:
            raise forms.FormError(None, f"key {key_id} belongs to another tenant")

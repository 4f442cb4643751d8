"""Console pages for what tenants can call: LoRA adapters (list, register, upload) and the served
models with their aliases and prices (list, set a price), and the price of KV cache held
per tier."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import msgspec
from litestar import Controller, Request, get, post
from litestar.datastructures import UploadFile
from litestar.di import NamedDependency
from litestar.enums import RequestEncodingType
from litestar.params import Body, QueryParameter
from litestar.response import Template

from gateway.adapters import (
    MAX_ADAPTER_UPLOAD_BYTES,
    AdapterUpload,
    register_adapter,
    register_upload,
)
from gateway.admin_access import BILLING
from gateway.fleet import Fleet
from gateway.settings import GatewaySettings
from gateway.ui import forms
from gateway.ui.render import FORM_ERRORS, page, paginate, refusal
from gateway.ui.session import requires_console_session
from tenants.records import AdapterCreate, Price
from tenants.registry import TenantRegistry
from tenants.residency import TIERS, KVPrices, ResidencyLedger

FormBody = Annotated[dict[str, Any], Body(media_type=RequestEncodingType.URL_ENCODED)]
PRICE_FIELDS = ("prompt_per_m", "cached_per_m", "completion_per_m")


@dataclass(frozen=True)
class ModelRow:
    model_id: str
    aliases: tuple[str, ...]
    num_workers: int
    max_model_len: int
    dtype: str
    kv_cache_dtype: str
    device: str


def model_rows(fleet: Fleet) -> list[ModelRow]:
    return [
        ModelRow(
            model_id=model_id,
            aliases=fleet.aliases_of(model_id),
            num_workers=len(group.workers),
            max_model_len=group.info.max_model_len,
            dtype=group.info.dtype,
            kv_cache_dtype=group.info.kv_cache_dtype or group.info.dtype,
            device=group.info.device,
        )
        for model_id, group in sorted(fleet.groups.items())
    ]


class AdapterPages(Controller):
    path = "/adapters"
    guards = [requires_console_session]  # noqa: RUF012

    async def _render(
        self,
        request: Request[Any, Any, Any],
        registry: TenantRegistry,
        fleet: Fleet,
        template: str,
        page_no: int = 1,
        **context: Any,
    ) -> Template:
        adapters = await registry.list_adapters()
        return page(
            request,
            template,
            adapters=paginate(adapters, page_no),
            models=sorted(fleet.groups),
            **context,
        )

    @get("/", opt={"nav": "Adapters", "nav_order": 30})
    async def list_all(
        self,
        request: Request[Any, Any, Any],
        registry: NamedDependency[TenantRegistry],
        fleet: NamedDependency[Fleet],
        page_no: Annotated[int, QueryParameter(name="page")] = 1,
    ) -> Template:
        return await self._render(request, registry, fleet, "adapters.html", page_no)

    @post("/")
    async def register(
        self,
        request: Request[Any, Any, Any],
        registry: NamedDependency[TenantRegistry],
        fleet: NamedDependency[Fleet],
        data: FormBody,
    ) -> Template:
        try:
            values = {
                "name": forms.text(data, "name", required=True),
                "path": forms.text(data, "path", required=True),
                "base_model": forms.text(data, "base_model"),
                "allowed_tenants": forms.names(data, "allowed_tenants"),
            }
            adapter = await register_adapter(forms.build(AdapterCreate, values), registry, fleet)
        except FORM_ERRORS as exc:
            return await self._render(
                request,
                registry,
                fleet,
                "_adapters.html",
                status=400,
                error=refusal(exc),
                form=data,
            )
        return await self._render(request, registry, fleet, "_adapters.html", registered=adapter)

    @post("/upload", request_max_body_size=MAX_ADAPTER_UPLOAD_BYTES)
    async def upload(
        self,
        request: Request[Any, Any, Any],
        registry: NamedDependency[TenantRegistry],
        fleet: NamedDependency[Fleet],
        settings: NamedDependency[GatewaySettings],
        data: Annotated[dict[str, Any], Body(media_type=RequestEncodingType.MULTI_PART)],
    ) -> Template:
        """Register an adapter from its two PEFT files, as `POST /admin/adapters/upload`."""
        try:
            allowed = forms.names(data, "allowed_tenants")
            upload = AdapterUpload(
                name=forms.text(data, "name", required=True) or "",
                adapter_config=_file(data, "adapter_config"),
                adapter_model=_file(data, "adapter_model"),
                allowed_tenants=None if allowed is None else msgspec.json.encode(allowed).decode(),
                base_model=forms.text(data, "base_model"),
            )
            root = Path(settings.data_dir) / "adapters"
            adapter = await register_upload(upload, registry, fleet, root)
        except FORM_ERRORS as exc:
            fields = {k: v for k, v in data.items() if isinstance(v, str)}
            return await self._render(
                request,
                registry,
                fleet,
                "_adapters.html",
                status=400,
                error=refusal(exc),
                form=fields,
                uploading=True,
            )
        return await self._render(request, registry, fleet, "_adapters.html", registered=adapter)


def _file(data: dict[str, Any], name: str) -> UploadFile:
    value = data.get(name)
    if not isinstance(value, UploadFile) or not value.filename:
        raise forms.FormError(name, "choose the file")
    return value


class ModelPages(Controller):
    path = "/models"
    guards = [requires_console_session]  # noqa: RUF012

    async def _render(
        self,
        request: Request[Any, Any, Any],
        registry: TenantRegistry,
        fleet: Fleet,
        residency: ResidencyLedger,
        template: str,
        **context: Any,
    ) -> Template:
        adapters = await registry.list_adapters()
        context.setdefault("kv_prices", await residency.prices())
        return page(
            request,
            template,
            tiers=TIERS,
            models=model_rows(fleet),
            prices=await registry.list_prices(),
            priceable=sorted({*fleet.groups, *fleet.all_aliases(), *(a.name for a in adapters)}),
            **context,
        )

    @get("/", opt={"nav": "Models & prices", "nav_order": 40, **BILLING})
    async def list_all(
        self,
        request: Request[Any, Any, Any],
        registry: NamedDependency[TenantRegistry],
        fleet: NamedDependency[Fleet],
        residency: NamedDependency[ResidencyLedger],
    ) -> Template:
        return await self._render(request, registry, fleet, residency, "models.html")

    @post("/prices", opt={"audit_action": "prices.put_price"})
    async def set_price(
        self,
        request: Request[Any, Any, Any],
        registry: NamedDependency[TenantRegistry],
        fleet: NamedDependency[Fleet],
        residency: NamedDependency[ResidencyLedger],
        data: FormBody,
    ) -> Template:
        try:
            values: dict[str, Any] = {"model": forms.text(data, "model", required=True)}
            values.update({f: forms.decimal(data, f, 0.0) for f in PRICE_FIELDS})
            price = await registry.put_price(forms.build(Price, values))
        except FORM_ERRORS as exc:
            return await self._render(
                request,
                registry,
                fleet,
                residency,
                "_prices.html",
                status=400,
                error=refusal(exc),
                form=data,
            )
        return await self._render(request, registry, fleet, residency, "_prices.html", saved=price)

    @post("/kv-prices", opt={"audit_action": "kv-prices.replace"})
    async def set_kv_prices(
        self,
        request: Request[Any, Any, Any],
        residency: NamedDependency[ResidencyLedger],
        data: FormBody,
    ) -> Template:
        """Set every tier's price at once; a blank tier is not billed."""
        try:
            prices = forms.build(KVPrices, {t: forms.amount(data, t) for t in TIERS})
            await residency.set_prices(prices)
        except FORM_ERRORS as exc:
            current = await residency.prices()
            return page(
                request,
                "_kv_prices.html",
                status=400,
                tiers=TIERS,
                kv_prices=current,
                error=refusal(exc),
                form=data,
            )
        return page(request, "_kv_prices.html", tiers=TIERS, kv_prices=prices, saved=True)

"""The operator's REST API for KV residency billing: prices per GiB-hour of each tier, and
each tenant's KV held per tier over time with its cost."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, Literal

from litestar import Controller, Response, get, put
from litestar.di import NamedDependency
from litestar.params import FromQuery, JSONBody
from litestar.response import Stream

from gateway.admin_access import BILLING
from gateway.auth import requires_admin_token
from gateway.errors import bad_request
from gateway.routes import time_window
from tenants.export import ExportFormat, encode_rows, media_type
from tenants.registry import TenantRegistry
from tenants.residency import KVPrices, ResidencyLedger, residency_rows

COLUMNS = (
    "period_start",
    "tenant_id",
    "tier",
    "gib_hours",
    "price_per_gib_hour",
    "cost",
    "priced",
)
_PERIOD_S = {"hour": 3600, "day": 86400}
_DEFAULT_SPAN_S = 31 * 86400


class KVPriceController(Controller):
    path = "/admin/kv-prices"
    guards = [requires_admin_token]  # noqa: RUF012
    tags = ["admin"]  # noqa: RUF012

    @get("/", opt=BILLING)
    async def show(self, residency: NamedDependency[ResidencyLedger]) -> KVPrices:
        """USD per GiB-hour of KV held in each tier; a tier without a price is not billed."""
        return await residency.prices()

    @put("/", status_code=200)
    async def replace(
        self, residency: NamedDependency[ResidencyLedger], data: JSONBody[dict[str, Any]]
    ) -> KVPrices:
        """Set every tier's price at once (a tier left out is not billed)."""
        return await residency.set_prices(_prices(data))


class KVResidencyController(Controller):
    path = "/admin/kv-residency"
    guards = [requires_admin_token]  # noqa: RUF012
    tags = ["admin"]  # noqa: RUF012

    @get("/", opt=BILLING)
    async def export(
        self,
        registry: NamedDependency[TenantRegistry],
        residency: NamedDependency[ResidencyLedger],
        tenant: FromQuery[str | None] = None,
        start: FromQuery[str | None] = None,
        end: FromQuery[str | None] = None,
        format: FromQuery[ExportFormat] = "json",
        granularity: FromQuery[Literal["hour", "day"]] = "day",
    ) -> Response[Any]:
        """KV held per (period, tenant, tier) over [start, end) (default: the last 31
        days), in GiB-hours, priced at today's KV prices."""
        begin, stop = time_window(start, end, span_s=_DEFAULT_SPAN_S)
        if tenant is not None:
            tenant_ids = [(await registry.get_tenant(tenant)).id]  # 404 for an unknown one
        else:
            tenant_ids = [t.id for t in await registry.list_tenants()]
        try:
            hours = await residency.hours(tenant_ids, begin, stop)
        except ValueError as exc:
            raise bad_request(str(exc), param="start") from exc
        rows = residency_rows(hours, await residency.prices(), _PERIOD_S[granularity])
        body = encode_rows(_cells(rows), COLUMNS, format)
        filename = f"kv-residency-{tenant or 'all'}.{format}"
        return Stream(
            body,
            media_type=media_type(format),
            headers={"content-disposition": f'attachment; filename="{filename}"'},
        )


def _prices(data: dict[str, Any]) -> KVPrices:
    fields: dict[str, float | None] = {}
    for name, value in data.items():
        if name not in KVPrices.__struct_fields__:
            raise bad_request(f"unknown tier {name!r}", param=name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise bad_request(f"{name}: a price is a number of USD per GiB-hour", param=name)
        fields[name] = None if value is None else float(value)
    try:
        return KVPrices(**fields)
    except ValueError as exc:
        raise bad_request(str(exc), param=str(exc).split(":")[0]) from exc


async def _cells(rows: Sequence[Any]) -> AsyncIterator[Sequence[object]]:
    for row in rows:
        yield (
            datetime.fromtimestamp(row.period_start, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            row.tenant_id,
            row.tier,
            row.gib_hours.quantize(Decimal("1e-15")),
            row.rate,
            row.cost,
            row.rate is not None,
        )

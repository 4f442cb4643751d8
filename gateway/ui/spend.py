"""Console page for spend over time: one tenant's (or every tenant's) cost per hour or day
from the ledger's spend report, and its KV residency cost per tier at today's KV prices,
drawn with the vendored chart library over a table of the rows."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import msgspec
from litestar import Controller, Request, get
from litestar.di import NamedDependency
from litestar.params import FromQuery
from litestar.response import Template

from gateway.admin_access import BILLING
from gateway.ui.render import page
from gateway.ui.session import requires_console_session
from gateway.ui.usage import WINDOWS, Period, buckets
from tenants.ledger import Ledger
from tenants.registry import TenantRegistry
from tenants.residency import TIERS, ResidencyLedger, ResidencyRow, residency_rows
from tenants.spend import SpendReport, spend_report


@dataclass
class SpendSeries:
    """Dollars per bucket, oldest first: the requests' cost and, per tier, the KV held."""

    starts: list[int]
    requests_usd: list[Decimal] = field(default_factory=list)
    kv_usd: dict[str, list[Decimal]] = field(default_factory=dict)

    @property
    def requests_total(self) -> Decimal:
        return sum(self.requests_usd, Decimal(0))

    @property
    def kv_total(self) -> Decimal:
        return sum((sum(v, Decimal(0)) for v in self.kv_usd.values()), Decimal(0))

    @property
    def kv_total_usd(self) -> str:
        return usd_text(self.kv_total)

    @property
    def num_points(self) -> int:
        """Buckets that cost anything."""
        kv = [sum(v) for v in zip(*self.kv_usd.values(), strict=True)] or [0] * len(self.starts)
        return sum(1 for r, k in zip(self.requests_usd, kv, strict=True) if r or k)

    def chart_json(self) -> str:
        return msgspec.json.encode(
            {
                "x": self.starts,
                "requests": [float(v) for v in self.requests_usd],
                "kv": {tier: [float(v) for v in values] for tier, values in self.kv_usd.items()},
            }
        ).decode()


def usd_text(value: Decimal) -> str:
    """Dollars with at least two decimals and no trailing zeros past them: 0.04, 0.000125."""
    whole, _, frac = f"{value:f}".partition(".")
    return f"{whole}.{frac.rstrip('0').ljust(2, '0')}"


def _iso_start(at: int) -> str:
    return datetime.fromtimestamp(at, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def spend_series(
    report: SpendReport, kv_rows: Sequence[ResidencyRow], starts: list[int]
) -> SpendSeries:
    """Sum `report`'s rows (grouped by the same period as `starts`) and `kv_rows` into the
    buckets beginning at `starts`; a row outside them is left out."""
    index = {_iso_start(at): i for i, at in enumerate(starts)}
    by_start = {at: i for i, at in enumerate(starts)}
    series = SpendSeries(starts=starts, requests_usd=[Decimal(0)] * len(starts))
    for row in report.rows:
        i = index.get(row.period_start or "")
        if i is not None:
            series.requests_usd[i] += Decimal(row.cost_usd)
    for kv in kv_rows:
        j = by_start.get(kv.period_start)
        if j is not None and kv.rate is not None:
            values = series.kv_usd.setdefault(kv.tier, [Decimal(0)] * len(starts))
            values[j] += kv.cost
    series.kv_usd = {t: series.kv_usd[t] for t in TIERS if t in series.kv_usd}
    return series


class SpendPages(Controller):
    path = "/spend"
    guards = [requires_console_session]  # noqa: RUF012

    @get("/", opt={"nav": "Spend", "nav_order": 65, **BILLING})
    async def chart(
        self,
        request: Request[Any, Any, Any],
        registry: NamedDependency[TenantRegistry],
        ledger: NamedDependency[Ledger],
        residency: NamedDependency[ResidencyLedger],
        tenant: FromQuery[str | None] = None,
        by: FromQuery[Period] = "day",
    ) -> Template:
        tenants = await registry.list_tenants()
        tenant_id = tenant or None
        if tenant_id is not None:
            await registry.get_tenant(tenant_id)  # 404 for an unknown tenant
        starts, end = buckets(by, time.time())
        period_s = WINDOWS[by][0]
        records = ledger.iter_records(tenant_id, starts[0], end)
        report = await spend_report(records, tenant_id or "*", starts[0], end, group_by=by)
        tenant_ids = [tenant_id] if tenant_id is not None else [t.id for t in tenants]
        hours = await residency.hours(tenant_ids, starts[0], end)
        prices = await residency.prices()
        kv_rows = residency_rows(hours, prices, period_s)
        return page(
            request,
            "spend.html",
            series=spend_series(report, kv_rows, starts),
            report=report,
            kv_rows=kv_rows[::-1],
            prices=prices,
            tenants=tenants,
            tenant_id=tenant_id,
            by=by,
        )

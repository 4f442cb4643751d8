"""Live spend: the costs usage records carry, summed per UTC hour or day and per key, model
and adapter, and beside them what the tenant's KV residency costs. Spend is read from the
ledger itself, so it always equals the ledger's sum."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from decimal import Decimal
from typing import Literal

import msgspec

from tenants.export import format_decimal
from tenants.records import UsageRecord, nanos_to_usd
from tenants.residency import ResidencyRow

SpendGrouping = Literal["hour", "day", "total"]
_SECONDS = {"hour": 3600, "day": 86400}


class SpendRow(msgspec.Struct, kw_only=True):
    """One (period, key, model, adapter) sum. `unpriced_requests` carried no cost."""

    period_start: str | None  # ISO 8601 UTC; None when not grouped by time
    key_id: str
    model: str
    adapter: str | None
    requests: int
    unpriced_requests: int
    cost_nanos: int
    cost_usd: str


class KVSpendRow(msgspec.Struct, kw_only=True):
    """KV cache the tenant held in one tier over one period, at today's KV prices."""

    period_start: str | None  # ISO 8601 UTC; None when not grouped by time
    tier: str
    gib_hours: str
    cost_usd: str  # 0 for a tier without a price


class SpendReport(msgspec.Struct, kw_only=True):
    """Requests' costs as billed (`cost_usd`, what budgets count) and, apart, the KV the
    tenant kept in the tiers (`kv_cost_usd`; not for one key's report)."""

    tenant_id: str
    start: float
    end: float
    group_by: SpendGrouping
    requests: int
    cost_nanos: int
    cost_usd: str
    rows: list[SpendRow]
    kv_cost_usd: str = "0"
    kv_rows: list[KVSpendRow] = msgspec.field(default_factory=list)


def _period_start(at: float, group_by: SpendGrouping) -> str | None:
    if group_by == "total":
        return None
    seconds = _SECONDS[group_by]
    start = int(at // seconds) * seconds
    return datetime.fromtimestamp(start, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def spend_report(
    records: AsyncIterator[UsageRecord],
    tenant_id: str,
    start: float,
    end: float,
    *,
    group_by: SpendGrouping = "day",
    key_id: str | None = None,
) -> SpendReport:
    """Sum `records` (one tenant's, over [start, end)); with `key_id`, that key's only.
    Rows are ordered by period, key, model, adapter."""
    sums: dict[tuple[str | None, str, str, str | None], list[int]] = {}
    async for rec in records:
        if key_id is not None and rec.key_id != key_id:
            continue
        group = (_period_start(rec.finished_at, group_by), rec.key_id, rec.model, rec.adapter)
        acc = sums.setdefault(group, [0, 0, 0])
        acc[0] += 1
        cost = rec.cost_nanos
        if cost is None:
            acc[1] += 1
        else:
            acc[2] += cost
    rows = [
        SpendRow(
            period_start=period,
            key_id=key,
            model=model,
            adapter=adapter,
            requests=acc[0],
            unpriced_requests=acc[1],
            cost_nanos=acc[2],
            cost_usd=nanos_to_usd(acc[2]),
        )
        for (period, key, model, adapter), acc in sorted(
            sums.items(), key=lambda kv: tuple("" if v is None else v for v in kv[0])
        )
    ]
    total = sum(r.cost_nanos for r in rows)
    return SpendReport(
        tenant_id=tenant_id,
        start=start,
        end=end,
        group_by=group_by,
        requests=sum(r.requests for r in rows),
        cost_nanos=total,
        cost_usd=nanos_to_usd(total),
        rows=rows,
    )


def with_kv_residency(
    report: SpendReport, rows: Sequence[ResidencyRow], group_by: SpendGrouping
) -> SpendReport:
    """`report` with the tenant's KV residency rows (hourly or daily, as priced by
    `residency_rows`) summed by its grouping."""
    sums: dict[tuple[str | None, str], list[Decimal]] = {}
    for row in rows:
        period = _period_start(row.period_start, group_by)
        acc = sums.setdefault((period, row.tier), [Decimal(0), Decimal(0)])
        acc[0] += row.gib_hours
        acc[1] += row.cost
    kv_rows = [
        KVSpendRow(
            period_start=period,
            tier=tier,
            gib_hours=format_decimal(acc[0].quantize(Decimal("1e-12"))),
            cost_usd=format_decimal(acc[1]),
        )
        for (period, tier), acc in sums.items()
    ]
    total = sum((acc[1] for acc in sums.values()), Decimal(0))
    return msgspec.structs.replace(report, kv_rows=kv_rows, kv_cost_usd=format_decimal(total))

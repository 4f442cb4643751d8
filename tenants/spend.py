"""Live spend: the costs usage records carry, summed per UTC hour or day and per key, model
and adapter. Spend is read from the ledger itself, so it always equals the ledger's sum."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Literal

import msgspec

from tenants.records import UsageRecord, nanos_to_usd

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


class SpendReport(msgspec.Struct, kw_only=True):
    tenant_id: str
    start: float
    end: float
    group_by: SpendGrouping
    requests: int
    cost_nanos: int
    cost_usd: str
    rows: list[SpendRow]


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

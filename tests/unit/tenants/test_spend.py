"""Spend reports: the costs records carry, summed per period, key, model and adapter."""

from tenants.records import UsageRecord
from tenants.spend import spend_report

DAY = 86_400.0
T0 = 1_795_737_600.0  # 2026-11-27T00:00:00Z


async def records(*recs):
    for rec in recs:
        yield rec


def rec(rid, at, key="k1", model="m", adapter=None, cost=None):
    return UsageRecord(
        request_id=rid,
        tenant_id="t",
        key_id=key,
        model=model,
        adapter=adapter,
        finished_at=at,
        cost_prompt_nanos=cost,
    )


async def test_rows_sum_recorded_costs_and_count_the_unpriced():
    recs = [
        rec("a", T0 + 10, cost=100),
        rec("b", T0 + 20, cost=250),
        rec("c", T0 + 30, adapter="lora", cost=5),
        rec("d", T0 + DAY + 1, key="k2", cost=None),
        rec("e", T0 + DAY + 2, key="k2", cost=7),
    ]
    report = await spend_report(records(*recs), "t", T0, T0 + 2 * DAY, group_by="day")
    assert [
        (r.period_start, r.key_id, r.adapter, r.requests, r.unpriced_requests, r.cost_nanos)
        for r in report.rows
    ] == [
        ("2026-11-27T00:00:00Z", "k1", None, 2, 0, 350),
        ("2026-11-27T00:00:00Z", "k1", "lora", 1, 0, 5),
        ("2026-11-28T00:00:00Z", "k2", None, 2, 1, 7),
    ]
    assert (report.requests, report.cost_nanos, report.cost_usd) == (5, 362, "0.000000362")
    only_k2 = await spend_report(
        records(*recs), "t", T0, T0 + 2 * DAY, group_by="total", key_id="k2"
    )
    assert [(r.period_start, r.requests, r.cost_nanos) for r in only_k2.rows] == [(None, 2, 7)]


async def test_kv_residency_is_summed_by_the_reports_grouping():
    from decimal import Decimal

    from tenants.residency import GIB_HOUR, ResidencyRow
    from tenants.spend import with_kv_residency

    gib_hour = float(GIB_HOUR)
    hourly = [
        ResidencyRow(int(T0), "t", "device", 2 * gib_hour, Decimal("0.5")),
        ResidencyRow(int(T0 + 3600), "t", "device", gib_hour, Decimal("0.5")),
        ResidencyRow(int(T0 + 3600), "t", "host", 4 * gib_hour, None),
    ]
    report = await spend_report(records(rec("a", T0 + 10, cost=100)), "t", T0, T0 + DAY)
    by_day = with_kv_residency(report, hourly, "day")
    assert [(r.period_start, r.tier, r.gib_hours, r.cost_usd) for r in by_day.kv_rows] == [
        ("2026-11-27T00:00:00Z", "device", "3", "1.5"),
        ("2026-11-27T00:00:00Z", "host", "4", "0"),  # no price: held, not billed
    ]
    assert by_day.kv_cost_usd == "1.5" and by_day.cost_usd == report.cost_usd
    by_hour = with_kv_residency(report, hourly, "hour")
    assert [r.cost_usd for r in by_hour.kv_rows] == ["1", "0.5", "0"]

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

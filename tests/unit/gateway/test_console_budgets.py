"""The console's budget and spend helpers: reading budget and key-limit forms, a budget's
figures as the page shows them, and spend and KV residency summed into chart buckets."""

from __future__ import annotations

from decimal import Decimal

import pytest

from gateway.budgets import BudgetStatus
from gateway.ui import forms
from gateway.ui.budgets import budget_from_form, budget_view, limits_from_form
from gateway.ui.forms import FormError
from gateway.ui.spend import spend_series, usd_text
from tenants.records import Budget
from tenants.residency import GIB_HOUR, KVPrices, residency_rows
from tenants.spend import SpendReport, SpendRow

DAY = 86400


def test_budget_form_reads_limit_period_and_thresholds() -> None:
    budget = budget_from_form({"limit_usd": " 12.5 ", "period": "day", "thresholds": "90, 50%"})
    assert budget == Budget(limit_usd=Decimal("12.5"), period="day", thresholds=[50, 90])
    assert budget_from_form({"limit_usd": "3"}).period == "month"
    assert budget_from_form({"limit_usd": "3", "thresholds": ""}).thresholds == []


@pytest.mark.parametrize(
    ("form", "field"),
    [
        ({"limit_usd": ""}, "limit_usd"),
        ({"limit_usd": "ten"}, "limit_usd"),
        ({"limit_usd": "-1"}, "limit_usd"),
        ({"limit_usd": "0.0000000001"}, "limit_usd"),
        ({"limit_usd": "5", "period": "week"}, "period"),
        ({"limit_usd": "5", "thresholds": "half"}, "thresholds"),
        ({"limit_usd": "5", "thresholds": "0"}, "thresholds"),
    ],
)
def test_a_refused_budget_value_names_its_field(form: dict[str, str], field: str) -> None:
    with pytest.raises(FormError) as refused:
        budget_from_form(form)
    assert refused.value.field == field
    assert field in refused.value.message


def test_key_limits_form_reads_blanks_as_the_tenants() -> None:
    limits = limits_from_form({"rpm": "1", "tpm": "", "allowed_models": "a, b"})
    assert (limits.rpm, limits.tpm, limits.max_concurrent) == (1, None, None)
    assert (limits.allowed_models, limits.allowed_adapters) == (["a", "b"], None)


@pytest.mark.parametrize(
    ("form", "field"),
    [
        ({"rpm": "0"}, "rpm"),
        ({"tpm": "x"}, "tpm"),
        ({"allowed_adapters": "bad name"}, "allowed_adapters"),
    ],
)
def test_a_refused_key_limit_names_its_field(form: dict[str, str], field: str) -> None:
    with pytest.raises(FormError) as refused:
        limits_from_form(form)
    assert refused.value.field == field
    assert field in refused.value.message


def test_an_amount_is_blank_or_not_negative() -> None:
    assert forms.amount({"host": ""}, "host") is None
    assert forms.amount({"host": "0.25"}, "host") == 0.25
    with pytest.raises(FormError, match="host must not be negative"):
        forms.amount({"host": "-1"}, "host")


def test_budget_view_counts_reserved_spend_and_caps_the_bar() -> None:
    budget = Budget(limit_usd=Decimal("10"), thresholds=[50, 80])
    status = BudgetStatus(budget=budget, spent_usd="2.50", reserved_usd="0.50")
    view = budget_view(status)
    assert view is not None
    assert view.used_pct == pytest.approx(30.0)
    assert view.thresholds == ((50, "5.00"), (80, "8.00"))
    over = budget_view(BudgetStatus(budget=budget, spent_usd="12", reserved_usd="0"))
    assert over is not None and over.used_pct == 100.0
    assert budget_view(BudgetStatus(budget=None)) is None


def _row(period_start: str | None, cost_nanos: int) -> SpendRow:
    return SpendRow(
        period_start=period_start,
        key_id="key_a",
        model="m",
        adapter=None,
        requests=1,
        unpriced_requests=0,
        cost_nanos=cost_nanos,
        cost_usd=f"{Decimal(cost_nanos) / 10**9}",
    )


def test_spend_series_puts_request_and_kv_cost_in_their_buckets() -> None:
    starts = [10 * DAY, 11 * DAY, 12 * DAY]
    report = SpendReport(
        tenant_id="t",
        start=starts[0],
        end=13 * DAY,
        group_by="day",
        requests=4,
        cost_nanos=0,
        cost_usd="0",
        rows=[
            _row("1970-01-11T00:00:00Z", 40_000_000),
            _row("1970-01-11T00:00:00Z", 2_000_000),
            _row("1970-01-13T00:00:00Z", 1_000_000_000),
            _row("1970-01-01T00:00:00Z", 5),  # before the window: left out
        ],
    )
    gib_hour = float(GIB_HOUR)
    hours = [
        (12 * DAY, "t", {"host": 2 * gib_hour, "device": gib_hour}),
        (12 * DAY + 3600, "t", {"host": gib_hour}),
        (10 * DAY, "t", {"disk": gib_hour}),  # not priced: not drawn
    ]
    kv_rows = residency_rows(hours, KVPrices(device=0.5, host=0.25), DAY)
    series = spend_series(report, kv_rows, starts)
    assert series.requests_usd == [Decimal("0.042"), Decimal(0), Decimal("1")]
    assert list(series.kv_usd) == ["device", "host"]
    assert series.kv_usd["host"] == [Decimal(0), Decimal(0), Decimal("0.75")]
    assert series.kv_total == Decimal("1.25")
    assert series.num_points == 2
    assert '"kv":{"device":[0.0,0.0,0.5]' in series.chart_json()


def test_dollars_read_with_two_decimals_at_least() -> None:
    assert [usd_text(Decimal(v)) for v in ("0", "0.040000", "0.000125", "12.5")] == [
        "0.00",
        "0.04",
        "0.000125",
        "12.50",
    ]

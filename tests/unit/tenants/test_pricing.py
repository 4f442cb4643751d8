"""Costs in nano-dollars, price histories and budget records."""

from decimal import Decimal

import msgspec
import pytest

from tenants.pricing import PriceHistory, Rates, with_costs
from tenants.records import Budget, Price, RecordError, UsageRecord, nanos_to_usd


def test_costs_are_exact_nano_dollars_rounded_up_per_part():
    rates = Rates.of(Price(model="m", prompt_per_m=0.15, cached_per_m=0.075, completion_per_m=0.6))
    assert rates.costs(prompt_tokens=10, cached_tokens=4, completion_tokens=3) == (900, 300, 1800)
    # a fraction of a nano-dollar is rounded up
    odd = Rates.of(Price(model="m", prompt_per_m=0.0001))
    assert odd.costs(1, 0, 0) == (1, 0, 0)
    # the worst case: every prompt token at the dearer of prompt and cached
    dear_cache = Rates.of(
        Price(model="m", prompt_per_m=1.0, cached_per_m=2.0, completion_per_m=3.0)
    )
    assert dear_cache.worst_case_nanos(10, 5) == 10 * 2000 + 5 * 3000


def test_the_price_in_force_is_the_latest_that_took_effect():
    history = PriceHistory(
        [
            Price(model="m", prompt_per_m=1.0, effective_at=100.0),
            Price(model="m", prompt_per_m=2.0, effective_at=200.0),
            Price(model="lora", prompt_per_m=9.0, effective_at=150.0),
        ]
    )
    assert history.rates_at(50.0, "m", None) is None
    assert history.rates_at(50.0, "m", None, earliest=True).prompt == 1
    assert history.rates_at(199.0, "m", None).prompt == 1
    assert history.rates_at(200.0, "m", None).prompt == 2
    assert history.rates_at(120.0, "m", "lora").prompt == 1  # the adapter not priced yet
    assert history.rates_at(160.0, "m", "lora").prompt == 9
    rec = UsageRecord(request_id="r", tenant_id="t", key_id="k", model="m", prompt_tokens=3)
    assert with_costs(rec, history.rates_at(250.0, "m", None)).cost_nanos == 6000
    assert with_costs(rec, None).cost_nanos is None


def test_dollar_amounts_print_exactly():
    assert nanos_to_usd(0) == "0.00"
    assert nanos_to_usd(1_500_000_000) == "1.50"
    assert nanos_to_usd(27_000) == "0.000027"
    assert nanos_to_usd(1) == "0.000000001"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"limit_usd": -1}', "limit_usd"),
        (b'{"limit_usd": "1e-10"}', "limit_usd"),
        (b'{"limit_usd": 1, "period": "year"}', "period"),
        (b'{"limit_usd": 1, "thresholds": [0]}', "thresholds"),
        (b'{"limit_usd": 1, "thresholds": [true]}', "thresholds"),
    ],
)
def test_bad_budgets_are_refused_naming_the_field(body, message):
    with pytest.raises((msgspec.ValidationError, RecordError), match=message):
        msgspec.json.decode(body, type=Budget)


def test_a_budget_is_exact_and_its_thresholds_sorted():
    budget = msgspec.json.decode(b'{"limit_usd": 0.1, "thresholds": [100, 50, 50]}', type=Budget)
    assert budget.limit_usd == Decimal("0.1")
    assert budget.limit_nanos == 100_000_000
    assert budget.thresholds == [50, 100]

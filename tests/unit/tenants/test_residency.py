"""The KV residency ledger against a real store: each byte-second recorded once, however many
gateways record a worker's totals."""

from __future__ import annotations

import asyncio
from decimal import Decimal

import pytest

from tenants.residency import GIB_HOUR, HOUR_S, KVPrices, ResidencyLedger, residency_rows

T0 = 1_800_000_000  # an hour boundary
assert T0 % HOUR_S == 0


async def test_growth_is_recorded_once_per_worker_instance(redis_client) -> None:
    ledger = ResidencyLedger(redis_client)
    totals = {"acme": {"device": 100.0, "host": 50.0}, "": {"device": 7.0}}
    # two gateways recording the same totals at once, then one again
    await asyncio.gather(*(ledger.record("w1", "run-a", totals, T0 + 10) for _ in range(2)))
    assert await ledger.record("w1", "run-a", totals, T0 + 20) == 0
    await ledger.record("w1", "run-a", {"acme": {"device": 160.0, "host": 50.0}}, T0 + 30)
    # the worker restarted: a new instance's totals start from zero
    await ledger.record("w1", "run-b", {"acme": {"device": 5.0}}, T0 + HOUR_S + 1)
    # another worker of the same tenant
    await ledger.record("w2", "run-c", {"acme": {"disk": 9.0}}, T0 + 40)
    hours = await ledger.hours(["acme", "beta"], T0, T0 + 2 * HOUR_S)
    assert hours == [
        (T0, "acme", {"device": 160.0, "host": 50.0, "disk": 9.0}),
        (T0 + HOUR_S, "acme", {"device": 5.0}),
    ]


async def test_totals_that_fall_back_are_not_charged_again(redis_client) -> None:
    ledger = ResidencyLedger(redis_client)
    await ledger.record("w1", "run-a", {"acme": {"device": 100.0}}, T0)
    await ledger.record("w1", "run-a", {"acme": {"device": 40.0}}, T0 + 1)  # a stale reply
    await ledger.record("w1", "run-a", {"acme": {"device": 120.0}}, T0 + 2)
    assert await ledger.hours(["acme"], T0, T0 + 10) == [(T0, "acme", {"device": 120.0})]


async def test_rows_by_day_are_priced_per_gib_hour(redis_client) -> None:
    ledger = ResidencyLedger(redis_client)
    gib_hour = float(GIB_HOUR)
    await ledger.record("w1", "r", {"acme": {"host": 2 * gib_hour}}, T0)
    await ledger.record("w1", "r", {"acme": {"host": 3 * gib_hour, "device": gib_hour}}, T0 + 7200)
    prices = await ledger.set_prices(KVPrices(device=0.25, host=0.01))
    assert await ledger.prices() == prices
    hours = await ledger.hours(["acme"], T0, T0 + 86400)
    day = T0 // 86400 * 86400
    rows = residency_rows(hours, prices, 86400)
    assert [(r.period_start, r.tier, r.gib_hours, r.cost) for r in rows] == [
        (day, "device", Decimal(1), Decimal("0.250000")),
        (day, "host", Decimal(3), Decimal("0.030000")),
    ]
    unpriced = residency_rows(hours, KVPrices(host=0.01), 3600)
    assert [(r.tier, r.rate, r.cost) for r in unpriced if r.tier == "device"] == [
        ("device", None, Decimal(0))
    ]


def test_prices_must_be_finite_and_not_negative() -> None:
    with pytest.raises(ValueError, match="host"):
        KVPrices(host=-1.0)
    with pytest.raises(ValueError, match="disk"):
        KVPrices(disk=float("nan"))


async def test_a_window_too_long_to_read_is_refused(redis_client) -> None:
    with pytest.raises(ValueError, match="days"):
        await ResidencyLedger(redis_client).hours(["acme"], 0, T0)

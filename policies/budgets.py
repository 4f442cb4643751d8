"""Budget periods and the store keys that hold a budget's spend: which UTC day or month a
moment falls in, and the hold a reservation takes against a tenant's or a key's budget.
The admission scripts (policies/admission.py) do the counting; this module reads the
counters through a store client it is handed."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

import redis.asyncio as aioredis

from tenants.records import Budget, BudgetPeriod

# a period's counters outlive its end by this long (late settlements, reads)
KEEP_AFTER_PERIOD_S = 40 * 86400


@dataclass(frozen=True, slots=True)
class Period:
    """One budget period: `label` names it in keys and events (`d2026-11-27`, `m2026-11`,
    `life`); `end` is None for a lifetime budget."""

    label: str
    start: float
    end: float | None


def period_at(period: BudgetPeriod, at: float) -> Period:
    """The UTC period of kind `period` that contains the unix time `at`."""
    moment = datetime.fromtimestamp(at, tz=UTC)
    if period == "none":
        return Period("life", 0.0, None)
    if period == "day":
        start = moment.replace(hour=0, minute=0, second=0, microsecond=0)
        end = start.timestamp() + 86400
        return Period(f"d{start:%Y-%m-%d}", start.timestamp(), end)
    start = moment.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    if start.month == 12:
        following = start.replace(year=start.year + 1, month=1)
    else:
        following = start.replace(month=start.month + 1)
    return Period(f"m{start:%Y-%m}", start.timestamp(), following.timestamp())


def budget_key(tenant_id: str, owner: str, label: str) -> str:
    """The hash of one budget's `spent` and `reserved` nano-dollars in one period; `owner`
    is `tenant` or `key:<key_id>`. In the tenant's hash slot, like its admission keys."""
    return f"strata:rl:{{{tenant_id}}}:budget:{owner}:{label}"


@dataclass(frozen=True, slots=True)
class BudgetHold:
    """What one reservation needs to know of one budget: where its period's counters live,
    the limit, the soft thresholds (percentages) and when the counters may expire."""

    key: str
    label: str
    limit_nanos: int
    thresholds: tuple[int, ...]
    expire_at_ms: int | None

    @classmethod
    def of(cls, tenant_id: str, owner: str, budget: Budget, at: float) -> BudgetHold:
        period = period_at(budget.period, at)
        expire = None
        if period.end is not None:
            expire = round((period.end + KEEP_AFTER_PERIOD_S) * 1000)
        return cls(
            key=budget_key(tenant_id, owner, period.label),
            label=period.label,
            limit_nanos=budget.limit_nanos,
            thresholds=tuple(budget.thresholds),
            expire_at_ms=expire,
        )


@dataclass(frozen=True, slots=True)
class BudgetUsage:
    """A budget's counters in its current period, in nano-dollars: settled spend and the
    worst-case cost held by requests still running."""

    period: Period
    spent_nanos: int
    reserved_nanos: int


async def read_usage(
    redis: aioredis.Redis, tenant_id: str, owner: str, budget: Budget, at: float
) -> BudgetUsage:
    """The counters of the period of `budget` containing `at` (zero before any spend)."""
    period = period_at(budget.period, at)
    spent, reserved = await redis.hmget(
        budget_key(tenant_id, owner, period.label), ["spent", "reserved"]
    )
    return BudgetUsage(period, int(spent or 0), max(int(reserved or 0), 0))


async def seed_spent(
    redis: aioredis.Redis, tenant_id: str, owner: str, budget: Budget, at: float, nanos: int
) -> None:
    """Start a period's spend at `nanos` (the ledger's sum so far) unless it has begun
    counting already: a budget set mid-period counts what was spent before it."""
    period = period_at(budget.period, at)
    key = budget_key(tenant_id, owner, period.label)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hsetnx(key, "spent", nanos)
        if period.end is not None:
            pipe.pexpireat(key, round((period.end + KEEP_AFTER_PERIOD_S) * 1000))
        await pipe.execute()

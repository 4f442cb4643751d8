"""KV residency billing: the byte-seconds of KV cache each tenant held in each tier, taken
from the workers' meters into hourly totals in the store, and their cost at the operator's
price per GiB-hour of each tier.

A worker reports totals since it started (`EngineStats.kv_byte_seconds_by_tenant`) under an
instance id of its own. `ResidencyLedger.record` adds to the current hour only what a total
grew by since the last time any gateway recorded it: one script compares and adds, so any
number of gateways may record the same worker and every byte-second is counted once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import msgspec
import redis.asyncio as aioredis

TIERS = ("device", "host", "disk", "remote")
HOUR_S = 3600
GIB_HOUR = Decimal(1 << 30) * HOUR_S  # byte-seconds in a GiB-hour
KEEP_S = 400 * 86400  # hourly totals are kept for 400 days
SEEN_KEEP_S = 30 * 86400  # what was recorded of a worker instance: kept for 30 days
MAX_HOURS = 400 * 24  # the longest window read at once

PRICES_KEY = "strata:kv:prices"


def hour_key(tenant_id: str, hour_start: int) -> str:
    return f"strata:kv:res:{hour_start}:{tenant_id}"


def seen_key(worker_id: str, instance: str) -> str:
    return f"strata:kv:seen:{worker_id}:{instance}"


class KVPrices(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """USD per GiB-hour of KV held in each tier (None: that tier is not billed)."""

    device: float | None = None
    host: float | None = None
    disk: float | None = None
    remote: float | None = None

    def __post_init__(self) -> None:
        for tier in TIERS:
            value = getattr(self, tier)
            if value is not None and (not math.isfinite(value) or value < 0):
                raise ValueError(f"{tier}: a price must be a finite number >= 0, not {value}")

    def rate(self, tier: str) -> Decimal | None:
        value = getattr(self, tier, None)
        return None if value is None else Decimal(repr(float(value)))


_prices_decoder = msgspec.json.Decoder(KVPrices)

# KEYS[1]: the worker instance's seen-hash; KEYS[2..]: hour keys. ARGV[1]: expiry of the hour
# keys, ARGV[2]: of the seen-hash; then (index into KEYS, tenant, tier, total) per figure.
_RECORD = """
local added = 0
for i = 3, #ARGV, 4 do
  local key, field = KEYS[tonumber(ARGV[i])], ARGV[i + 1] .. '\\n' .. ARGV[i + 2]
  local total = tonumber(ARGV[i + 3])
  local seen = tonumber(redis.call('HGET', KEYS[1], field)) or 0
  if total > seen then
    redis.call('HSET', KEYS[1], field, ARGV[i + 3])
    redis.call('HINCRBYFLOAT', key, ARGV[i + 2], tostring(total - seen))
    redis.call('EXPIRE', key, ARGV[1])
    added = added + 1
  end
end
redis.call('EXPIRE', KEYS[1], ARGV[2])
return added
"""


@dataclass(frozen=True)
class ResidencyRow:
    """One tenant's KV held in one tier over one period, and what it costs."""

    period_start: int
    tenant_id: str
    tier: str
    byte_seconds: float
    rate: Decimal | None  # USD per GiB-hour; None: unpriced

    @property
    def gib_hours(self) -> Decimal:
        return Decimal(repr(self.byte_seconds)) / GIB_HOUR

    @property
    def cost(self) -> Decimal:
        """Exact to the micro-dollar, rounded half-even."""
        if self.rate is None:
            return Decimal(0)
        return (self.gib_hours * self.rate).quantize(Decimal("0.000001"))


class ResidencyLedger:
    """Hourly KV residency per tenant and tier in the store, and the prices of it."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis
        self._record = redis.register_script(_RECORD)

    async def record(
        self,
        worker_id: str,
        instance: str,
        totals: Mapping[str, Mapping[str, float]],
        now: float,
    ) -> int:
        """Add to the hour of `now` what each of a worker instance's totals (tenant -> tier
        -> byte-seconds since it started) grew by since it was last recorded; returns how
        many figures grew. Raises redis errors."""
        hour = int(now // HOUR_S) * HOUR_S
        keys = [seen_key(worker_id, instance)]
        args: list[Any] = [KEEP_S, SEEN_KEEP_S]
        for tenant_id, tiers in sorted(totals.items()):
            if not tenant_id:
                continue  # work no tenant asked for (a warm-up): nobody's bill
            keys.append(hour_key(tenant_id, hour))
            for tier, total in sorted(tiers.items()):
                if total > 0:
                    args += [len(keys), tenant_id, tier, repr(float(total))]
        if len(args) == 2:
            return 0
        return int(await self._record(keys=keys, args=args))

    async def hours(
        self, tenant_ids: Iterable[str], start: float, end: float
    ) -> list[tuple[int, str, dict[str, float]]]:
        """(hour start, tenant, tier -> byte-seconds) for the hours that overlap
        [start, end) with anything held, in time order then tenant order."""
        first = int(start // HOUR_S) * HOUR_S
        count = max(0, math.ceil((end - first) / HOUR_S))
        if count > MAX_HOURS:
            raise ValueError(f"a window of at most {MAX_HOURS // 24} days can be read at once")
        tenants = sorted(set(tenant_ids))
        slots = [(first + i * HOUR_S, t) for i in range(count) for t in tenants]
        out: list[tuple[int, str, dict[str, float]]] = []
        for at in range(0, len(slots), 512):
            chunk = slots[at : at + 512]
            async with self._redis.pipeline(transaction=False) as pipe:
                for hour, tenant_id in chunk:
                    pipe.hgetall(hour_key(tenant_id, hour))
                replies: Sequence[dict[Any, Any]] = await pipe.execute()
            for (hour, tenant_id), held in zip(chunk, replies, strict=True):
                if held:
                    out.append((hour, tenant_id, {_text(k): float(v) for k, v in held.items()}))
        return out

    async def prices(self) -> KVPrices:
        raw = await self._redis.get(PRICES_KEY)
        return KVPrices() if raw is None else _prices_decoder.decode(raw)

    async def set_prices(self, prices: KVPrices) -> KVPrices:
        await self._redis.set(PRICES_KEY, msgspec.json.encode(prices))
        return prices


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def residency_rows(
    hours: Iterable[tuple[int, str, Mapping[str, float]]], prices: KVPrices, period_s: int
) -> list[ResidencyRow]:
    """Hourly figures summed into periods of `period_s` (3600 or 86400), one row per
    (period, tenant, tier), priced at `prices`."""
    sums: dict[tuple[int, str, str], float] = {}
    for hour, tenant_id, tiers in hours:
        period = hour // period_s * period_s
        for tier, byte_seconds in tiers.items():
            key = (period, tenant_id, tier)
            sums[key] = sums.get(key, 0.0) + byte_seconds
    order = {tier: i for i, tier in enumerate(TIERS)}
    return [
        ResidencyRow(period, tenant_id, tier, total, prices.rate(tier))
        for (period, tenant_id, tier), total in sorted(
            sums.items(), key=lambda kv: (kv[0][0], kv[0][1], order.get(kv[0][2], 99))
        )
    ]

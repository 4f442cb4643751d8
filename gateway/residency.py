"""Records the fleet's KV residency for billing: every interval, each worker's totals go to
the store through `ResidencyLedger.record`, which counts what any gateway already recorded
once."""

from __future__ import annotations

import asyncio
import logging
import time

import redis.exceptions

from gateway.fleet import Fleet
from tenants.residency import ResidencyLedger

log = logging.getLogger(__name__)


async def record_once(fleet: Fleet, ledger: ResidencyLedger) -> int:
    """Record every connected worker's totals now; returns how many figures grew. A store
    that does not answer leaves the totals to the next round (they are cumulative)."""
    grew = 0
    now = time.time()
    for worker_id, stats in (await fleet.stats()).items():
        if not stats.instance:
            continue
        try:
            grew += await ledger.record(
                worker_id, stats.instance, stats.kv_byte_seconds_by_tenant, now
            )
        except (redis.exceptions.RedisError, OSError) as exc:
            log.warning("KV residency of %s not recorded yet: %s", worker_id, exc)
    return grew


async def record_forever(fleet: Fleet, ledger: ResidencyLedger, interval_s: float) -> None:
    """`record_once` every `interval_s` until cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await record_once(fleet, ledger)
        except Exception:
            log.exception("recording KV residency failed; trying again in %.0f s", interval_s)

"""The console's overview: this gateway process's request, token, error and latency figures
(from its metrics), KV-cache blocks per tier and the workers (from the fleet)."""

from __future__ import annotations

import math
from collections import Counter as Tally
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from litestar import Controller, Request, get
from litestar.di import NamedDependency
from litestar.response import Template

from engine.protocol import EngineStats
from gateway.fleet import Fleet
from gateway.metrics import GatewayMetrics
from gateway.ui.render import page
from gateway.ui.session import requires_console_session

ERROR_STATUSES = frozenset({"error"})


class Collects(Protocol):
    """A metric of GatewayMetrics, read through its families (the Prometheus collector API)."""

    def collect(self) -> Iterable[Any]: ...


@dataclass(frozen=True)
class Latency:
    num_observed: int
    mean_s: float | None
    p95_s: float | None  # the upper bound of the bucket holding the 95th percentile, if finite


@dataclass(frozen=True)
class Figures:
    num_requests: int
    num_errors: int
    num_rejected: int
    prompt_tokens: int
    generation_tokens: int
    by_status: dict[str, int]
    e2e: Latency
    ttft: Latency


@dataclass(frozen=True)
class TierUsage:
    tier: str
    used: int
    total: int

    @property
    def percent(self) -> float:
        return 100.0 * self.used / self.total if self.total else 0.0


@dataclass(frozen=True)
class WorkerRow:
    worker_id: str
    model: str | None
    address: str
    state: str
    num_running: int | None
    num_waiting: int | None
    kv_used: int | None
    kv_total: int | None


def _sum_by(counter: Collects, label: str | None = None) -> Tally[str]:
    tally: Tally[str] = Tally()
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                tally[sample.labels.get(label, "") if label else ""] += int(sample.value)
    return tally


def latency(histogram: Collects) -> Latency:
    buckets: dict[float, float] = {}
    total, count = 0.0, 0
    for family in histogram.collect():
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                bound = float(sample.labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + sample.value
            elif sample.name.endswith("_sum"):
                total += sample.value
            elif sample.name.endswith("_count"):
                count += int(sample.value)
    if not count:
        return Latency(0, None, None)
    p95 = next((bound for bound, n in sorted(buckets.items()) if n >= 0.95 * count), math.inf)
    return Latency(count, total / count, p95 if math.isfinite(p95) else None)


def read_figures(metrics: GatewayMetrics) -> Figures:
    by_status = _sum_by(metrics.requests, "status")
    return Figures(
        num_requests=sum(by_status.values()),
        num_errors=sum(n for status, n in by_status.items() if status in ERROR_STATUSES),
        num_rejected=sum(_sum_by(metrics.rejections).values()),
        prompt_tokens=sum(_sum_by(metrics.prompt_tokens).values()),
        generation_tokens=sum(_sum_by(metrics.generation_tokens).values()),
        by_status=dict(sorted(by_status.items())),
        e2e=latency(metrics.e2e),
        ttft=latency(metrics.ttft),
    )


def kv_tiers(stats: dict[str, EngineStats]) -> list[TierUsage]:
    """Blocks used and held, per tier, over every worker that answered (tiers no worker
    has are left out)."""
    used: Tally[str] = Tally()
    total: Tally[str] = Tally()
    for s in stats.values():
        used.update(device=s.num_kv_blocks_used, host=s.num_kv_host_blocks_used)
        used.update(disk=s.num_kv_disk_blocks_used)
        total.update(device=s.num_kv_blocks_total, host=s.num_kv_host_blocks_total)
        total.update(disk=s.num_kv_disk_blocks_total)
    return [TierUsage(t, used[t], total[t]) for t in ("device", "host", "disk") if total[t]]


def worker_rows(fleet: Fleet, stats: dict[str, EngineStats]) -> list[WorkerRow]:
    rows = []
    for worker_id, handle in sorted(fleet.workers.items()):
        s = stats.get(worker_id)
        state = "drained" if handle.drained else "serving" if handle.client.connected else "down"
        rows.append(
            WorkerRow(
                worker_id=worker_id,
                model=handle.model_id,
                address=handle.address,
                state=state,
                num_running=s.num_running if s else None,
                num_waiting=s.num_waiting if s else None,
                kv_used=s.num_kv_blocks_used if s else None,
                kv_total=s.num_kv_blocks_total if s else None,
            )
        )
    return rows


class OverviewPage(Controller):
    path = "/"
    guards = [requires_console_session]  # noqa: RUF012

    @get("/", opt={"nav": "Overview", "nav_order": 10})
    async def overview(
        self,
        request: Request[Any, Any, Any],
        metrics: NamedDependency[GatewayMetrics],
        fleet: NamedDependency[Fleet],
    ) -> Template:
        stats = await fleet.stats()
        return page(
            request,
            "overview.html",
            figures=read_figures(metrics),
            tiers=kv_tiers(stats),
            workers=worker_rows(fleet, stats),
        )

"""Console page for usage over time: requests and tokens per hour or day, for one tenant or
all, read from the ledger and drawn with the vendored chart library."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
from litestar import Controller, Request, get
from litestar.di import NamedDependency
from litestar.params import FromQuery
from litestar.response import Template

from gateway.admin_access import BILLING
from gateway.ui.render import page
from gateway.ui.session import requires_console_session
from tenants.ledger import Ledger
from tenants.records import UsageRecord
from tenants.registry import TenantRegistry

Period = Literal["hour", "day"]
# the span each chart shows: its bucket size and how many buckets
WINDOWS: dict[str, tuple[int, int]] = {"hour": (3600, 48), "day": (86400, 30)}


def buckets(by: Period, now: float) -> tuple[list[int], int]:
    """The starts of the chart's buckets up to the one holding `now`, and the end of it."""
    period_s, num_buckets = WINDOWS[by]
    last_bucket = int(now // period_s) * period_s
    starts = [last_bucket - (num_buckets - 1 - i) * period_s for i in range(num_buckets)]
    return starts, last_bucket + period_s


@dataclass
class UsageSeries:
    """Totals per bucket, oldest first; `starts` are the buckets' unix start times."""

    starts: list[int]
    requests: list[int] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    completion_tokens: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        for series in (self.requests, self.prompt_tokens, self.completion_tokens):
            series.extend([0] * (len(self.starts) - len(series)))

    @property
    def num_requests(self) -> int:
        return sum(self.requests)

    @property
    def num_tokens(self) -> int:
        return sum(self.prompt_tokens) + sum(self.completion_tokens)

    def chart_json(self) -> str:
        return msgspec.json.encode(
            {
                "x": self.starts,
                "requests": self.requests,
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
            }
        ).decode()


async def usage_series(
    records: AsyncIterator[UsageRecord], first_bucket: int, period_s: int, num_buckets: int
) -> UsageSeries:
    """Sum `records` (finished in [first_bucket, first_bucket + num_buckets * period_s))
    into buckets of `period_s` seconds."""
    series = UsageSeries(starts=[first_bucket + i * period_s for i in range(num_buckets)])
    async for rec in records:
        i = int((rec.finished_at - first_bucket) // period_s)
        if 0 <= i < num_buckets:
            series.requests[i] += 1
            series.prompt_tokens[i] += rec.prompt_tokens
            series.completion_tokens[i] += rec.completion_tokens
    return series


class UsagePages(Controller):
    path = "/usage"
    guards = [requires_console_session]  # noqa: RUF012

    @get("/", opt={"nav": "Usage", "nav_order": 60, **BILLING})
    async def chart(
        self,
        request: Request[Any, Any, Any],
        registry: NamedDependency[TenantRegistry],
        ledger: NamedDependency[Ledger],
        tenant: FromQuery[str | None] = None,
        by: FromQuery[Period] = "hour",
    ) -> Template:
        tenant_id = tenant or None
        if tenant_id is not None:
            await registry.get_tenant(tenant_id)  # 404 for an unknown tenant
        starts, end = buckets(by, time.time())
        records = ledger.iter_records(tenant_id, starts[0], end)
        series = await usage_series(records, starts[0], WINDOWS[by][0], len(starts))
        return page(
            request,
            "usage.html",
            series=series,
            tenants=await registry.list_tenants(),
            tenant_id=tenant_id,
            by=by,
            rows=[
                (start, n, p, c)
                for start, n, p, c in zip(
                    series.starts,
                    series.requests,
                    series.prompt_tokens,
                    series.completion_tokens,
                    strict=True,
                )
                if n
            ][::-1],
        )

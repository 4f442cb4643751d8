"""The gateway's HTTP routes, and what their handlers share."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from gateway.errors import bad_request
from tenants.export import ExportFormat, Granularity, ModelNames, PriceBook, export_usage

if TYPE_CHECKING:
    from gateway.fleet import Fleet
    from gateway.metrics import GatewayMetrics
    from tenants.ledger import Ledger
    from tenants.registry import TenantRegistry

log = logging.getLogger(__name__)


async def usage_export(
    registry: TenantRegistry,
    ledger: Ledger,
    fleet: Fleet,
    metrics: GatewayMetrics,
    tenant_id: str | None,
    start: float,
    end: float,
    *,
    fmt: ExportFormat,
    granularity: Granularity,
) -> AsyncIterator[bytes]:
    """A usage export over [start, end) (one tenant, or all for None) at the costs its
    records carry (see tenants/export.py), with every model named by its canonical id.
    Requests no price applies to are logged and counted once the export has been read."""
    prices = await registry.list_prices()
    adapters = await registry.list_adapters()
    names = ModelNames(
        fleet.all_aliases(),
        {a.name: a.base_model for a in adapters},
        default_base=fleet.default_model_id,
    )
    book = PriceBook(prices)
    body = export_usage(
        ledger.iter_records(tenant_id, start, end),
        fmt=fmt,
        granularity=granularity,
        prices=book,
        names=names,
    )
    return _report_unpriced(body, book, metrics)


async def _report_unpriced(
    body: AsyncIterator[bytes], book: PriceBook, metrics: GatewayMetrics
) -> AsyncIterator[bytes]:
    async for chunk in body:
        yield chunk
    for name, num_requests in sorted(book.unpriced.items()):
        metrics.unpriced.labels(name).inc(num_requests)
        log.warning(
            "usage export: %d requests of %r have no price (set one with PUT /admin/prices/)",
            num_requests,
            name,
        )


def time_window(
    start: str | None, end: str | None, *, span_s: float | None = None
) -> tuple[float, float]:
    """The [start, end) of a usage query, in unix seconds. Each bound is given as unix seconds
    or in ISO 8601 (`2026-11-01`, `2026-11-01T12:00:00+02:00`; UTC unless it names an
    offset). `end` defaults to now; `start` to `span_s` before `end`, or to the epoch."""
    stop = _instant(end, "end") if end is not None else time.time() + 1
    if start is not None:
        begin = _instant(start, "start")
    else:
        begin = stop - span_s if span_s is not None else 0.0
    if begin >= stop:
        raise bad_request("start must be before end", param="start")
    return begin, stop


def _instant(value: str, param: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds):
            raise bad_request(f"{param} must be a finite time, not {value!r}", param=param)
        return seconds
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise bad_request(
            f"{param} must be unix seconds or an ISO 8601 date or date-time, not {value!r}",
            param=param,
        ) from None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()

"""Operations endpoints: liveness, readiness and Prometheus metrics (a token, if set)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Any

import redis.asyncio as aioredis
from litestar import Request, Response, get
from litestar.di import NamedDependency

from gateway.auth import bearer_token
from gateway.errors import APIError
from gateway.fleet import Fleet
from gateway.metrics import GatewayMetrics
from gateway.settings import GatewaySettings
from tenants.registry import TenantRegistry
from tenants.store import ping

log = logging.getLogger(__name__)


@get("/health", tags=["ops"])
async def health() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@get("/ready", tags=["ops"])
async def ready(
    store: NamedDependency[Any], fleet: NamedDependency[Fleet]
) -> Response[dict[str, Any]]:
    """200 while some engine worker is reachable (busy or not), else 503. With the store out
    of reach the status is "degraded": the replica routes on its last view of the fleet and
    admits the tenants whose policy is fail_open, so it stays in rotation."""
    store_ok = await ping(store)
    engine_ok = await fleet.ready()
    status = "not ready" if not engine_ok else "ready" if store_ok else "degraded"
    body = {
        "status": status,
        "store": store_ok,
        "registry": fleet.registry_ok if fleet.redis is not None else None,
        "engine": engine_ok,
        "engine_errors": fleet.errors(),
    }
    return Response(body, status_code=200 if engine_ok else 503)


@get("/metrics", tags=["ops"], media_type="text/plain; version=0.0.4")
async def metrics(
    request: Request[Any, Any, Any],
    settings: NamedDependency[GatewaySettings],
    fleet: NamedDependency[Fleet],
    registry: NamedDependency[TenantRegistry],
    metrics: NamedDependency[GatewayMetrics],
) -> bytes:
    """Prometheus metrics; behind a bearer token when STRATA_METRICS_TOKEN is set."""
    expected = settings.metrics_token
    if expected is not None:
        presented = (bearer_token(request) or "").encode()
        if not hmac.compare_digest(presented, expected.encode()):
            raise APIError(
                401,
                "invalid metrics token",
                type="authentication_error",
                code="invalid_metrics_token",
            )
    metrics.set_engine(await fleet.stats())
    metrics.set_fleet(fleet.view())
    await _refresh_tenant_names(registry, metrics)
    return metrics.render()


async def _refresh_tenant_names(registry: TenantRegistry, metrics: GatewayMetrics) -> None:
    """Read the tenants' names for `strata:tenant_info` when the last read is old; a store
    that does not answer keeps the names read before (the scrape still succeeds)."""
    now = time.monotonic()
    if not metrics.tenant_names_due(now):
        return
    try:
        async with asyncio.timeout(2.0):
            tenants = await registry.list_tenants()
    except (aioredis.RedisError, OSError, TimeoutError) as exc:
        log.warning("metrics: cannot read the tenants' names: %s", exc)
        return
    metrics.set_tenant_names({t.id: t.name for t in tenants}, now)

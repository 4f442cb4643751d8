"""Operations endpoints: liveness, readiness and Prometheus metrics (a token, if set)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis
from litestar import Request, Response, get

from gateway.auth import bearer_token, gateway_state
from gateway.errors import APIError
from tenants.store import ping

if TYPE_CHECKING:
    from gateway.state import GatewayState

log = logging.getLogger(__name__)


@get("/health", tags=["ops"])
async def health() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@get("/ready", tags=["ops"])
async def ready(request: Request[Any, Any, Any]) -> Response[dict[str, Any]]:
    """The store and at least one engine worker answer."""
    gw = gateway_state(request)
    store_ok = await ping(gw.redis)
    engine_ok = await gw.fleet.ready()
    ok = store_ok and engine_ok
    body = {
        "status": "ready" if ok else "not ready", "store": store_ok, "engine": engine_ok,
        "engine_errors": gw.fleet.errors(),
    }  # fmt: skip
    return Response(body, status_code=200 if ok else 503)


@get("/metrics", tags=["ops"], media_type="text/plain; version=0.0.4")
async def metrics(request: Request[Any, Any, Any]) -> bytes:
    """Prometheus metrics; behind a bearer token when STRATA_METRICS_TOKEN is set."""
    gw = gateway_state(request)
    expected = gw.settings.metrics_token
    if expected is not None:
        presented = (bearer_token(request) or "").encode()
        if not hmac.compare_digest(presented, expected.encode()):
            raise APIError(401, "invalid metrics token", type="authentication_error",
                           code="invalid_metrics_token")  # fmt: skip
    gw.metrics.set_engine(await gw.fleet.stats())
    await _refresh_tenant_names(gw)
    return gw.metrics.render()


async def _refresh_tenant_names(gw: GatewayState) -> None:
    """Read the tenants' names for `strata:tenant_info` when the last read is old; a store
    that does not answer keeps the names read before (the scrape still succeeds)."""
    now = time.monotonic()
    if not gw.metrics.tenant_names_due(now):
        return
    try:
        async with asyncio.timeout(2.0):
            tenants = await gw.registry.list_tenants()
    except (aioredis.RedisError, OSError, TimeoutError) as exc:
        log.warning("metrics: cannot read the tenants' names: %s", exc)
        return
    gw.metrics.set_tenant_names({t.id: t.name for t in tenants}, now)

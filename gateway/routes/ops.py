"""Operations endpoints: liveness, readiness and Prometheus metrics (no authentication)."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get

from gateway.auth import gateway_state
from tenants.store import ping


@get("/health", tags=["ops"])
async def health() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@get("/ready", tags=["ops"])
async def ready(request: Request[Any, Any, Any]) -> Response[dict[str, Any]]:
    """The store and at least one engine worker answer."""
    gw = gateway_state(request)
    store_ok = await ping(gw.redis)
    engine_ok = await gw.engines.ready()
    ok = store_ok and engine_ok
    body = {"status": "ready" if ok else "not ready", "store": store_ok, "engine": engine_ok}
    return Response(body, status_code=200 if ok else 503)


@get("/metrics", tags=["ops"], media_type="text/plain; version=0.0.4")
async def metrics(request: Request[Any, Any, Any]) -> bytes:
    gw = gateway_state(request)
    gw.metrics.set_engine(await gw.engines.stats())
    return gw.metrics.render()

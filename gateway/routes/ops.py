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
    stats = await gw.engines.stats()
    kv_blocks: dict[tuple[str, str], int] = {}
    for s in stats:
        for tenant, tiers in s.kv_blocks_by_tenant.items():
            for tier, n in tiers.items():
                kv_blocks[tenant, tier] = kv_blocks.get((tenant, tier), 0) + n
    gw.metrics.set_engine(
        waiting=sum(s.num_waiting for s in stats),
        running=sum(s.num_running for s in stats),
        kv_used=sum(s.num_kv_blocks_used for s in stats),
        kv_total=sum(s.num_kv_blocks_total for s in stats),
        kv_bytes_per_token=max((s.kv_bytes_per_token for s in stats), default=0),
        kv_blocks=kv_blocks,
        kv_read_ahead_bytes=sum(s.kv_disk_read_ahead_bytes for s in stats),
        kv_checksum_failures=sum(s.num_kv_disk_checksum_failures for s in stats),
        draft_tokens=sum(s.num_draft_tokens for s in stats),
        accepted_draft_tokens=sum(s.num_accepted_draft_tokens for s in stats),
    )
    return gw.metrics.render()

"""The operator's REST API: tenants, keys, policies, adapters, prices, usage and exports.
Every route needs an admin token whose role gives its access level (`gateway.admin_access`:
what billing tokens may read says so with `opt=BILLING`); handlers only delegate to the
tenants services."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import msgspec
from litestar import Controller, Response, delete, get, patch, post, put
from litestar.di import NamedDependency
from litestar.enums import RequestEncodingType
from litestar.params import Body, FromPath, FromQuery, JSONBody
from litestar.response import Stream

from gateway.adapters import (
    MAX_ADAPTER_UPLOAD_BYTES,
    AdapterUpload,
    register_adapter,
    register_upload,
)
from gateway.admin_access import BILLING
from gateway.auth import requires_admin_token
from gateway.fleet import Fleet, WorkerHandle
from gateway.kv_index import KVIndex
from gateway.metrics import GatewayMetrics
from gateway.routes import time_window, usage_export
from gateway.settings import GatewaySettings
from tenants.errors import NotFoundError
from tenants.export import ExportFormat, Granularity
from tenants.keys import KeyManager
from tenants.ledger import Ledger
from tenants.records import (
    Adapter,
    AdapterCreate,
    ApiKey,
    ApiKeyCreated,
    KeyCreate,
    KeyRotate,
    Policy,
    PolicyPatch,
    PolicyView,
    Price,
    TenantCreate,
    TenantUpdate,
    TenantView,
)
from tenants.registry import TenantRegistry

_MEDIA = {"csv": "text/csv", "ndjson": "application/x-ndjson", "json": "application/json"}


class TenantController(Controller):
    path = "/admin/tenants"
    guards = [requires_admin_token]  # noqa: RUF012
    tags = ["admin"]  # noqa: RUF012

    @post("/")
    async def create(
        self, registry: NamedDependency[TenantRegistry], data: JSONBody[TenantCreate]
    ) -> TenantView:
        return TenantView.of(await registry.create_tenant(data))

    @get("/")
    async def list_all(self, registry: NamedDependency[TenantRegistry]) -> list[TenantView]:
        return [TenantView.of(t) for t in await registry.list_tenants()]

    @get("/{tenant_id:str}")
    async def read(
        self, registry: NamedDependency[TenantRegistry], tenant_id: FromPath[str]
    ) -> TenantView:
        return TenantView.of(await registry.get_tenant(tenant_id))

    @patch("/{tenant_id:str}")
    async def update(
        self,
        registry: NamedDependency[TenantRegistry],
        tenant_id: FromPath[str],
        data: JSONBody[TenantUpdate],
    ) -> TenantView:
        tenant = await registry.update_tenant(tenant_id, data)
        return TenantView.of(tenant)

    @delete("/{tenant_id:str}")
    async def remove(
        self, registry: NamedDependency[TenantRegistry], tenant_id: FromPath[str]
    ) -> None:
        await registry.delete_tenant(tenant_id)

    @post("/{tenant_id:str}/rotate-cache-salt", status_code=200)
    async def rotate_cache_salt(
        self, registry: NamedDependency[TenantRegistry], tenant_id: FromPath[str]
    ) -> TenantView:
        """A fresh secret salt: the tenant's cached prefixes are never hit again."""
        tenant = await registry.rotate_cache_salt(tenant_id)
        return TenantView.of(tenant)

    @get("/{tenant_id:str}/policy")
    async def get_policy(
        self,
        registry: NamedDependency[TenantRegistry],
        fleet: NamedDependency[Fleet],
        tenant_id: FromPath[str],
    ) -> PolicyView:
        return policy_view(fleet, await registry.get_policy(tenant_id))

    @put("/{tenant_id:str}/policy")
    async def put_policy(
        self,
        registry: NamedDependency[TenantRegistry],
        tenant_id: FromPath[str],
        data: JSONBody[Policy],
    ) -> Policy:
        return await registry.put_policy(tenant_id, data)

    @patch("/{tenant_id:str}/policy")
    async def patch_policy(
        self,
        registry: NamedDependency[TenantRegistry],
        tenant_id: FromPath[str],
        data: JSONBody[PolicyPatch],
    ) -> Policy:
        return await registry.patch_policy(tenant_id, data)

    @post("/{tenant_id:str}/keys")
    async def create_key(
        self, keys: NamedDependency[KeyManager], tenant_id: FromPath[str], data: JSONBody[KeyCreate]
    ) -> ApiKeyCreated:
        return await keys.create_key(tenant_id, data)

    @get("/{tenant_id:str}/keys")
    async def list_keys(
        self, keys: NamedDependency[KeyManager], tenant_id: FromPath[str]
    ) -> list[ApiKey]:
        return await keys.list_keys(tenant_id)


def policy_view(fleet: Fleet, policy: Policy) -> PolicyView:
    """The KV budget in bytes at the default model's KV bytes per token (and KV dtype)."""
    default = fleet.resolve("default")
    per_token = default.info.kv_bytes_per_token if default is not None else 0
    budget = policy.kv_budget_tokens
    return PolicyView(
        policy=policy,
        kv_bytes_per_token=per_token,
        kv_budget_bytes=None if budget is None else budget * per_token,
    )


class KeyController(Controller):
    path = "/admin/keys"
    guards = [requires_admin_token]  # noqa: RUF012
    tags = ["admin"]  # noqa: RUF012

    @get("/{key_id:str}")
    async def read(self, keys: NamedDependency[KeyManager], key_id: FromPath[str]) -> ApiKey:
        return await keys.get_key(key_id)

    @post("/{key_id:str}/revoke", status_code=200)
    async def revoke(self, keys: NamedDependency[KeyManager], key_id: FromPath[str]) -> ApiKey:
        return await keys.revoke_key(key_id)

    @post("/{key_id:str}/rotate")
    async def rotate(
        self, keys: NamedDependency[KeyManager], key_id: FromPath[str], data: JSONBody[KeyRotate]
    ) -> ApiKeyCreated:
        return await keys.rotate_key(key_id, data)


class AdapterController(Controller):
    path = "/admin/adapters"
    guards = [requires_admin_token]  # noqa: RUF012
    tags = ["admin"]  # noqa: RUF012

    @post("/")
    async def register(
        self,
        registry: NamedDependency[TenantRegistry],
        fleet: NamedDependency[Fleet],
        data: JSONBody[AdapterCreate],
    ) -> Adapter:
        return await register_adapter(data, registry, fleet)  # 400 if it cannot serve

    @post("/upload", request_max_body_size=MAX_ADAPTER_UPLOAD_BYTES, status_code=201)
    async def upload(
        self,
        registry: NamedDependency[TenantRegistry],
        fleet: NamedDependency[Fleet],
        settings: NamedDependency[GatewaySettings],
        data: Annotated[AdapterUpload, Body(media_type=RequestEncodingType.MULTI_PART)],
    ) -> Adapter:
        """Register an adapter from its two PEFT files, sent as multipart form data; they are
        kept under the gateway's data dir, which the engine workers must be able to read."""
        root = Path(settings.data_dir) / "adapters"
        return await register_upload(data, registry, fleet, root)

    @get("/")
    async def list_all(self, registry: NamedDependency[TenantRegistry]) -> list[Adapter]:
        return await registry.list_adapters()

    @delete("/{name:str}")
    async def remove(self, registry: NamedDependency[TenantRegistry], name: FromPath[str]) -> None:
        await registry.delete_adapter(name)


class PriceController(Controller):
    path = "/admin/prices"
    guards = [requires_admin_token]  # noqa: RUF012
    tags = ["admin"]  # noqa: RUF012

    @put("/", status_code=200)
    async def put_price(
        self, registry: NamedDependency[TenantRegistry], data: JSONBody[Price]
    ) -> Price:
        return await registry.put_price(data)  # with the effective time it was given

    @get("/", opt=BILLING)
    async def list_all(self, registry: NamedDependency[TenantRegistry]) -> list[Price]:
        return await registry.list_prices()

    @delete("/{model:str}")
    async def remove(self, registry: NamedDependency[TenantRegistry], model: FromPath[str]) -> None:
        await registry.delete_price(model)


class UsageController(Controller):
    path = "/admin/usage"
    guards = [requires_admin_token]  # noqa: RUF012
    tags = ["admin"]  # noqa: RUF012

    @get("/export", opt=BILLING)
    async def export(
        self,
        registry: NamedDependency[TenantRegistry],
        ledger: NamedDependency[Ledger],
        fleet: NamedDependency[Fleet],
        metrics: NamedDependency[GatewayMetrics],
        tenant: FromQuery[str | None] = None,
        start: FromQuery[str | None] = None,
        end: FromQuery[str | None] = None,
        format: FromQuery[ExportFormat] = "json",
        granularity: FromQuery[Granularity] = "request",
    ) -> Response[Any]:
        """Stream usage for one tenant (or all) over [start, end), with cost columns (bounds
        in unix seconds or ISO 8601)."""
        begin, stop = time_window(start, end)
        if tenant is not None:
            await registry.get_tenant(tenant)  # 404 for an unknown tenant
        body = await usage_export(
            registry,
            ledger,
            fleet,
            metrics,
            tenant,
            begin,
            stop,
            fmt=format,
            granularity=granularity,
        )
        filename = f"usage-{tenant or 'all'}.{format}"
        return Stream(
            body,
            media_type=_MEDIA[format],
            headers={"content-disposition": f'attachment; filename="{filename}"'},
        )


class WorkerView(msgspec.Struct, kw_only=True):
    """A worker as the admin API shows it."""

    worker_id: str
    address: str
    model: str | None
    static: bool  # given by --engine rather than registered
    role: str = "both"  # both, prefill or decode
    drained: bool
    connected: bool
    num_running: int | None = None  # from its latest heartbeat (registered workers)
    num_waiting: int | None = None
    kv_blocks_used: int | None = None
    kv_blocks_total: int | None = None
    heartbeat_at: float | None = None
    # the blocks this gateway's KV index holds for the worker, by tier (from its events)
    indexed_blocks: dict[str, int] = msgspec.field(default_factory=dict)


class WorkerRef(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    worker_id: str


def _worker_view(handle: WorkerHandle, index: KVIndex) -> WorkerView:
    rec = handle.record
    return WorkerView(
        worker_id=handle.worker_id,
        address=handle.address,
        model=handle.model_id,
        static=handle.static,
        role=handle.role,
        drained=handle.drained,
        connected=handle.client.connected,
        num_running=rec.num_running if rec else None,
        num_waiting=rec.num_waiting if rec else None,
        kv_blocks_used=rec.num_kv_blocks_used if rec else None,
        kv_blocks_total=rec.num_kv_blocks_total if rec else None,
        heartbeat_at=rec.heartbeat_at if rec else None,
        indexed_blocks=index.num_blocks(handle.worker_id),
    )


class WorkerController(Controller):
    path = "/admin/workers"
    guards = [requires_admin_token]  # noqa: RUF012
    tags = ["admin"]  # noqa: RUF012

    @get("/")
    async def list_all(self, fleet: NamedDependency[Fleet]) -> list[WorkerView]:
        return [_worker_view(h, fleet.index) for _, h in sorted(fleet.workers.items())]

    @post("/drain", status_code=200)
    async def drain(self, fleet: NamedDependency[Fleet], data: JSONBody[WorkerRef]) -> WorkerView:
        """The worker takes no new requests, on every gateway; its running ones finish."""
        return _worker_view(await _set_drained(fleet, data.worker_id, True), fleet.index)

    @post("/undrain", status_code=200)
    async def undrain(self, fleet: NamedDependency[Fleet], data: JSONBody[WorkerRef]) -> WorkerView:
        return _worker_view(await _set_drained(fleet, data.worker_id, False), fleet.index)


async def _set_drained(fleet: Fleet, worker_id: str, drained: bool) -> WorkerHandle:
    try:
        return await fleet.set_drained(worker_id, drained)
    except KeyError:
        raise NotFoundError("worker", worker_id) from None

"""Adapters on the request path: which registered adapter a request's `model` names, whether
the tenant may use it, and whether an adapter is fit to register at all."""

from __future__ import annotations

import asyncio
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

import aiofiles
import msgspec
from litestar.datastructures import UploadFile

from engine.model_config import ModelConfig
from engine.protocol import LoRARequest, ModelInfo
from gateway.errors import APIError, bad_request
from tenants.errors import NotFoundError
from tenants.records import Adapter, AdapterCreate, Tenant
from tenants.registry import TenantRegistry, tenant_may_use


class AdapterResolver:
    def __init__(self, registry: TenantRegistry, info: ModelInfo, base_names: set[str]) -> None:
        self.registry = registry
        self.info = info
        self.base_names = base_names

    async def resolve(self, model: str, tenant: Tenant) -> LoRARequest | None:
        """The adapter version `model` names (`name` for the latest, `name@version`), or
        None for the base model and for names never registered (the base model's checks
        reject those). 404 for a missing version or a deleted adapter, 403 outside the
        adapter's ACL or the tenant's plan."""
        if model in self.base_names:
            return None
        name, at, version = model.partition("@")
        try:
            adapter = await self.registry.get_adapter(name, int(version) if at else None)
        except (NotFoundError, ValueError):
            if at or await self.registry.adapter_known(name):
                raise APIError(
                    404, f"The adapter '{model}' does not exist.", code="model_not_found",
                    param="model",
                ) from None  # fmt: skip
            return None
        if not (tenant_may_use(adapter, tenant.id) and tenant.policy.allows_adapter(name)):
            raise APIError(
                403, f"your plan does not include the adapter '{name}'",
                type="permission_error", code="model_not_allowed", param="model",
            )  # fmt: skip
        if not self.info.max_loras:
            raise APIError(
                400, "this deployment's engine serves no adapters (start it with --max-loras)",
                code="adapters_disabled", param="model",
            )  # fmt: skip
        return LoRARequest(name=adapter.name, version=adapter.version, path=adapter.path)


async def check_adapter(path: str, name: str, info: ModelInfo) -> None:
    """Reject (400, one clear line) an adapter the engine could not serve: unreadable or
    corrupt files, unsupported modules, shapes that do not fit this base model, a rank
    above the engine's slots. Reading the files takes torch, which the gateway imports
    only here, for its first adapter."""
    from engine.lora.adapter import AdapterError, load_adapter  # noqa: PLC0415

    config = ModelConfig(
        vocab_size=info.vocab_size, hidden_size=info.hidden_size,
        intermediate_size=info.intermediate_size, num_layers=info.num_layers,
        num_heads=info.num_heads, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim,
        max_position_embeddings=info.max_model_len,
    )  # fmt: skip
    try:
        adapter = await asyncio.to_thread(load_adapter, path, config, name=name)
    except AdapterError as exc:
        raise APIError(400, str(exc), code="invalid_adapter", param="path") from None
    if info.max_lora_rank and adapter.rank > info.max_lora_rank:
        raise APIError(
            400, f"{name}: rank {adapter.rank} exceeds the engine's max_lora_rank "
            f"{info.max_lora_rank}", code="invalid_adapter", param="path",
        )  # fmt: skip


MAX_ADAPTER_UPLOAD_BYTES = 4 << 30
_CHUNK = 1 << 20


@dataclass
class AdapterUpload:
    """`POST /admin/adapters/upload` (multipart): the adapter's name, its two PEFT files,
    and optionally the tenants allowed to use it (a JSON list of tenant ids)."""

    name: str
    adapter_config: UploadFile  # adapter_config.json
    adapter_model: UploadFile  # adapter_model.safetensors
    allowed_tenants: str | None = None


async def register_upload(
    upload: AdapterUpload, registry: TenantRegistry, info: ModelInfo, root: Path
) -> Adapter:
    """Write the uploaded files to a fresh directory under `root`, check them like a path
    registration (400 and nothing kept when the engine could not serve them), register."""
    try:
        allowed = None
        if upload.allowed_tenants:
            allowed = msgspec.json.decode(upload.allowed_tenants, type=list[str])
        spec = AdapterCreate(name=upload.name, path="", allowed_tenants=allowed)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise bad_request(f"invalid adapter upload: {exc}", code="invalid_adapter") from None
    directory = root / f"{spec.name}-{secrets.token_hex(8)}"
    try:
        await asyncio.to_thread(directory.mkdir, parents=True)
        for part, filename in ((upload.adapter_config, "adapter_config.json"),
                               (upload.adapter_model, "adapter_model.safetensors")):  # fmt: skip
            async with aiofiles.open(directory / filename, "wb") as out:
                while chunk := await part.read(_CHUNK):
                    await out.write(chunk)
        await check_adapter(str(directory), spec.name, info)
    except BaseException:
        await asyncio.to_thread(shutil.rmtree, directory, True)
        raise
    finally:
        await upload.adapter_config.close()
        await upload.adapter_model.close()
    created = msgspec.structs.replace(spec, path=str(directory.resolve()))
    return await registry.register_adapter(created, info.model_id)

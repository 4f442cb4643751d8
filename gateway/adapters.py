"""Adapters on the request path: which registered adapter a request's `model` names, whether
the tenant may use it, and whether an adapter is fit to register at all."""

from __future__ import annotations

import asyncio
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import aiofiles
import msgspec
from litestar.datastructures import UploadFile

from engine.model_config import ModelConfig
from engine.protocol import LoRARequest, ModelInfo
from gateway.errors import APIError, bad_request
from tenants.errors import NotFoundError
from tenants.records import Adapter, AdapterCreate, Policy, Tenant
from tenants.registry import TenantRegistry, tenant_may_use

if TYPE_CHECKING:
    from gateway.fleet import Fleet, ModelGroup


class AdapterResolver:
    """What a request's `model` names: a served model (by id or alias) or a registered
    adapter of one, checked against the tenant's plan."""

    def __init__(self, registry: TenantRegistry, fleet: Fleet) -> None:
        self.registry = registry
        self.fleet = fleet

    async def resolve(self, model: str, tenant: Tenant) -> tuple[ModelGroup, LoRARequest | None]:
        """The model group that serves `model`, and the adapter version it names (`name` for
        the latest, `name@version`; None for a base model). 404 for an unknown model or
        adapter (a missing version, a deleted adapter), 403 outside the plan or the
        adapter's ACL, 503 when the adapter's base model has no worker up."""
        group = self.fleet.resolve(model)
        if group is not None:
            check_model(group, model, tenant.policy)
            return group, None
        name, at, version = model.partition("@")
        try:
            adapter = await self.registry.get_adapter(name, int(version) if at else None)
        except (NotFoundError, ValueError):
            raise APIError(
                404,
                f"The model '{model}' does not exist or you do not have access to it.",
                type="not_found_error",
                code="model_not_found",
                param="model",
            ) from None
        if not (tenant_may_use(adapter, tenant.id) and tenant.policy.allows_adapter(name)):
            raise APIError(
                403,
                f"your plan does not include the adapter '{name}'",
                type="permission_error",
                code="model_not_allowed",
                param="model",
            )
        group = self.fleet.resolve(adapter.base_model)
        if group is None:
            raise APIError(
                503,
                f"no worker serves {adapter.base_model}, the base model of '{name}', now",
                type="service_unavailable",
                code="model_unavailable",
                param="model",
                headers={"retry-after": "5"},
            )
        if not group.info.max_loras:
            raise APIError(
                400,
                "this deployment's engine serves no adapters (start it with --max-loras)",
                code="adapters_disabled",
                param="model",
            )
        return group, LoRARequest(name=adapter.name, version=adapter.version, path=adapter.path)


def base_group(fleet: Fleet, base_model: str | None) -> ModelGroup:
    """The served model an adapter registration names (the default model when none): 400
    when no worker serves it."""
    name = base_model or "default"
    group = fleet.resolve(name)
    if group is None:
        raise APIError(
            400,
            f"no worker serves the base model '{name}'",
            code="invalid_adapter",
            param="base_model",
        )
    return group


async def register_adapter(spec: AdapterCreate, registry: TenantRegistry, fleet: Fleet) -> Adapter:
    """Check that the base model's engine can serve the adapter (400 if not) and register
    it as a new version for that model."""
    group = base_group(fleet, spec.base_model)
    await check_adapter(spec.path, spec.name, group.info)
    return await registry.register_adapter(spec, group.model_id)


def check_model(group: ModelGroup, model: str, policy: Policy) -> None:
    """403 unless the plan includes the model (by the name asked for, or its id)."""
    if not (policy.allows_model(model) or policy.allows_model(group.model_id)):
        raise APIError(
            403,
            f"your plan does not include the model '{model}'",
            type="permission_error",
            code="model_not_allowed",
            param="model",
        )


async def check_adapter(path: str, name: str, info: ModelInfo) -> None:
    """Reject (400, one clear line) an adapter the engine could not serve: unreadable or
    corrupt files, unsupported modules, shapes that do not fit this base model, a rank
    above the engine's slots. Reading the files takes torch, which the gateway imports
    only here, for its first adapter."""
    from engine.lora.adapter import AdapterError, load_adapter  # noqa: PLC0415

    config = ModelConfig(
        vocab_size=info.vocab_size,
        hidden_size=info.hidden_size,
        intermediate_size=info.intermediate_size,
        num_layers=info.num_layers,
        num_heads=info.num_heads,
        num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim,
        max_position_embeddings=info.max_model_len,
    )
    try:
        adapter = await asyncio.to_thread(load_adapter, path, config, name=name)
    except AdapterError as exc:
        raise APIError(400, str(exc), code="invalid_adapter", param="path") from None
    if info.max_lora_rank and adapter.rank > info.max_lora_rank:
        raise APIError(
            400,
            f"{name}: rank {adapter.rank} exceeds the engine's max_lora_rank {info.max_lora_rank}",
            code="invalid_adapter",
            param="path",
        )


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
    base_model: str | None = None


async def register_upload(
    upload: AdapterUpload, registry: TenantRegistry, fleet: Fleet, root: Path
) -> Adapter:
    """Write the uploaded files to a fresh directory under `root`, check them like a path
    registration (400 and nothing kept when the engine could not serve them), register."""
    try:
        allowed = None
        if upload.allowed_tenants:
            allowed = msgspec.json.decode(upload.allowed_tenants, type=list[str])
        spec = AdapterCreate(
            name=upload.name, path="", allowed_tenants=allowed, base_model=upload.base_model
        )
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise bad_request(f"invalid adapter upload: {exc}", code="invalid_adapter") from None
    group = base_group(fleet, spec.base_model)
    directory = root / f"{spec.name}-{secrets.token_hex(8)}"
    try:
        await asyncio.to_thread(directory.mkdir, parents=True)
        for part, filename in (
            (upload.adapter_config, "adapter_config.json"),
            (upload.adapter_model, "adapter_model.safetensors"),
        ):
            async with aiofiles.open(directory / filename, "wb") as out:
                while chunk := await part.read(_CHUNK):
                    await out.write(chunk)
        await check_adapter(str(directory), spec.name, group.info)
    except BaseException:
        await asyncio.to_thread(shutil.rmtree, directory, True)
        raise
    finally:
        await upload.adapter_config.close()
        await upload.adapter_model.close()
    created = msgspec.structs.replace(spec, path=str(directory.resolve()))
    return await registry.register_adapter(created, group.model_id)

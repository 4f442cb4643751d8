"""Everything a gateway replica holds, opened in the app lifespan and kept on `app.state`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.tokenizer import Tokenizer
from gateway.adapters import AdapterResolver
from gateway.engines import EnginePool
from gateway.metrics import GatewayMetrics
from gateway.pipeline import Pipeline
from gateway.prepare import Preparer
from gateway.responses import Renderer
from gateway.settings import GatewaySettings
from policies.admission import Admission
from tenants.keys import KeyManager
from tenants.ledger import Ledger, LedgerWriter
from tenants.registry import TenantRegistry


@dataclass
class GatewayState:
    settings: GatewaySettings
    redis: Any  # redis.asyncio.Redis
    registry: TenantRegistry
    keys: KeyManager
    admission: Admission
    ledger: Ledger
    ledger_writer: LedgerWriter
    engines: EnginePool
    tokenizer: Tokenizer
    preparer: Preparer
    adapters: AdapterResolver
    pipeline: Pipeline
    renderer: Renderer
    metrics: GatewayMetrics
    started_at: float

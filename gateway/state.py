"""Everything a gateway replica holds, opened in the app lifespan and kept on `app.state`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.adapters import AdapterResolver
from gateway.alerts import AlertDispatcher
from gateway.fleet import Fleet
from gateway.metrics import GatewayMetrics
from gateway.pipeline import Pipeline
from gateway.settings import GatewaySettings
from policies.admission import Admission
from tenants.alerts import AlertStore
from tenants.keys import KeyManager
from tenants.ledger import Ledger, LedgerWriter
from tenants.registry import TenantRegistry
from tenants.residency import ResidencyLedger


@dataclass
class GatewayState:
    settings: GatewaySettings
    redis: Any  # redis.asyncio.Redis
    registry: TenantRegistry
    keys: KeyManager
    admission: Admission
    ledger: Ledger
    ledger_writer: LedgerWriter
    fleet: Fleet
    adapters: AdapterResolver
    pipeline: Pipeline
    metrics: GatewayMetrics
    residency: ResidencyLedger
    started_at: float
    alerts: AlertStore  # raise_alert(...) from anywhere: tenants/alerts.py
    dispatcher: AlertDispatcher

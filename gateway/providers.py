"""Litestar dependency providers: each handler names the services it uses (`registry`,
`keys`, `fleet`, ...) and gets them from what the app's lifespan opened on `app.state`."""

from __future__ import annotations

from litestar.datastructures import State
from litestar.di import Provide

from gateway.adapters import AdapterResolver
from gateway.fleet import Fleet
from gateway.metrics import GatewayMetrics
from gateway.pipeline import Pipeline
from gateway.settings import GatewaySettings
from gateway.state import GatewayState
from tenants.alerts import AlertStore
from tenants.keys import KeyManager
from tenants.ledger import Ledger
from tenants.registry import TenantRegistry
from tenants.residency import ResidencyLedger


def _opened(state: State) -> GatewayState:
    opened: GatewayState = state.gateway
    return opened


def provide_registry(state: State) -> TenantRegistry:
    return _opened(state).registry


def provide_keys(state: State) -> KeyManager:
    return _opened(state).keys


def provide_fleet(state: State) -> Fleet:
    return _opened(state).fleet


def provide_pipeline(state: State) -> Pipeline:
    return _opened(state).pipeline


def provide_adapters(state: State) -> AdapterResolver:
    return _opened(state).adapters


def provide_ledger(state: State) -> Ledger:
    return _opened(state).ledger


def provide_metrics(state: State) -> GatewayMetrics:
    return _opened(state).metrics


def provide_settings(state: State) -> GatewaySettings:
    return _opened(state).settings


def provide_store(state: State) -> object:
    return _opened(state).redis


def provide_residency(state: State) -> ResidencyLedger:
    return _opened(state).residency


def provide_alerts(state: State) -> AlertStore:
    return _opened(state).alerts


def provide_started_at(state: State) -> float:
    return _opened(state).started_at


DEPENDENCIES = {
    name: Provide(fn, sync_to_thread=False)
    for name, fn in (
        ("registry", provide_registry),
        ("keys", provide_keys),
        ("fleet", provide_fleet),
        ("pipeline", provide_pipeline),
        ("adapters", provide_adapters),
        ("ledger", provide_ledger),
        ("metrics", provide_metrics),
        ("settings", provide_settings),
        ("store", provide_store),
        ("residency", provide_residency),
        ("started_at", provide_started_at),
        ("alerts", provide_alerts),
    )
}

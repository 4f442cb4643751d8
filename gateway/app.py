"""The Litestar application: routes, error shapes, and the lifespan that opens (and drains)
every resource a replica holds."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
from litestar import Litestar, Request
from litestar.datastructures import MutableScopeHeaders
from litestar.enums import RequestEncodingType
from litestar.openapi import OpenAPIConfig
from litestar.types import Message, Scope

from gateway.adapters import AdapterResolver
from gateway.alerts import AlertDispatcher
from gateway.audit import record_admin_change
from gateway.errors import APIError, exception_handlers, invalid_field, invalid_json
from gateway.fleet import Fleet
from gateway.metrics import GatewayMetrics
from gateway.openai_types import MAX_JSON_DEPTH, too_deep
from gateway.pipeline import Pipeline
from gateway.prices import PriceCache
from gateway.providers import DEPENDENCIES
from gateway.residency import record_forever, record_once
from gateway.router import RoutingPolicy
from gateway.routes import admin, alerts, ops, spend
from gateway.routes import residency as residency_routes
from gateway.routes.openai import OpenAIController, TokenizerController
from gateway.routes.tokens import AuditController, TokenController
from gateway.settings import GatewaySettings
from gateway.shutdown import ShutdownStep, budget_s, run_steps
from gateway.state import GatewayState
from gateway.ui import console_router, template_config, to_console
from policies.admission import Admission
from tenants.alerts import AlertStore
from tenants.journal import LedgerJournal
from tenants.keys import KeyManager
from tenants.ledger import Ledger, LedgerWriter
from tenants.registry import TenantRegistry
from tenants.residency import ResidencyLedger
from tenants.store import cancel_and_wait, connect

log = logging.getLogger(__name__)


async def _add_state_headers(message: Message, scope: Scope) -> None:
    """Every response (errors and streams included) carries the request's id and limits, and
    is counted."""
    if message["type"] != "http.response.start":
        return
    headers = (scope.get("state") or {}).get("response_headers") or {}
    mutable = MutableScopeHeaders.from_message(message)
    for name, value in headers.items():
        if name not in mutable:
            mutable[name] = value
    if "x-request-id" not in mutable:  # rejected before a handler named the request
        mutable["x-request-id"] = f"req-{uuid.uuid4().hex}"
    gateway: GatewayState | None = getattr(scope["app"].state, "gateway", None)
    if gateway is not None:
        gateway.metrics.responded()


@asynccontextmanager
async def _lifespan(app: Litestar) -> AsyncIterator[None]:
    settings: GatewaySettings = app.state.settings
    assert settings.redis_url is not None, "the gateway needs a store URL"
    redis = connect(settings.redis_url)
    keys = KeyManager(redis, cache_ttl_s=settings.auth_cache_ttl_s)
    await keys.start()
    registry = TenantRegistry(redis)
    ledger = Ledger(redis)
    journal = LedgerJournal(Path(settings.data_dir) / "ledger-journal")
    writer = LedgerWriter(ledger, journal=journal)
    writer.start()
    fleet = Fleet(
        addresses=settings.engine_addresses,
        auth=settings.worker_auth,
        redis=redis,
        cache_dir=settings.cache_dir,
        policy=RoutingPolicy(settings.routing),
        default_model=settings.model,
        aliases=settings.alias_targets(),
        disagg_min_prompt_tokens=settings.disagg_min_prompt_tokens,
        disagg_transport=settings.disagg_transport,
    )
    metrics = GatewayMetrics(process_index=settings.process_index, shared_dir=settings.metrics_dir)
    alert_store = AlertStore(redis, on_raised=metrics.alert_raised)
    dispatcher = AlertDispatcher(alert_store, metrics, settings.alerts)
    fleet.on_lost = dispatcher.worker_left
    residency = ResidencyLedger(redis)
    admission = Admission(redis, lease_ttl_s=settings.lease_ttl_s)
    pipeline = Pipeline(fleet, admission, writer, metrics, prices=PriceCache(registry))
    recorder: asyncio.Task[None] | None = None
    try:
        await dispatcher.start()
        await fleet.start()
        app.state.gateway = GatewayState(
            settings=settings,
            redis=redis,
            registry=registry,
            keys=keys,
            admission=pipeline.admission,
            ledger=ledger,
            ledger_writer=writer,
            fleet=fleet,
            adapters=AdapterResolver(registry, fleet),
            pipeline=pipeline,
            metrics=metrics,
            residency=residency,
            started_at=time.time(),
            alerts=alert_store,
            dispatcher=dispatcher,
        )
        recorder = asyncio.create_task(
            record_forever(fleet, residency, settings.kv_residency_interval_s), name="kv-residency"
        )
        log.info("gateway ready: serving %s", ", ".join(sorted(fleet.groups)))
        yield
    finally:
        await run_steps(
            [
                ShutdownStep("settling running requests", pipeline.drain, SETTLE_S),
                ShutdownStep(
                    "writing usage records", partial(_write_usage, writer, journal), USAGE_S
                ),
                ShutdownStep(
                    "recording KV residency",
                    partial(_record_residency, recorder, fleet, residency),
                    RESIDENCY_S,
                ),
                ShutdownStep("closing the key cache", keys.stop, CLOSE_S),
                ShutdownStep("closing the alert dispatcher", dispatcher.close, CLOSE_S),
                ShutdownStep("closing the fleet", fleet.close, CLOSE_S),
                ShutdownStep("closing the store connection", redis.aclose, CLOSE_S),
            ]
        )


# the bounds of the stop's steps: running requests settle within `Pipeline.drain`'s 5 s, usage
# is written within `USAGE_DRAIN_S` (usage is written before anything else is closed, and
# whether or not the requests settled in time)
SETTLE_S = 6.0
USAGE_DRAIN_S = 10.0
USAGE_S = USAGE_DRAIN_S + 2.0
RESIDENCY_S = 5.0
CLOSE_S = 3.0
# one entry per step of `_lifespan`'s stop
SHUTDOWN_BUDGET_S = budget_s([SETTLE_S, USAGE_S, RESIDENCY_S, CLOSE_S, CLOSE_S, CLOSE_S, CLOSE_S])


async def _write_usage(writer: LedgerWriter, journal: LedgerJournal) -> None:
    """Write the usage records still queued; what the store does not take in time stays in
    the journal for the next start."""
    left = await writer.drain(timeout=USAGE_DRAIN_S)
    writer.close()
    if left:
        log.error(
            "%d usage records could not be written before shutdown; they are kept in %s "
            "and written at the next start",
            left,
            journal.root,
        )


async def _record_residency(
    recorder: asyncio.Task[None] | None, fleet: Fleet, residency: ResidencyLedger
) -> None:
    """Stop the periodic recorder, then record what was held up to the stop."""
    if recorder is None:
        return
    await cancel_and_wait(recorder)
    await record_once(fleet, residency)


async def _decode_json_strictly(request: Request[Any, Any, Any]) -> None:
    """Litestar converts a JSON body into the handler's `data` type leniently (`"5"` becomes
    5, `"true"` True). OpenAI's API answers 400 to a wrong type, and so does Strata: the body
    is decoded strictly first, and Litestar's own parse then reads the cached bytes."""
    field = request.route_handler.parsed_data_field
    kwarg = field.kwarg_definition if field is not None else None
    if field is None or getattr(kwarg, "media_type", None) is not RequestEncodingType.JSON:
        return
    try:
        value = msgspec.json.decode(await request.body(), type=field.annotation)
    except msgspec.ValidationError as exc:
        raise invalid_field(exc) from exc
    except msgspec.DecodeError as exc:
        raise invalid_json(exc) from exc
    except RecursionError:
        raise too_deep_error("the request body") from None
    for name in _FREE_FORM_FIELDS:  # JSON the gateway walks itself
        if too_deep(msgspec.to_builtins(getattr(value, name, None))):
            raise too_deep_error(name, param=name)


# request fields typed as any JSON
_FREE_FORM_FIELDS = ("response_format", "tools", "functions", "function_call")


def too_deep_error(what: str, *, param: str | None = None) -> APIError:
    return APIError(
        400,
        f"{what} nests JSON more than {MAX_JSON_DEPTH} levels deep",
        code="json_too_deep",
        param=param,
    )


def create_app(settings: GatewaySettings) -> Litestar:
    app = Litestar(
        route_handlers=[
            OpenAIController,
            TokenizerController,
            admin.TenantController,
            admin.KeyController,
            admin.AdapterController,
            admin.PriceController,
            admin.UsageController,
            admin.WorkerController,
            residency_routes.KVPriceController,
            residency_routes.KVResidencyController,
            TokenController,
            AuditController,
            spend.TenantBudgetController,
            spend.KeyBudgetController,
            spend.TenantSpendController,
            spend.BudgetEventController,
            alerts.WebhookController,
            ops.health,
            ops.ready,
            ops.metrics,
            console_router(),
            to_console,
        ],
        lifespan=[_lifespan],
        dependencies=DEPENDENCIES,
        exception_handlers=exception_handlers(),
        before_request=_decode_json_strictly,
        before_send=[_add_state_headers, record_admin_change],
        template_config=template_config(),
        openapi_config=OpenAPIConfig(title="Strata", version="0.1.0", path="/schema"),
        request_max_body_size=settings.max_body_bytes,
        logging_config=None,  # logs go through structlog (gateway/logs.py), set by the CLI
        debug=False,
    )
    app.state.settings = settings
    return app

"""The operator's webhooks for alerts: register (the signing secret is shown once), list,
delete, send a test event, read the delivery log. Every route needs the admin token."""

from __future__ import annotations

import msgspec
from litestar import Controller, delete, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, JSONBody

from gateway.auth import requires_admin_token
from gateway.errors import bad_request
from tenants.alerts import (
    LOG_SIZE,
    AlertStore,
    Delivery,
    Webhook,
    WebhookCreate,
    WebhookCreated,
    WebhookFieldError,
)


class TestSent(msgspec.Struct, kw_only=True, frozen=True):
    event_id: str  # the idempotency id the receiver gets as X-Strata-Delivery


async def register(alerts: AlertStore, spec: WebhookCreate) -> WebhookCreated:
    """Register a webhook; a refused field is a 400 naming it."""
    try:
        return await alerts.create_webhook(spec)
    except WebhookFieldError as exc:
        raise bad_request(str(exc), param=exc.field, code="invalid_value") from None


class WebhookController(Controller):
    path = "/admin/webhooks"
    guards = [requires_admin_token]  # noqa: RUF012
    tags = ["admin"]  # noqa: RUF012

    @post("/")
    async def create(
        self, alerts: NamedDependency[AlertStore], data: JSONBody[WebhookCreate]
    ) -> WebhookCreated:
        return await register(alerts, data)

    @get("/")
    async def list_all(self, alerts: NamedDependency[AlertStore]) -> list[Webhook]:
        return await alerts.list_webhooks()

    @delete("/{webhook_id:str}")
    async def remove(self, alerts: NamedDependency[AlertStore], webhook_id: FromPath[str]) -> None:
        await alerts.delete_webhook(webhook_id)

    @post("/{webhook_id:str}/test", status_code=202)
    async def send_test(
        self, alerts: NamedDependency[AlertStore], webhook_id: FromPath[str]
    ) -> TestSent:
        """Queue a `test` event for this webhook only."""
        return TestSent(event_id=await alerts.send_test(webhook_id))

    @get("/{webhook_id:str}/deliveries")
    async def deliveries(
        self,
        alerts: NamedDependency[AlertStore],
        webhook_id: FromPath[str],
        limit: FromQuery[int] = 50,
    ) -> list[Delivery]:
        """The latest delivery attempts, newest first."""
        if not 1 <= limit <= LOG_SIZE:
            raise bad_request(f"limit must be between 1 and {LOG_SIZE}", param="limit")
        return await alerts.deliveries(webhook_id, limit)

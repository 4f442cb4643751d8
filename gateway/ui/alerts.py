"""Console page for alerts: the webhooks (register one, its signing secret shown once; send
a test event; delete) and each webhook's recent delivery attempts."""

from __future__ import annotations

import time
from typing import Annotated, Any

from litestar import Controller, Request, get, post
from litestar.di import NamedDependency
from litestar.enums import RequestEncodingType
from litestar.params import Body, FromPath
from litestar.response import Template

from gateway.ui import forms
from gateway.ui.render import FORM_ERRORS, page, refusal
from gateway.ui.session import requires_console_session
from tenants.alerts import EVENT_TYPES, AlertStore, WebhookCreate, WebhookCreated, WebhookFieldError

FormBody = Annotated[dict[str, Any], Body(media_type=RequestEncodingType.URL_ENCODED)]


def webhook_spec(form: forms.Form) -> WebhookCreate:
    spec = forms.build(
        WebhookCreate,
        {
            "url": forms.text(form, "url", required=True),
            "events": forms.names(form, "events") or ["*"],
            "description": forms.text(form, "description") or "",
        },
    )
    try:
        spec.check()
    except WebhookFieldError as exc:
        raise forms.FormError(exc.field, str(exc)) from None
    return spec


class AlertPages(Controller):
    path = "/alerts"
    guards = [requires_console_session]  # noqa: RUF012

    async def _section(
        self,
        request: Request[Any, Any, Any],
        alerts: AlertStore,
        *,
        template: str = "_webhooks.html",
        status: int = 200,
        created: WebhookCreated | None = None,
        notice: str | None = None,
        error: forms.FormError | None = None,
    ) -> Template:
        return page(
            request,
            template,
            status=status,
            webhooks=await alerts.list_webhooks(),
            event_types=EVENT_TYPES,
            created=created,
            notice=notice,
            error=error,
        )

    @get("/", opt={"nav": "Alerts", "nav_order": 70})
    async def list_all(
        self, request: Request[Any, Any, Any], alerts: NamedDependency[AlertStore]
    ) -> Template:
        return await self._section(request, alerts, template="alerts.html")

    @post("/")
    async def add(
        self, request: Request[Any, Any, Any], alerts: NamedDependency[AlertStore], data: FormBody
    ) -> Template:
        try:
            created = await alerts.create_webhook(webhook_spec(data))
        except FORM_ERRORS as exc:
            return await self._section(request, alerts, status=400, error=refusal(exc))
        return await self._section(request, alerts, created=created)

    @post("/{webhook_id:str}/test")
    async def send_test(
        self,
        request: Request[Any, Any, Any],
        alerts: NamedDependency[AlertStore],
        webhook_id: FromPath[str],
    ) -> Template:
        event_id = await alerts.send_test(webhook_id)
        return await self._section(request, alerts, notice=f"Test event {event_id} queued.")

    @post("/{webhook_id:str}/delete")
    async def remove(
        self,
        request: Request[Any, Any, Any],
        alerts: NamedDependency[AlertStore],
        webhook_id: FromPath[str],
    ) -> Template:
        await alerts.delete_webhook(webhook_id)
        return await self._section(request, alerts, notice=f"Webhook {webhook_id} deleted.")

    @get("/{webhook_id:str}")
    async def deliveries(
        self,
        request: Request[Any, Any, Any],
        alerts: NamedDependency[AlertStore],
        webhook_id: FromPath[str],
    ) -> Template:
        webhook = await alerts.get_webhook(webhook_id)
        return page(
            request,
            "webhook.html",
            webhook=webhook,
            deliveries=await alerts.deliveries(webhook_id, 50),
            now=time.time(),
        )

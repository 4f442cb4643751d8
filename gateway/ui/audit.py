"""Console page for the audit log: every admin change, from the API and from the console,
newest first and a page at a time (the cursor is the last entry shown), filtered by the
id it concerns, with each actor's token name beside its id."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, get
from litestar.di import NamedDependency, Provide
from litestar.exceptions import ValidationException
from litestar.params import FromQuery
from litestar.response import Template

from gateway.routes.tokens import CURSOR, provide_admin_tokens, provide_audit_log
from gateway.ui.render import page
from gateway.ui.session import BOOTSTRAP, requires_console_session
from tenants.admin_tokens import AdminTokens
from tenants.audit_log import AuditLog

PER_PAGE = 50


class AuditPages(Controller):
    path = "/audit"
    guards = [requires_console_session]  # noqa: RUF012
    dependencies = {  # noqa: RUF012
        "audit": Provide(provide_audit_log, sync_to_thread=False),
        "tokens": Provide(provide_admin_tokens, sync_to_thread=False),
    }

    @get("/", opt={"nav": "Audit log", "nav_order": 80})
    async def list_all(
        self,
        request: Request[Any, Any, Any],
        audit: NamedDependency[AuditLog],
        tokens: NamedDependency[AdminTokens],
        target: FromQuery[str] = "",
        before: FromQuery[str | None] = None,
    ) -> Template:
        if before is not None and not CURSOR.fullmatch(before):
            problem = "must be the cursor of an earlier page"
            raise ValidationException(problem, extra=[{"key": "before", "message": problem}])
        about = target.strip() or None
        entries, older = await audit.latest(target=about, limit=PER_PAGE, before=before)
        names = {t.id: t.name for t in await tokens.list_all()}
        names[BOOTSTRAP] = "bootstrap token"
        return page(
            request,
            "audit.html",
            entries=entries,
            names=names,
            target=about or "",
            older=older,
            is_first=before is None,
        )

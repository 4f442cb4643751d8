"""The admin API's own credentials and record: admin tokens (`/admin/tokens`) and the audit
log of admin changes (`/admin/audit`)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Controller, Request, Response, delete, get, post
from litestar.datastructures import State
from litestar.di import NamedDependency, Provide
from litestar.params import FromPath, FromQuery, JSONBody
from litestar.response import Stream

from gateway.admin_access import AdminPrincipal
from gateway.auth import requires_admin_token
from gateway.errors import bad_request
from gateway.routes import time_window
from tenants.admin_tokens import AdminToken, AdminTokenCreate, AdminTokenCreated, AdminTokens
from tenants.audit_log import AuditEntry, AuditLog

MAX_PAGE = 1000
_CURSOR = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")


def provide_admin_tokens(state: State) -> AdminTokens:
    return AdminTokens(state.gateway.redis)


def provide_audit_log(state: State) -> AuditLog:
    return AuditLog(state.gateway.redis)


class TokenController(Controller):
    path = "/admin/tokens"
    guards = [requires_admin_token]  # noqa: RUF012
    dependencies = {"tokens": Provide(provide_admin_tokens, sync_to_thread=False)}  # noqa: RUF012
    tags = ["admin"]  # noqa: RUF012

    @post("/")
    async def create(
        self,
        request: Request[Any, Any, Any],
        tokens: NamedDependency[AdminTokens],
        data: JSONBody[AdminTokenCreate],
    ) -> AdminTokenCreated:
        """Issue a token with a role; the token itself is in this answer only."""
        principal: AdminPrincipal = request.state.admin
        return await tokens.create(data, created_by=principal.actor)

    @get("/")
    async def list_all(self, tokens: NamedDependency[AdminTokens]) -> list[AdminToken]:
        return await tokens.list_all()

    @get("/{token_id:str}")
    async def read(
        self, tokens: NamedDependency[AdminTokens], token_id: FromPath[str]
    ) -> AdminToken:
        return await tokens.get(token_id)

    @delete("/{token_id:str}", status_code=200)
    async def revoke(
        self, tokens: NamedDependency[AdminTokens], token_id: FromPath[str]
    ) -> AdminToken:
        """Revoke at once, on every replica; the record stays, with `revoked_at`."""
        return await tokens.revoke(token_id)


class AuditPage(msgspec.Struct, kw_only=True):
    data: list[AuditEntry]
    next: str | None  # pass as `after` for the next page; None: no more


class AuditController(Controller):
    path = "/admin/audit"
    guards = [requires_admin_token]  # noqa: RUF012
    dependencies = {"audit": Provide(provide_audit_log, sync_to_thread=False)}  # noqa: RUF012
    tags = ["admin"]  # noqa: RUF012

    @get("/")
    async def page(
        self,
        audit: NamedDependency[AuditLog],
        start: FromQuery[str | None] = None,
        end: FromQuery[str | None] = None,
        target: FromQuery[str | None] = None,
        limit: FromQuery[int] = 100,
        after: FromQuery[str | None] = None,
    ) -> AuditPage:
        """Entries of [start, end) about `target`, oldest first, `limit` to a page."""
        begin, stop = time_window(start, end)
        if not 1 <= limit <= MAX_PAGE:
            raise bad_request(f"limit must be in 1..{MAX_PAGE}", param="limit")
        if after is not None and not _CURSOR.fullmatch(after):
            raise bad_request("after must be the `next` of a previous page", param="after")
        entries, cursor = await audit.page(begin, stop, target=target, limit=limit, after=after)
        return AuditPage(data=entries, next=cursor)

    @get("/export")
    async def export(
        self,
        audit: NamedDependency[AuditLog],
        start: FromQuery[str | None] = None,
        end: FromQuery[str | None] = None,
        target: FromQuery[str | None] = None,
    ) -> Response[Any]:
        """Every entry of [start, end) about `target`, as NDJSON, streamed."""
        begin, stop = time_window(start, end)
        return Stream(
            _ndjson(audit.scan(begin, stop, target=target)),
            media_type="application/x-ndjson",
            headers={"content-disposition": 'attachment; filename="audit.ndjson"'},
        )


async def _ndjson(entries: AsyncIterator[AuditEntry]) -> AsyncIterator[bytes]:
    async for entry in entries:
        yield msgspec.json.encode(entry) + b"\n"

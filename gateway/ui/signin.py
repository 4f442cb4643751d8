"""Signing in to the console with an admin token, and out again. The bootstrap token
(STRATA_ADMIN_TOKEN) signs in as `bootstrap` with role admin; an issued token signs in as its
id with its role. A browser gets an anonymous session (its CSRF token) with the sign-in form,
and a fresh signed-in one, new CSRF token included, once the token is right."""

from __future__ import annotations

import hmac
import logging
from typing import Annotated, Any

import redis.asyncio as aioredis
from litestar import Controller, Request, Response, get, post
from litestar.enums import RequestEncodingType
from litestar.params import Body, FromQuery
from litestar.response import Redirect

from gateway.admin_access import AdminPrincipal, can_access
from gateway.auth import gateway_state
from gateway.ui.render import nav_items, page
from gateway.ui.session import (
    BOOTSTRAP,
    ConsoleRefusedError,
    admin_token_of,
    current_session,
    new_session,
    signed_in_principal,
    with_session,
)
from tenants.admin_tokens import TOKEN_PATTERN, AdminTokens, Role

log = logging.getLogger(__name__)

FormBody = Annotated[dict[str, Any], Body(media_type=RequestEncodingType.URL_ENCODED)]
SIGN_IN = {"audit_action": "console.sign_in"}
SIGN_OUT = {"audit_action": "console.sign_out"}


def next_path(value: object) -> str:
    """Where to go after signing in: a console path only (never another site)."""
    if not isinstance(value, str) or not value.startswith("/ui"):
        return "/ui"
    if value.startswith("/ui/signin") or "//" in value or "\\" in value:
        return "/ui"
    return value


def landing(request: Request[Any, Any, Any], role: Role, target: str) -> str:
    """`target`, unless it is a page the role may not see: then the role's first page."""
    nav = nav_items(request.app)
    asked = next((item for item in nav if item.path == target.partition("?")[0]), None)
    if asked is None or can_access(role, asked.access):
        return target
    return next((item.path for item in nav if can_access(role, item.access)), target)


async def authenticate(
    request: Request[Any, Any, Any], presented: str, bootstrap: str
) -> tuple[AdminPrincipal, str] | None:
    """The principal and display name a presented token signs in as, or None."""
    if hmac.compare_digest(presented.encode(), bootstrap.encode()):
        return AdminPrincipal(BOOTSTRAP, Role.ADMIN), "bootstrap token"
    if not TOKEN_PATTERN.fullmatch(presented):
        return None
    token = await AdminTokens(gateway_state(request).redis).authenticate(presented)
    return None if token is None else (AdminPrincipal(token.id, token.role), token.name)


class SignInController(Controller):
    path = "/"

    @get("/signin")
    async def form(
        self, request: Request[Any, Any, Any], next: FromQuery[str | None] = None
    ) -> Response[Any]:
        session = current_session(request)
        if session is not None and session.signed_in:
            if await signed_in_principal(request) is not None:
                return Redirect(next_path(next), status_code=303)
            session = None  # its token was revoked: sign in again
        if session is None:
            session = new_session(signed_in=False)
            request.state.console_session = session
        disabled = admin_token_of(request) is None
        shown = page(request, "signin.html", next=next_path(next), disabled=disabled)
        return with_session(shown, request, session)

    @post("/signin", status_code=303, opt=SIGN_IN)
    async def sign_in(self, request: Request[Any, Any, Any], data: FormBody) -> Response[Any]:
        bootstrap = admin_token_of(request)
        presented = data.get("token")
        presented = presented.strip() if isinstance(presented, str) else ""
        target = next_path(data.get("next"))
        try:
            found = None if bootstrap is None else await authenticate(request, presented, bootstrap)
        except (aioredis.RedisError, OSError):
            log.exception("console: the token store is unreachable")
            message = "The token store is unreachable. Try again shortly."
            return page(request, "signin.html", status=503, next=target, error=message)
        if found is None:
            log.warning("console: refused a sign-in from %s", request.client)
            message = "That admin token is not right." if presented else "Enter the admin token."
            return page(
                request,
                "signin.html",
                status=401,
                next=target,
                disabled=bootstrap is None,
                error=message,
            )
        principal, name = found
        request.state.admin = principal  # the audit log records who signed in
        session = new_session(signed_in=True, principal=principal, name=name)
        goes_to = landing(request, principal.role, target)
        return with_session(Redirect(goes_to, status_code=303), request, session)

    @post("/signout", status_code=303, opt=SIGN_OUT)
    async def sign_out(self, request: Request[Any, Any, Any]) -> Response[Any]:
        try:
            principal = await signed_in_principal(request)
        except ConsoleRefusedError:  # the store is down: sign out all the same
            principal = None
        if principal is not None:
            request.state.admin = principal
        return with_session(
            Redirect("/ui/signin", status_code=303), request, new_session(signed_in=False)
        )

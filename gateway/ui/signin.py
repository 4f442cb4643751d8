"""Signing in to the console with the admin token, and out again. A browser gets an
anonymous session (its CSRF token) with the sign-in form, and a fresh signed-in one, new
CSRF token included, once the token is right."""

from __future__ import annotations

import hmac
import logging
from typing import Annotated, Any

from litestar import Controller, Request, Response, get, post
from litestar.enums import RequestEncodingType
from litestar.params import Body, FromQuery
from litestar.response import Redirect

from gateway.ui.render import page
from gateway.ui.session import admin_token_of, current_session, new_session, with_session

log = logging.getLogger(__name__)

FormBody = Annotated[dict[str, Any], Body(media_type=RequestEncodingType.URL_ENCODED)]


def next_path(value: object) -> str:
    """Where to go after signing in: a console path only (never another site)."""
    if not isinstance(value, str) or not value.startswith("/ui"):
        return "/ui"
    if value.startswith("/ui/signin") or "//" in value or "\\" in value:
        return "/ui"
    return value


class SignInController(Controller):
    path = "/"

    @get("/signin")
    async def form(
        self, request: Request[Any, Any, Any], next: FromQuery[str | None] = None
    ) -> Response[Any]:
        session = current_session(request)
        if session is not None and session.signed_in:
            return Redirect(next_path(next), status_code=303)
        if session is None:
            session = new_session(signed_in=False)
            request.state.console_session = session
        disabled = admin_token_of(request) is None
        shown = page(request, "signin.html", next=next_path(next), disabled=disabled)
        return with_session(shown, request, session)

    @post("/signin", status_code=303)
    async def sign_in(self, request: Request[Any, Any, Any], data: FormBody) -> Response[Any]:
        expected = admin_token_of(request)
        presented = data.get("token")
        presented = presented.strip() if isinstance(presented, str) else ""
        if expected is None or not hmac.compare_digest(presented.encode(), expected.encode()):
            log.warning("console: refused a sign-in from %s", request.client)
            message = "That admin token is not right." if presented else "Enter the admin token."
            return page(
                request,
                "signin.html",
                status=401,
                next=next_path(data.get("next")),
                disabled=expected is None,
                error=message,
            )
        session = new_session(signed_in=True)
        return with_session(
            Redirect(next_path(data.get("next")), status_code=303), request, session
        )

    @post("/signout", status_code=303)
    async def sign_out(self, request: Request[Any, Any, Any]) -> Response[Any]:
        return with_session(
            Redirect("/ui/signin", status_code=303), request, new_session(signed_in=False)
        )

"""The console's session: a stateless cookie signed with a key derived from the admin token
(so every replica accepts it, and changing the token signs everyone out), holding who signed
in (a stored admin token's id and role, or `bootstrap`), when that lapses, and the session's
CSRF token. The guards live here too: a live signed-in session whose role gives the page's
access level, and a matching CSRF token on every form post."""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from typing import Any

import msgspec
import redis.asyncio as aioredis
from litestar import Request, Response
from litestar.connection import ASGIConnection
from litestar.datastructures import Cookie
from litestar.handlers.base import BaseRouteHandler

from gateway.admin_access import AdminAccess, AdminPrincipal, access_of, can_access, is_mutating
from gateway.auth import gateway_state
from tenants.admin_tokens import AdminTokens, Role

COOKIE_NAME = "strata_console"
CSRF_FIELD = "_csrf"
CSRF_HEADER = "x-csrf-token"
SIGNED_IN_TTL_S = 12 * 3600.0
ANONYMOUS_TTL_S = 3600.0
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_KEY_CONTEXT = b"strata console session v2"
BOOTSTRAP = "bootstrap"  # the actor of a session opened with the settings' admin token


class Session(msgspec.Struct, frozen=True, kw_only=True):
    """What the cookie holds (in the clear, signed)."""

    csrf: str
    signed_in: bool
    expires_at: float
    actor: str | None = None  # the admin token's id, or `bootstrap`; None when anonymous
    name: str | None = None  # the token's name, shown in the nav
    role: Role | None = None


class SignInRequiredError(Exception):
    """A console page asked for without a signed-in session."""


class CsrfRejectedError(Exception):
    """A console form posted without this session's CSRF token."""


class ConsoleRefusedError(Exception):
    """A console request the session may not make (403), or that cannot be checked (503)."""

    def __init__(self, status: int, title: str, message: str) -> None:
        super().__init__(message)
        self.status, self.title, self.message = status, title, message


def session_key(admin_token: str) -> bytes:
    """The cookie's signing key: derived from the admin token, never the token itself."""
    return hmac.new(admin_token.encode(), _KEY_CONTEXT, hashlib.sha256).digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def new_session(
    *,
    signed_in: bool,
    now: float | None = None,
    principal: AdminPrincipal | None = None,
    name: str | None = None,
) -> Session:
    ttl = SIGNED_IN_TTL_S if signed_in else ANONYMOUS_TTL_S
    return Session(
        csrf=secrets.token_urlsafe(32),
        signed_in=signed_in,
        expires_at=(time.time() if now is None else now) + ttl,
        actor=principal.actor if principal is not None else None,
        name=name,
        role=principal.role if principal is not None else None,
    )


def encode_session(session: Session, key: bytes) -> str:
    payload = msgspec.json.encode(session)
    mac = hmac.new(key, payload, hashlib.sha256).digest()
    return f"{_b64(payload)}.{_b64(mac)}"


def decode_session(value: str | None, key: bytes, *, now: float | None = None) -> Session | None:
    """The session in `value`, or None when it is absent, forged, malformed or expired."""
    if not value:
        return None
    payload_text, _, mac_text = value.partition(".")
    try:
        payload, mac = _unb64(payload_text), _unb64(mac_text)
    except ValueError:
        return None
    if not hmac.compare_digest(mac, hmac.new(key, payload, hashlib.sha256).digest()):
        return None
    try:
        session = msgspec.json.decode(payload, type=Session)
    except msgspec.DecodeError:
        return None
    if session.expires_at <= (time.time() if now is None else now):
        return None
    return session


def session_cookie(session: Session, key: bytes, *, secure: bool) -> Cookie:
    """The cookie carrying `session`: HttpOnly, SameSite=Strict, scoped to the console."""
    return Cookie(
        key=COOKIE_NAME,
        value=encode_session(session, key),
        path="/ui",
        httponly=True,
        samesite="strict",
        secure=secure,
        max_age=int(session.expires_at - time.time()),
    )


def is_https(connection: ASGIConnection[Any, Any, Any, Any]) -> bool:
    forwarded = connection.headers.get("x-forwarded-proto", "")
    return connection.url.scheme == "https" or forwarded.lower() == "https"


def admin_token_of(connection: ASGIConnection[Any, Any, Any, Any]) -> str | None:
    token: str | None = connection.app.state.settings.admin_token
    return token


def current_session(connection: ASGIConnection[Any, Any, Any, Any]) -> Session | None:
    """The request's valid session (signed in or not), read once per request."""
    if "console_session" not in connection.scope.get("state", {}):
        token = admin_token_of(connection)
        value = connection.cookies.get(COOKIE_NAME)
        session = None if token is None else decode_session(value, session_key(token))
        connection.state.console_session = session
    found: Session | None = connection.state.console_session
    return found


def with_session(
    response: Response[Any], connection: ASGIConnection[Any, Any, Any, Any], session: Session
) -> Response[Any]:
    """`response` setting the session cookie (when the console is enabled)."""
    token = admin_token_of(connection)
    if token is not None:
        response.set_cookie(
            session_cookie(session, session_key(token), secure=is_https(connection))
        )
    return response


def cleared(response: Response[Any]) -> Response[Any]:
    response.delete_cookie(COOKIE_NAME, path="/ui")
    return response


async def signed_in_principal(
    connection: ASGIConnection[Any, Any, Any, Any],
) -> AdminPrincipal | None:
    """Who the request's session signed in as, if that still holds: a stored token is read
    from the store on every request, as the admin API's guard does, so a revoked token's
    session ends at its next request on every replica."""
    session = current_session(connection)
    if session is None or not session.signed_in or session.actor is None:
        return None
    if session.actor == BOOTSTRAP:
        return AdminPrincipal(BOOTSTRAP, Role.ADMIN)
    try:
        token = await AdminTokens(gateway_state(connection).redis).find_live(session.actor)
    except (aioredis.RedisError, OSError) as exc:
        message = "The token store is unreachable, so this session cannot be checked. Retry."
        raise ConsoleRefusedError(503, "Store unavailable", message) from exc
    return None if token is None else AdminPrincipal(token.id, token.role)


def console_refusal(role: Role, access: AdminAccess) -> str:
    """Why a session of `role` may not use a console route of level `access`."""
    if access is AdminAccess.WRITE:
        return f"Your role ({role}) is read-only: changes need an admin token with role admin."
    return (
        f"Your role ({role}) sees usage, spend and prices only: "
        "this page needs role viewer or admin."
    )


async def requires_console_session(
    connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler
) -> None:
    """Console pages need a live signed-in session (without one the browser is sent to sign
    in) whose role gives the route's access level (`gateway.admin_access`: every POST needs
    admin; a page declares `BILLING` to open it to billing). The principal is kept on
    `connection.state.admin` and a form's fields on `admin_body`, so the audit hook records
    console changes, and refused attempts, as it does the admin API's."""
    principal = await signed_in_principal(connection)
    if principal is None:
        raise SignInRequiredError
    connection.state.admin = principal
    if is_mutating(handler) and isinstance(connection, Request):
        form = await connection.form()
        fields = {k: v for k, v in form.items() if k != CSRF_FIELD and isinstance(v, str)}
        connection.state.admin_body = msgspec.json.encode(fields)
    access = access_of(handler)
    if not can_access(principal.role, access):
        raise ConsoleRefusedError(403, "Not allowed", console_refusal(principal.role, access))


async def requires_csrf_token(
    connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler
) -> None:
    """Every console POST carries its session's CSRF token, as the `_csrf` form field or the
    X-CSRF-Token header (htmx sends the header)."""
    if connection.scope.get("method", "GET") in _SAFE_METHODS:
        return
    session = current_session(connection)
    presented = connection.headers.get(CSRF_HEADER, "")
    if not presented and isinstance(connection, Request):
        form = await connection.form()
        field = form.get(CSRF_FIELD)
        presented = field if isinstance(field, str) else ""
    if session is None or not hmac.compare_digest(presented.encode(), session.csrf.encode()):
        raise CsrfRejectedError

"""Guards: a tenant API key for /v1, an admin token with a role for /admin."""

from __future__ import annotations

import hmac
from typing import Any

import redis.asyncio as aioredis
from litestar import Request
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from gateway.admin_access import AdminPrincipal, access_of, can_access, is_mutating, refusal
from gateway.errors import APIError
from gateway.state import GatewayState
from tenants.admin_tokens import TOKEN_PATTERN, AdminTokens, Role
from tenants.errors import AuthError
from tenants.keys import AuthContext

_AUTH_MESSAGES = {
    "missing": "Missing API key: send 'Authorization: Bearer sk-strata-...'.",
    "malformed": "Malformed API key.",
    "unknown": "Incorrect API key provided.",
    "revoked": "This API key has been revoked.",
    "expired": "This API key has expired.",
    "tenant_disabled": "This account is disabled.",
}


def gateway_state(connection: ASGIConnection[Any, Any, Any, Any]) -> GatewayState:
    state: GatewayState = connection.app.state.gateway
    return state


def bearer_token(connection: ASGIConnection[Any, Any, Any, Any]) -> str | None:
    scheme, _, token = connection.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


async def requires_api_key(
    connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler
) -> None:
    """Authenticate the tenant key; the result is kept on `connection.state.auth`."""
    secret = bearer_token(connection)
    if secret is None:
        raise APIError(
            401, _AUTH_MESSAGES["missing"], type="authentication_error", code="missing_api_key"
        )
    try:
        connection.state.auth = await gateway_state(connection).keys.authenticate(secret)
    except AuthError as exc:
        raise APIError(
            401,
            _AUTH_MESSAGES.get(exc.reason, "Invalid API key."),
            type="authentication_error",
            code="invalid_api_key",
        ) from exc
    except (aioredis.RedisError, OSError) as exc:
        raise APIError(
            503,
            "the key store is unreachable; retry shortly",
            type="service_unavailable",
            code="store_unavailable",
            headers={"retry-after": "1"},
        ) from exc


def auth_of(connection: ASGIConnection[Any, Any, Any, Any]) -> AuthContext:
    auth: AuthContext = connection.state.auth
    return auth


async def requires_admin_token(
    connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler
) -> None:
    """An admin token whose role gives the route's access level (`gateway.admin_access`):
    the bootstrap token from settings (role admin) or a live stored one. Tenant keys never
    open the admin API. The principal is kept on `connection.state.admin`, and a mutating
    request's JSON body is read here, so the audit log has both even for a refusal."""
    principal = await _admin_principal(connection)
    connection.state.admin = principal
    is_json = "json" in connection.headers.get("content-type", "")
    if isinstance(connection, Request) and is_mutating(handler) and is_json:
        # cached: the handler decodes the same bytes
        connection.state.admin_body = await connection.body()
    access = access_of(handler)
    if not can_access(principal.role, access):
        raise APIError(
            403, refusal(principal.role, access), type="permission_error", code="insufficient_role"
        )


async def _admin_principal(connection: ASGIConnection[Any, Any, Any, Any]) -> AdminPrincipal:
    state = gateway_state(connection)
    expected = state.settings.admin_token
    presented = bearer_token(connection) or ""
    if expected is not None and hmac.compare_digest(presented.encode(), expected.encode()):
        return AdminPrincipal("bootstrap", Role.ADMIN)
    if TOKEN_PATTERN.fullmatch(presented):
        try:
            token = await AdminTokens(state.redis).authenticate(presented)
        except (aioredis.RedisError, OSError) as exc:
            raise APIError(
                503,
                "the token store is unreachable; retry shortly",
                type="service_unavailable",
                code="store_unavailable",
                headers={"retry-after": "1"},
            ) from exc
        if token is not None:
            return AdminPrincipal(token.id, token.role)
    elif expected is None:
        raise APIError(
            403,
            "the admin API is disabled: set STRATA_ADMIN_TOKEN, or send an issued admin token",
            type="permission_error",
            code="admin_disabled",
        )
    raise APIError(
        401,
        "invalid admin token (unknown or revoked)",
        type="authentication_error",
        code="invalid_admin_token",
    )

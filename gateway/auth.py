"""Guards: a tenant API key for /v1, the operator's admin token for /admin."""

from __future__ import annotations

import hmac
from typing import Any

import redis.asyncio as aioredis
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from gateway.errors import APIError
from gateway.state import GatewayState
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
    connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler
) -> None:
    """The operator's token from settings; tenant keys never open the admin API."""
    expected = gateway_state(connection).settings.admin_token
    if expected is None:
        raise APIError(
            403,
            "the admin API is disabled: set STRATA_ADMIN_TOKEN",
            type="permission_error",
            code="admin_disabled",
        )
    presented = bearer_token(connection) or ""
    if not hmac.compare_digest(presented.encode(), expected.encode()):
        raise APIError(
            401, "invalid admin token", type="authentication_error", code="invalid_admin_token"
        )

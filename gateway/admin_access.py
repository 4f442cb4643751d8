"""What each admin route needs, and which roles give it.

Every admin route is guarded by `gateway.auth.requires_admin_token` and has one access level:

- `WRITE` (admin only): every route that is not a GET; a GET too where it answers a secret.
- `READ` (viewer, admin): the default for a GET.
- `BILLING` (billing, viewer, admin): a GET of usage, spend, exports or prices.

A route declares its level in its options, `@get("/export", opt=BILLING)`; a route that
declares nothing gets the default of its method, so a new route is never more open than
that. A mutating route is `WRITE` whatever it declares. The mutating routes are also the
ones the audit log records (`gateway.audit`).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import msgspec
from litestar.handlers.base import BaseRouteHandler

from tenants.admin_tokens import Role

OPT_KEY = "admin_access"
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class AdminAccess(StrEnum):
    WRITE = "write"
    READ = "read"
    BILLING = "billing"


WRITE: dict[str, Any] = {OPT_KEY: AdminAccess.WRITE}
READ: dict[str, Any] = {OPT_KEY: AdminAccess.READ}
BILLING: dict[str, Any] = {OPT_KEY: AdminAccess.BILLING}

_ALLOWED: dict[AdminAccess, frozenset[Role]] = {
    AdminAccess.WRITE: frozenset({Role.ADMIN}),
    AdminAccess.READ: frozenset({Role.ADMIN, Role.VIEWER}),
    AdminAccess.BILLING: frozenset({Role.ADMIN, Role.VIEWER, Role.BILLING}),
}


class AdminPrincipal(msgspec.Struct, frozen=True):
    """Who makes an admin request: a stored token's id, or `bootstrap` (the settings'
    token), and its role."""

    actor: str
    role: Role


def is_mutating(handler: BaseRouteHandler) -> bool:
    methods = getattr(handler, "http_methods", None) or set()
    return any(m not in READ_METHODS for m in methods)


def access_of(handler: BaseRouteHandler) -> AdminAccess:
    """The level a route needs: WRITE for a mutating route, else what it declares, else
    READ."""
    if is_mutating(handler):
        return AdminAccess.WRITE
    return AdminAccess(handler.opt.get(OPT_KEY, AdminAccess.READ))


def can_access(role: Role, access: AdminAccess) -> bool:
    return role in _ALLOWED[access]


def refusal(role: Role, access: AdminAccess) -> str:
    """Why `role` may not use a route of level `access`, for the 403 message."""
    if access is AdminAccess.WRITE:
        return f"an admin token with role '{role}' is read-only; this route needs role 'admin'"
    return (
        f"an admin token with role '{role}' reads only usage, spend, exports and prices; "
        "this route needs role 'viewer' or 'admin'"
    )

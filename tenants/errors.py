"""Typed errors of the tenants package. The gateway maps them to HTTP errors at its edge;
nothing here knows about HTTP. Messages never contain a secret.
"""

from __future__ import annotations

from typing import Literal

AuthFailure = Literal["missing", "malformed", "unknown", "revoked", "expired", "tenant_disabled"]


class TenantsError(Exception):
    """Base of every caller error raised by the tenants package."""


class NotFoundError(TenantsError):
    """The named tenant, key, adapter or price does not exist."""

    def __init__(self, kind: str, ident: str) -> None:
        super().__init__(f"{kind} {ident!r} not found")
        self.kind = kind
        self.ident = ident


class ConflictError(TenantsError):
    """The request clashes with the stored state (duplicate id, key no longer active)."""


class TenantDisabledError(TenantsError):
    """The tenant exists but is disabled, so it cannot get new keys."""

    def __init__(self, tenant_id: str) -> None:
        super().__init__(f"tenant {tenant_id!r} is disabled")
        self.tenant_id = tenant_id


class AuthError(TenantsError):
    """A presented API key does not authenticate; `reason` says why (for logs and metrics,
    the client should only learn that the key is invalid)."""

    def __init__(self, reason: AuthFailure) -> None:
        super().__init__(f"authentication failed: {reason}")
        self.reason: AuthFailure = reason

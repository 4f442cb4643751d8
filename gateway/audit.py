"""Recording admin changes: every mutating request the admin guard (or the console's session
guard) let through or refused becomes one audit entry, written by a `before_send` hook of
the app as the response ends, so no admin route or console form, present or future, can
leave it out. Secrets are removed before the entry
is built: fields named like one, and anything shaped like an API key or admin token."""

from __future__ import annotations

import logging
import re
import time
from typing import Any

import msgspec
from litestar.connection import ASGIConnection
from litestar.types import Message, Scope

from gateway.admin_access import AdminPrincipal, is_mutating
from tenants.audit_log import AuditEntry, AuditLog

log = logging.getLogger(__name__)

REDACTED = "[redacted]"
SECRET_FIELDS = frozenset(
    {"secret", "token", "password", "api_key", "authorization", "cache_salt", "admin_token"}
)
_SECRET_TEXT = re.compile(r"s[ka]-strata-[A-Za-z0-9_-]+")
_MAX_CAPTURE = 64 * 1024  # of a response body, read for the id of what it created
_STATE = "audit_capture"
_CREATED = "audit_created_id"


def note_created(connection: ASGIConnection[Any, Any, Any, Any], created_id: str) -> None:
    """Name what a request created, for its entry, where the answer does not say it in JSON
    (a console form answers with a page)."""
    connection.state[_CREATED] = created_id


def redact(value: Any) -> Any:
    """`value` (decoded JSON) with every secret replaced by `[redacted]`."""
    if isinstance(value, dict):
        return {
            k: REDACTED if str(k).lower() in SECRET_FIELDS else redact(v) for k, v in value.items()
        }
    if isinstance(value, list):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return _SECRET_TEXT.sub(REDACTED, value)
    return value


async def record_admin_change(message: Message, scope: Scope) -> None:
    """The app's `before_send` hook: on the last body message of a mutating admin request
    that named its principal, append its entry. A store error is logged, never raised: the
    change itself is already made."""
    state = scope.get("state") or {}
    principal = state.get("admin")
    handler = scope.get("route_handler")
    if not isinstance(principal, AdminPrincipal) or handler is None or not is_mutating(handler):
        return
    capture: dict[str, Any] = state.setdefault(_STATE, {"status": 0, "body": b""})
    if message["type"] == "http.response.start":
        capture["status"] = message["status"]
        capture["request_id"] = _text(dict(message.get("headers") or []).get(b"x-request-id"))
        return
    if message["type"] != "http.response.body":
        return
    if len(capture["body"]) < _MAX_CAPTURE:
        capture["body"] += message.get("body", b"")
    if message.get("more_body", False):
        return
    gateway = getattr(scope["app"].state, "gateway", None)
    if gateway is None:
        return
    entry = _entry(scope, principal, handler, capture)
    try:
        await AuditLog(gateway.redis).append(entry)
    except Exception:  # the store is down: the entry is lost, said loudly
        log.exception("could not write the audit entry of %s %s", entry.method, entry.path)


def _entry(
    scope: Scope, principal: AdminPrincipal, handler: Any, capture: dict[str, Any]
) -> AuditEntry:
    path: str = scope["path"]
    method = str(scope.get("method", ""))
    status: int = capture["status"]
    params = {k: str(v) for k, v in (scope.get("path_params") or {}).items()}
    change = redact(_json(scope.get("state", {}).get("admin_body", b"")))
    created = _json(capture["body"]) if 200 <= status < 300 else None
    created_id = (
        (_created_id(created) or scope.get("state", {}).get(_CREATED)) if method == "POST" else None
    )
    parts = path.strip("/").split("/")  # /admin/<resource>/... or /ui/<resource>/...
    resource = parts[1] if len(parts) > 1 else parts[0]
    headers = dict(scope.get("headers") or [])
    client = scope.get("client")
    return AuditEntry(
        at=time.time(),
        actor=principal.actor,
        role=str(principal.role),
        action=handler.opt.get("audit_action") or f"{resource}.{handler.handler_name}",
        method=method,
        path=path,
        status=status,
        target=_target(params, change, created_id),
        tenant_id=params.get("tenant_id") or _field(created, "tenant_id"),
        created_id=created_id,
        change=change,
        client=client[0] if client else None,
        user_agent=_text(headers.get(b"user-agent")),
        request_id=capture.get("request_id"),
    )


def _target(params: dict[str, str], change: Any, created_id: str | None) -> str | None:
    """The id a change is about: its last path parameter (the innermost resource), else the
    id it created, else its body's id or name."""
    if params:
        return list(params.values())[-1]
    if created_id is not None:
        return created_id
    for name in ("id", "name", "model", "worker_id"):
        if isinstance(found := _field(change, name), str) and found:
            return found
    return None


def _created_id(answer: Any) -> str | None:
    """The id of what a POST made: `id`, or that of the record it wraps (`key`, `token`,
    `webhook`)."""
    for record in (answer, *(_field(answer, k) for k in ("key", "token", "webhook"))):
        if isinstance(found := _field(record, "id"), str):
            return found
    return None


def _field(value: Any, name: str) -> Any:
    return value.get(name) if isinstance(value, dict) else None


def _json(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None


def _text(raw: bytes | None) -> str | None:
    return None if raw is None else raw.decode("latin-1")

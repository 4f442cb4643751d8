"""How console pages are rendered: the template context every page shares (the session's
CSRF token, who is signed in and whether they may write, the nav), the nav itself, built
from the handlers that declare a `nav` entry in their `opt` and filtered by role, Jinja
filters for dates and numbers, and list pagination."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Generic, TypeVar

from jinja2 import Environment
from litestar import Litestar, Request, Response
from litestar.response import Redirect, Template
from litestar.routes import HTTPRoute

from gateway.admin_access import AdminAccess, AdminPrincipal, access_of, can_access
from gateway.errors import APIError
from gateway.ui.forms import FormError
from gateway.ui.session import current_session
from tenants.errors import TenantsError
from tenants.records import RecordError

T = TypeVar("T")
PER_PAGE = 20


@dataclass(frozen=True)
class NavItem:
    title: str
    path: str
    order: int
    access: AdminAccess  # who sees it (gateway.admin_access)


def nav_items(app: Litestar) -> tuple[NavItem, ...]:
    """Every GET handler with `opt={"nav": title, "nav_order": n}`, in order: a new console
    page is one template and one handler; it names itself in the nav."""
    cached: tuple[NavItem, ...] | None = getattr(app.state, "console_nav", None)
    if cached is not None:
        return cached
    items = []
    for route in app.routes:
        if not isinstance(route, HTTPRoute):
            continue
        for handler in route.route_handlers:
            title = handler.opt.get("nav")
            if title and "GET" in handler.http_methods:
                order = int(handler.opt.get("nav_order", 99))
                items.append(NavItem(str(title), route.path, order, access_of(handler)))
    app.state.console_nav = found = tuple(sorted(items, key=lambda i: (i.order, i.title)))
    return found


def page(
    request: Request[Any, Any, Any], template: str, *, status: int = 200, **context: Any
) -> Template:
    """`template` rendered with what every console page shows (nav, CSRF token, who)."""
    session = current_session(request)
    principal = request.scope.get("state", {}).get("admin")
    # the role the guard checked; before it ran (a refused form token), the cookie's
    role = principal.role if isinstance(principal, AdminPrincipal) else None
    if role is None and session is not None and session.signed_in:
        role = session.role
    path = request.url.path
    nav = tuple(
        item for item in nav_items(request.app) if role is None or can_access(role, item.access)
    )
    active = max(
        (item for item in nav if path == item.path or path.startswith(item.path + "/")),
        key=lambda item: len(item.path),
        default=None,
    )
    shared = {
        "csrf_token": session.csrf if session is not None else "",
        "signed_in": session is not None and session.signed_in,
        "who": session.name if session is not None else None,
        "role": role,
        "can_write": role is not None and can_access(role, AdminAccess.WRITE),
        "nav": nav,
        "active_path": active.path if active is not None else None,
    }
    return Template(template_name=template, context={**shared, **context}, status_code=status)


@dataclass(frozen=True)
class Paged(Generic[T]):
    """One page of a list (numbered from 1)."""

    items: Sequence[T]
    page: int
    num_pages: int
    total: int
    first: int  # 1-based position of the first item shown (0 when empty)
    last: int


def paginate(items: Sequence[T], page_no: int, per_page: int = PER_PAGE) -> Paged[T]:
    num_pages = max(1, math.ceil(len(items) / per_page))
    page_no = min(max(1, page_no), num_pages)
    start = (page_no - 1) * per_page
    shown = items[start : start + per_page]
    return Paged(
        items=shown,
        page=page_no,
        num_pages=num_pages,
        total=len(items),
        first=start + 1 if shown else 0,
        last=start + len(shown),
    )


# -- filters -------------------------------------------------------------------------------


def utc(ts: float | None) -> str:
    if ts is None:
        return "—"
    return datetime.fromtimestamp(ts, tz=UTC).strftime("%Y-%m-%d %H:%M UTC")


def ago(ts: float | None, now: float | None = None) -> str:
    """'3 minutes ago', 'in 2 days', 'just now'."""
    if ts is None:
        return "—"
    delta = (time.time() if now is None else now) - ts
    future, seconds = delta < 0, abs(delta)
    if seconds < 45:
        return "just now"
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size:
            n = round(seconds / size)
            text = f"{n} {unit}{'' if n == 1 else 's'}"
            return f"in {text}" if future else f"{text} ago"
    return "in a minute" if future else "a minute ago"


def number(value: float | None) -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:,.2f}"
    return f"{int(value):,}"


def blocks(value: int | None) -> str:
    return "—" if value is None else f"{value:,}"


def register_filters(env: Environment) -> None:
    env.filters.update(utc=utc, ago=ago, number=number, blocks=blocks)


def is_htmx(request: Request[Any, Any, Any]) -> bool:
    return request.headers.get("hx-request") == "true"


def go_to(request: Request[Any, Any, Any], url: str) -> Response[Any]:
    """Send the browser to `url`: htmx follows HX-Redirect, a plain form post a 303."""
    if is_htmx(request):
        return Response(content=b"", status_code=200, headers={"HX-Redirect": url})
    return Redirect(url, status_code=303)


# what a console form can be refused with: shown in place, next to the form
FORM_ERRORS = (FormError, RecordError, TenantsError, APIError)


def refusal(exc: Exception) -> FormError:
    """The form error to show for a refused change."""
    if isinstance(exc, FormError):
        return exc
    if isinstance(exc, APIError):
        return FormError(exc.param, exc.message)
    return FormError(None, str(exc))

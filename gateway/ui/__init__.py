"""The operator's web console at /ui: server-rendered pages (Jinja templates, htmx for forms,
uPlot for charts, both vendored under static/vendor/) over the same services the admin API
uses, behind a sign-in with an admin token and its role (gateway/ui/session.py); its changes
are audited like the admin API's.

A page is one template and one handler: a GET handler with `opt={"nav": title}` is listed
in the nav (gateway/ui/render.py); add its controller to `PAGES`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from litestar import Request, Response, Router, get
from litestar.datastructures import CacheControlHeader
from litestar.exceptions import ValidationException
from litestar.plugins.jinja import JinjaTemplateEngine
from litestar.response import Redirect, Template
from litestar.static_files import create_static_files_router
from litestar.template.config import TemplateConfig

from gateway.ui.alerts import AlertPages
from gateway.ui.audit import AuditPages
from gateway.ui.budgets import BudgetForms
from gateway.ui.catalog import AdapterPages, ModelPages
from gateway.ui.keys import KeyPages
from gateway.ui.overview import OverviewPage
from gateway.ui.render import is_htmx, page, register_filters
from gateway.ui.session import (
    ConsoleRefusedError,
    CsrfRejectedError,
    SignInRequiredError,
    requires_csrf_token,
)
from gateway.ui.signin import SignInController
from gateway.ui.spend import SpendPages
from gateway.ui.tenants import TenantPages
from gateway.ui.usage import UsagePages
from tenants.errors import NotFoundError

HERE = Path(__file__).parent
PAGES = (
    OverviewPage,
    TenantPages,
    BudgetForms,
    KeyPages,
    AdapterPages,
    ModelPages,
    UsagePages,
    SpendPages,
    AlertPages,
    AuditPages,
)

# the console's pages load only their own scripts and styles, and are never framed
SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'self'; img-src 'self' data:; object-src 'none'; "
        "frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
}


def template_config() -> TemplateConfig[JinjaTemplateEngine]:
    return TemplateConfig(
        directory=HERE / "templates",
        engine=JinjaTemplateEngine,
        engine_callback=lambda engine: register_filters(engine.engine),
    )


def _sign_in_first(request: Request[Any, Any, Any], _: SignInRequiredError) -> Response[Any]:
    target = f"/ui/signin?next={request.url.path}"
    if is_htmx(request):
        return Response(content=b"", status_code=401, headers={"HX-Redirect": target})
    return Redirect(target, status_code=303)


def _error(request: Request[Any, Any, Any], status: int, title: str, message: str) -> Template:
    """An error page; for htmx, only its message, swapped where the answer was expected."""
    template = "_alert.html" if is_htmx(request) else "error.html"
    return page(request, template, status=status, title=title, message=message)


def _csrf_rejected(request: Request[Any, Any, Any], _: CsrfRejectedError) -> Response[Any]:
    message = "This form has expired or did not come from the console. Reload the page."
    return _error(request, 403, "Request refused", message)


def _refused(request: Request[Any, Any, Any], exc: ConsoleRefusedError) -> Response[Any]:
    return _error(request, exc.status, exc.title, exc.message)


def _bad_query(request: Request[Any, Any, Any], exc: ValidationException) -> Response[Any]:
    extra = exc.extra if isinstance(exc.extra, list) else []
    first = extra[0] if extra and isinstance(extra[0], dict) else {}
    where = f"'{first['key']}': " if first.get("key") else ""
    message = f"{where}{first.get('message') or exc.detail}"
    return _error(request, 400, "Bad request", message)


def _not_found(request: Request[Any, Any, Any], exc: NotFoundError) -> Response[Any]:
    return _error(request, 404, "Not found", str(exc))


def console_router() -> Router:
    static = create_static_files_router(
        path="/static",
        directories=[HERE / "static"],
        cache_control=CacheControlHeader(max_age=3600),
        include_in_schema=False,
    )
    return Router(
        path="/ui",
        route_handlers=[SignInController, *PAGES, static],
        guards=[requires_csrf_token],
        exception_handlers={
            SignInRequiredError: _sign_in_first,
            CsrfRejectedError: _csrf_rejected,
            ConsoleRefusedError: _refused,
            NotFoundError: _not_found,
            ValidationException: _bad_query,
        },
        response_headers=SECURITY_HEADERS,
        cache_control=CacheControlHeader(no_store=True),  # pages show secrets and live figures
        include_in_schema=False,
    )


@get("/", include_in_schema=False)
async def to_console() -> Redirect:
    """The root is the console."""
    return Redirect("/ui")

"""Every error the gateway returns, in OpenAI's shape:
`{"error": {"message", "type", "param", "code"}}` with the matching status code.

Handlers raise `APIError` (or let engine/record errors through); `exception_handlers()` maps
everything, including framework errors for malformed bodies and unknown routes, so that no
client ever sees a framework-specific error body or a traceback.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
from litestar import MediaType, Request, Response
from litestar.exceptions import HTTPException, SerializationException, ValidationException

from engine.protocol import EngineDeadError, InvalidRequestError
from gateway.openai_types import ErrorBody, ErrorInfo, ErrorType
from tenants.errors import ConflictError, NotFoundError, TenantDisabledError, TenantsError
from tenants.export import ExportError
from tenants.records import RecordError

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: ErrorType = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> bytes:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return msgspec.json.encode(ErrorBody(error=info))


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def invalid_field(exc: msgspec.ValidationError) -> APIError:
    """A 400 naming the field a strict decode rejected: msgspec reports `... - at `$.a[0].b``."""
    message, _, where = str(exc).partition(" - at `$")
    field = where.rstrip("`").lstrip(".")
    if not field and (named := _NAMED.match(message) or _MISSING.search(message)):
        field = named.group(1)  # a record's own check, or a missing field, names it
    return _invalid(field, message)


# a validation message that starts with the field it is about: `limit_usd must be ...`
_MISSING = re.compile(r"missing required field `([^`]+)`")
_NAMED = re.compile(r"([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*)(?: must |: )")


def invalid_json(detail: object) -> APIError:
    """A 400 for a body that does not parse as JSON."""
    return APIError(400, f"the request body is not valid JSON: {detail}", code="invalid_json")


def _invalid(field: str, message: str) -> APIError:
    """A 400 for a rejected value: `field` is its path (`messages[0].role`), or empty (or
    Litestar's `data`) for the body as a whole."""
    if not field or field == "data":
        return APIError(400, f"Invalid request body: {message}", code="invalid_request")
    return APIError(
        400, f"Invalid value for '{field}': {message}", param=field, code="invalid_value"
    )


def error_response(err: APIError, extra_headers: Mapping[str, str] | None = None) -> Response:
    headers = {**err.headers, **(extra_headers or {})}
    return Response(
        content=err.body(), status_code=err.status, media_type=MediaType.JSON, headers=headers
    )


def _request_headers(request: Request[Any, Any, Any]) -> dict[str, str]:
    """Headers the gateway put on `request.state` (request id, rate limits)."""
    return dict(getattr(request.state, "response_headers", {}) or {})


def _handle_api_error(request: Request[Any, Any, Any], exc: APIError) -> Response:
    return error_response(exc, _request_headers(request))


def _handle_validation(request: Request[Any, Any, Any], exc: ValidationException) -> Response:
    extra = exc.extra if isinstance(exc.extra, list) else []
    first = extra[0] if extra and isinstance(extra[0], dict) else {}
    message = str(first.get("message") or exc.detail or "invalid request")
    err = _invalid(str(first.get("key") or ""), message)
    return error_response(err, _request_headers(request))


def _handle_http(request: Request[Any, Any, Any], exc: HTTPException) -> Response:
    if isinstance(exc.__cause__, SerializationException):  # the body did not parse
        return error_response(invalid_json(exc.detail), _request_headers(request))
    status = exc.status_code
    kinds: dict[int, tuple[ErrorType, str]] = {
        401: ("authentication_error", "invalid_api_key"),
        403: ("permission_error", "forbidden"),
        404: ("not_found_error", "not_found"),
        405: ("invalid_request_error", "method_not_allowed"),
        413: ("invalid_request_error", "request_too_large"),
        429: ("rate_limit_error", "rate_limit_exceeded"),
    }
    kind, code = kinds.get(
        status, ("invalid_request_error" if status < 500 else "server_error", "http_error")
    )
    err = APIError(status, exc.detail or "request failed", type=kind, code=code)
    return error_response(err, _request_headers(request))


def _handle_invalid(request: Request[Any, Any, Any], exc: InvalidRequestError) -> Response:
    return error_response(
        APIError(400, str(exc), param=exc.param, code="invalid_request"),
        _request_headers(request),
    )


def _handle_record(request: Request[Any, Any, Any], exc: ValueError) -> Response:
    named = _NAMED.match(str(exc))
    param = named.group(1) if named else None
    return error_response(
        APIError(400, str(exc), param=param, code="invalid_value"), _request_headers(request)
    )


def _handle_engine_dead(request: Request[Any, Any, Any], exc: EngineDeadError) -> Response:
    err = APIError(
        503,
        "the inference engine is unavailable; retry shortly",
        type="service_unavailable",
        code="engine_unavailable",
    )
    return error_response(err, {**_request_headers(request), "retry-after": "1"})


def _handle_not_found(request: Request[Any, Any, Any], exc: NotFoundError) -> Response:
    err = APIError(404, str(exc), type="not_found_error", code="not_found")
    return error_response(err, _request_headers(request))


def _handle_conflict(request: Request[Any, Any, Any], exc: TenantsError) -> Response:
    return error_response(APIError(409, str(exc), code="conflict"), _request_headers(request))


def _handle_undecodable(request: Request[Any, Any, Any], exc: Exception) -> Response:
    err = APIError(400, "the request body is not valid UTF-8 JSON", code="invalid_json")
    return error_response(err, _request_headers(request))


def _handle_unexpected(request: Request[Any, Any, Any], exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    err = APIError(500, "internal server error", type="server_error", code="internal_error")
    return error_response(err, _request_headers(request))


def exception_handlers() -> dict[type[Exception] | int, Callable[..., Response]]:
    return {
        APIError: _handle_api_error,
        ValidationException: _handle_validation,
        HTTPException: _handle_http,
        InvalidRequestError: _handle_invalid,
        RecordError: _handle_record,
        ExportError: _handle_record,
        NotFoundError: _handle_not_found,
        ConflictError: _handle_conflict,
        TenantDisabledError: _handle_conflict,
        EngineDeadError: _handle_engine_dead,
        UnicodeDecodeError: _handle_undecodable,
        msgspec.DecodeError: _handle_undecodable,
        Exception: _handle_unexpected,
    }

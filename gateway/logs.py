"""Structured logs: JSON lines (or console) through structlog, for our loggers and the
standard library's alike, carrying the request and tenant ids bound per request. Gateways
and engine workers write the same format. Keys and prompt text are never logged.

A standard-library record's `fields` extra (a dict) becomes top-level keys of its line: the
access log (`gateway.access_log`) writes its lines that way."""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

ACCESS_LOGGER = "strata.access"


def _lift_fields(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    record = event.get("_record")
    fields = getattr(record, "fields", None)
    if isinstance(fields, dict):
        for name, value in fields.items():
            event[name] = value
    return event


def _shared_processors(json: bool) -> list[Any]:
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if json:  # a traceback as one text field (the JSON renderer cannot encode the object)
        shared.append(structlog.processors.format_exc_info)
    return shared


def formatter(*, json: bool = True) -> logging.Formatter:
    """The formatter of every line: JSON (or console) with the shared keys."""
    renderer: Any = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*_shared_processors(json), _lift_fields],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )


def configure_logging(level: str = "INFO", *, json: bool = True) -> None:
    """Send every log line to stderr at `level`; access lines are written whatever the
    level (filter them by the logger name `strata.access`)."""
    structlog.configure(
        processors=[
            *_shared_processors(json),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(json=json))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level)
    logging.getLogger(ACCESS_LOGGER).setLevel(logging.INFO)


def bind_request(request_id: str, tenant_id: str) -> None:
    """Attach the ids to every log line of the current request's task."""
    structlog.contextvars.bind_contextvars(request_id=request_id, tenant_id=tenant_id)

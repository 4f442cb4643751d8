"""Structured logs: JSON lines (or console) through structlog, for our loggers and the
standard library's alike, carrying the request and tenant ids bound per request. Keys and
prompt text are never logged."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog


def configure_logging(level: str = "INFO", *, json: bool = True) -> None:
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if json:  # a traceback as one text field (the JSON renderer cannot encode the object)
        shared.append(structlog.processors.format_exc_info)
    renderer: Any = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level)


def bind_request(request_id: str, tenant_id: str) -> None:
    """Attach the ids to every log line of the current request's task."""
    structlog.contextvars.bind_contextvars(request_id=request_id, tenant_id=tenant_id)

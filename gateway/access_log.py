"""The access log: one structured line per tenant API request (`/v1`, `/tokenize`,
`/detokenize`) on the logger `strata.access`, whether it was served or refused (bad key,
rate limit, bad input), streamed or not. A line carries ids, the model's canonical id, the
status, why it was refused, token counts and timings; never a key secret, prompt or
completion text.

The tenant API's controllers wrap their routes in `access_logged`, which sees the response
go out and reads what the request's life left on its state: the key (`auth`, from the
guard), the `job` and its `ticket`, whose usage record the pipeline writes when it settles.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import msgspec
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from gateway.logs import ACCESS_LOGGER
from gateway.pipeline import START_GRACE_S, Ticket
from gateway.prepare import Job
from tenants.keys import AuthContext

CLIENT_GONE = 499  # the status logged when the client left before the response started
_MAX_ERROR_BODY = 16 * 1024

log = logging.getLogger(ACCESS_LOGGER)


class _Seen:
    """What went out: the status, the request id header, and an error body's code."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.request_id: str | None = None
        self.error_body = b""

    def observe(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            for name, value in message.get("headers") or ():
                if name.lower() == b"x-request-id":
                    self.request_id = value.decode("latin-1")
        elif message["type"] == "http.response.body" and (self.status or 0) >= 400:
            self.error_body = (self.error_body + message.get("body", b""))[:_MAX_ERROR_BODY]

    def error_code(self) -> str | None:
        try:
            body = msgspec.json.decode(self.error_body)
        except msgspec.DecodeError:
            return None
        error = body.get("error") if isinstance(body, dict) else None
        code = error.get("code") if isinstance(error, dict) else None
        return str(code) if code is not None else None


def access_logged(app: ASGIApp) -> ASGIApp:
    """ASGI middleware: log one access line for each HTTP request `app` answers."""

    async def logged(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        started = time.perf_counter()
        seen = _Seen()

        async def sending(message: Message) -> None:
            await send(message)  # the app's hooks add the request id on the way
            seen.observe(message)

        try:
            await app(scope, receive, sending)
        except BaseException:
            emit(scope, seen, started)
            raise
        ticket = (scope.get("state") or {}).get("ticket")
        if isinstance(ticket, Ticket) and not ticket.settled:  # a stream's settlement
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(START_GRACE_S + 1):
                    await ticket.ending.wait()
        emit(scope, seen, started)

    return logged


def emit(scope: Scope, seen: _Seen, started: float) -> None:
    log.info("request", extra={"fields": access_fields(scope, seen, started)})


def access_fields(scope: Scope, seen: _Seen, started: float) -> dict[str, Any]:
    state = scope.get("state") or {}
    auth, job, ticket = state.get("auth"), state.get("job"), state.get("ticket")
    status = seen.status if seen.status is not None else CLIENT_GONE
    fields: dict[str, Any] = {
        "request_id": seen.request_id or (job.request_id if isinstance(job, Job) else None),
        "method": scope.get("method"),
        "path": scope["path"],
        "tenant_id": auth.tenant.id if isinstance(auth, AuthContext) else None,
        "key_id": auth.key.id if isinstance(auth, AuthContext) else None,
        "model": job.base_model if isinstance(job, Job) else None,
        "adapter": job.lora.name if isinstance(job, Job) and job.lora is not None else None,
        "stream": job.stream if isinstance(job, Job) else None,
        "status": status,
        "rejection": seen.error_code() if status >= 400 else None,
        "finish": None,
        "prompt_tokens": None,
        "completion_tokens": None,
        "cached_tokens": None,
        "latency_ms": round((time.perf_counter() - started) * 1e3, 3),
        "ttft_ms": None,
    }
    record = ticket.record if isinstance(ticket, Ticket) else None
    if record is not None:
        fields |= {
            "finish": record.status,
            "prompt_tokens": record.prompt_tokens,
            "completion_tokens": record.completion_tokens,
            "cached_tokens": record.cached_tokens,
            "ttft_ms": record.ttft_ms,
        }
    return fields

"""The gateway's HTTP routes, and what their handlers share."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from gateway.errors import bad_request


def time_window(
    start: str | None, end: str | None, *, span_s: float | None = None
) -> tuple[float, float]:
    """The [start, end) of a usage query, in unix seconds. Each bound is given as unix seconds
    or in ISO 8601 (`2026-11-01`, `2026-11-01T12:00:00+02:00`; UTC unless it names an
    offset). `end` defaults to now; `start` to `span_s` before `end`, or to the epoch."""
    stop = _instant(end, "end") if end is not None else time.time() + 1
    if start is not None:
        begin = _instant(start, "start")
    else:
        begin = stop - span_s if span_s is not None else 0.0
    if begin >= stop:
        raise bad_request("start must be before end", param="start")
    return begin, stop


def _instant(value: str, param: str) -> float:
    try:
        return float(value)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise bad_request(
            f"{param} must be unix seconds or an ISO 8601 date or date-time, not {value!r}",
            param=param,
        ) from None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()

"""Usage queries take their bounds in unix seconds or ISO 8601."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import pytest

from gateway.errors import APIError
from gateway.routes import time_window


def test_bounds_in_unix_seconds_or_iso_8601():
    nov1 = datetime(2026, 11, 1, tzinfo=UTC).timestamp()
    assert time_window("1700000000.5", "1800000000") == (1700000000.5, 1800000000.0)
    assert time_window("2026-11-01", "2026-11-02T00:00:00Z") == (nov1, nov1 + 86400)
    # a named offset is honoured; a naive date-time is UTC
    assert time_window("2026-11-01T02:00:00+02:00", "2026-11-01T00:00:01") == (nov1, nov1 + 1)


def test_defaults_end_now_and_start_a_span_before_or_the_epoch():
    start, end = time_window(None, None, span_s=3600)
    assert abs(end - time.time()) < 5 and end - start == 3600
    assert time_window(None, "2026-11-01")[0] == 0.0


@pytest.mark.parametrize(
    ("start", "end", "param"),
    [
        ("last week", None, "start"),
        (None, "2026-13-01", "end"),
        ("2026-11-02", "2026-11-01", "start"),
    ],
)
def test_bad_bounds_are_400_naming_the_parameter(start, end, param):
    with pytest.raises(APIError) as err:
        time_window(start, end)
    assert (err.value.status, err.value.param) == (400, param)

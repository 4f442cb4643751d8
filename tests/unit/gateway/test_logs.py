"""JSON log lines: a logged exception keeps its traceback as text."""

from __future__ import annotations

import json
import logging

from gateway.logs import configure_logging


def test_a_traceback_is_a_text_field_of_the_json_line(capsys):
    configure_logging("INFO", json=True)
    try:
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("strata.test").exception("it failed")
        line = capsys.readouterr().err.strip().splitlines()[-1]
    finally:
        logging.getLogger().handlers.clear()
    record = json.loads(line)
    assert record["event"] == "it failed" and record["level"] == "error"
    assert "Traceback (most recent call last)" in record["exception"]
    assert "ValueError: boom" in record["exception"]


def test_access_lines_are_written_whatever_the_level_with_their_fields_on_top(capsys):
    configure_logging("WARNING", json=True)
    try:
        logging.getLogger("strata.other").info("not at WARNING")
        fields = {"request_id": "chatcmpl-1", "status": 429, "rejection": "rate_limit_rpm"}
        logging.getLogger("strata.access").info("request", extra={"fields": fields})
        lines = capsys.readouterr().err.strip().splitlines()
    finally:
        logging.getLogger().handlers.clear()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["logger"] == "strata.access"
    assert (record["request_id"], record["status"], record["rejection"]) == (
        "chatcmpl-1",
        429,
        "rate_limit_rpm",
    )

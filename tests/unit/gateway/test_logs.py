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

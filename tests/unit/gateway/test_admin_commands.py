"""`strata admin`'s command table and value parsers, without a server."""

from __future__ import annotations

import argparse
import time
from datetime import UTC, datetime

import pytest

from gateway.admin_cli import Call, Command
from gateway.admin_commands import COMMANDS, GROUPS
from gateway.admin_output import render
from gateway.admin_values import duration, instant, limit, names
from gateway.cli import build_parser
from tenants.records import Policy


def test_every_policy_field_has_an_option_wherever_a_policy_is_written():
    flags = {"--" + field.replace("_", "-") for field in Policy.__struct_fields__}
    for group, name in (("tenants", "create"), ("policies", "set"), ("policies", "replace")):
        (command,) = [c for c in COMMANDS if (c.group, c.name) == (group, name)]
        given = {f for arg in command.args for f in arg.flags}
        assert flags <= given, (name, sorted(flags - given))


def test_every_command_belongs_to_a_group_and_fills_its_path():
    for command in COMMANDS:
        assert command.group in GROUPS
        names_in_path = {a.dest for a in command.args if a.to == "path"}
        filled = command.path.format(**dict.fromkeys(names_in_path, "x"))
        assert "{" not in filled, command.name


def test_policy_options_nest_under_the_tenant_and_leave_out_what_was_not_given():
    args = build_parser().parse_args(
        ["admin", "tenants", "create", "acme", "--rpm", "60", "--max-tokens", "none"]
    )
    command: Command = args.admin_command
    call = Call(command, args, client=None)  # type: ignore[arg-type]
    assert call.fields("body") == {"name": "acme", "policy": {"rpm": 60, "max_tokens": None}}


@pytest.mark.parametrize(
    ("where", "line"),
    [
        ("before", ["admin", "--json", "--url", "http://h:1", "keys", "list", "acme"]),
        ("between", ["admin", "keys", "--url", "http://h:1", "--json", "list", "acme"]),
        ("after", ["admin", "keys", "list", "acme", "--url", "http://h:1", "--json"]),
    ],
)
def test_connection_options_are_read_anywhere(where, line):
    args = build_parser().parse_args(line)
    assert (args.url, args.json, args.tenant) == ("http://h:1", True, "acme"), where


def test_times_are_iso_dates_unix_seconds_or_ages():
    assert float(instant("2026-11-01")) == datetime(2026, 11, 1, tzinfo=UTC).timestamp()
    assert (
        float(instant("2026-11-01T02:00:00+02:00")) == datetime(2026, 11, 1, tzinfo=UTC).timestamp()
    )
    assert instant("1795000000") == "1795000000.0"
    assert abs(float(instant("7d")) - (time.time() - 7 * 86400)) < 60
    with pytest.raises(argparse.ArgumentTypeError, match="ISO 8601"):
        instant("last tuesday")


def test_durations_limits_and_name_lists():
    assert duration("90") == 90 and duration("15m") == 900 and duration("2d") == 172800
    with pytest.raises(argparse.ArgumentTypeError):
        duration("soon")
    assert limit("none") is None and limit("12") == 12
    with pytest.raises(argparse.ArgumentTypeError, match="positive integer"):
        limit("0")
    assert names("a, b,") == ["a", "b"] and names("none") is None


def test_tables_align_columns_and_show_times_as_dates():
    rows = [
        {"id": "t_1", "created_at": 0.0, "policy": {"rpm": 60}},
        {"id": "acme", "created_at": 86400.0, "policy": {"rpm": None}},
    ]
    text = render(rows, ("id", "created_at", "policy.rpm"))
    assert text.splitlines() == [
        "ID    CREATED_AT            RPM",
        "t_1   1970-01-01 00:00:00Z  60",
        "acme  1970-01-02 00:00:00Z  -",
    ]
    assert render([]) == "(none)"
    assert render([{"cost_total": 4.2e-06}]).splitlines()[1] == "0.0000042"
    assert render({"a": {"b": True}}).splitlines()[1].split() == ["a.b", "yes"]

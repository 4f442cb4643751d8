"""How `strata admin` prints the admin API's answers: lists as aligned tables, one record as
field/value rows (nested records flattened as `policy.rpm`), times as UTC dates."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any


def render(answer: Any, columns: Sequence[str] = ()) -> str:
    """The answer as text: a list as a table of `columns` (default: the first row's fields),
    a record as field/value rows, anything else as itself."""
    if isinstance(answer, list):
        if not answer:
            return "(none)"
        if not all(isinstance(row, dict) for row in answer):
            return "\n".join(cell("", row) for row in answer)
        names = list(columns) or list(_flatten(answer[0]))
        rows = [[cell(name, _lookup(row, name)) for name in names] for row in answer]
        return table([name.rsplit(".", 1)[-1].upper() for name in names], rows)
    if isinstance(answer, dict):
        return table(["FIELD", "VALUE"], [[k, cell(k, v)] for k, v in _flatten(answer).items()])
    return cell("", answer)


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *rows]]
    return "\n".join(line.rstrip() for line in lines)


def cell(name: str, value: Any) -> str:
    """One value as a table shows it: `-` for none, lists comma-joined, unix times as dates."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if _is_time(name) and isinstance(value, int | float):
        return datetime.fromtimestamp(value, UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    if isinstance(value, float) and value != int(value) and abs(value) < 1:
        return f"{value:.12f}".rstrip("0")  # costs in full, not as 4.2e-06
    if isinstance(value, list):
        return ",".join(cell("", v) for v in value) or "[]"
    if isinstance(value, dict):
        return ",".join(f"{k}={cell(k, v)}" for k, v in value.items()) or "-"
    return str(value)


def _flatten(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, dict) and value and _is_record(value):
            out |= _flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def _is_record(value: dict[str, Any]) -> bool:
    """A nested record (flattened) rather than a mapping of counts (one cell)."""
    return not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value.values())


def _lookup(row: dict[str, Any], dotted: str) -> Any:
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def _is_time(name: str) -> bool:
    """Fields holding unix seconds: `at`, `*_at`, and a period's `period_start`/`_end`."""
    return name == "at" or name.endswith("_at") or name in ("period_start", "period_end")

"""Reading the console's HTML forms into the records the services take: every bad value
becomes a FormError naming its field, which the page shows next to the form."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

from tenants.records import RecordError

Form = Mapping[str, Any]
R = TypeVar("R")


class FormError(ValueError):
    """A form value the console refuses; `field` is the input's name."""

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def text(form: Form, field: str, *, required: bool = False) -> str | None:
    value = form.get(field)
    value = value.strip() if isinstance(value, str) else ""
    if not value:
        if required:
            raise FormError(field, f"{field} is required")
        return None
    return value


def limit(form: Form, field: str) -> int | None:
    """A positive whole number, or None (blank: unlimited)."""
    value = text(form, field)
    if value is None:
        return None
    try:
        number = int(value.replace(",", "").replace("_", ""))
    except ValueError:
        raise FormError(field, f"{field} must be a whole number (blank: unlimited)") from None
    if number < 0:
        raise FormError(field, f"{field} must not be negative")
    return number


def integer(form: Form, field: str, default: int) -> int:
    value = text(form, field)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise FormError(field, f"{field} must be a whole number") from None


def decimal(form: Form, field: str, default: float) -> float:
    value = text(form, field)
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        raise FormError(field, f"{field} must be a number") from None
    if not math.isfinite(number):
        raise FormError(field, f"{field} must be a finite number")
    return number


def amount(form: Form, field: str) -> float | None:
    """A number not below zero, or None when blank."""
    if text(form, field) is None:
        return None
    number = decimal(form, field, 0.0)
    if number < 0:
        raise FormError(field, f"{field} must not be negative")
    return number


def whole_numbers(form: Form, field: str) -> list[int] | None:
    """A comma-separated list of whole numbers, or None when blank."""
    parts = names(form, field)
    if parts is None:
        return None
    try:
        return [int(part.rstrip("%")) for part in parts]
    except ValueError:
        raise FormError(field, f"{field} must be whole numbers, separated by commas") from None


def names(form: Form, field: str) -> list[str] | None:
    """A comma-separated list, or None when blank (no restriction)."""
    value = text(form, field)
    if value is None:
        return None
    return [part.strip() for part in value.split(",") if part.strip()]


def build(kind: type[R], values: dict[str, Any]) -> R:
    """`values` as a validated `kind` record; a refused value is a FormError naming its
    field (from the record's own message, or the path msgspec reports)."""
    try:
        return msgspec.convert(values, kind)
    except (msgspec.ValidationError, RecordError) as exc:
        message, _, where = str(exc).partition(" - at `$.")
        field = where.rstrip("`").split("[")[0] or None
        if field is None:
            # a record's message starts with the field, perhaps under its parent: `limits.rpm`
            first = message.split(" ")[0].rstrip(":").rsplit(".", 1)[-1]
            field = next((f for f in values if first == f or message.startswith(f)), None)
        if field is not None and field not in message:
            message = f"{field}: {message}"
        raise FormError(field, message) from None

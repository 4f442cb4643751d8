"""What the values of `strata admin`'s options mean: limits, durations, moments, prices, name
lists, and the policy fields with their units (one option each, for every command that
writes a policy)."""

from __future__ import annotations

import argparse
import re
import time
from datetime import UTC, datetime
from typing import Any

from gateway.admin_cli import Arg, opt

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_AGE = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")


def _none(text: str) -> bool:
    return text.lower() in ("none", "null", "unlimited")


def limit(text: str) -> int | None:
    """A positive integer, or `none` for unlimited."""
    if _none(text):
        return None
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or none, not {text!r}")
    return int(text)


def tokens_cap(text: str) -> int | None:
    if _none(text):
        return None
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number or none, not {text!r}")
    return int(text)


def names(text: str) -> list[str] | None:
    """Comma-separated names, or `none`."""
    if _none(text):
        return None
    return [n.strip() for n in text.split(",") if n.strip()]


def optional_name(text: str) -> str | None:
    return None if _none(text) else text


def duration(text: str) -> float:
    """Seconds: a number, or a number and a unit (`90s`, `15m`, `12h`, `30d`, `2w`)."""
    found = _AGE.fullmatch(text.strip())
    try:
        seconds = float(text) if found is None else float(found[1]) * _UNITS[found[2]]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected seconds or a duration like 90s, 15m, 12h, 30d, not {text!r}"
        ) from None
    if seconds < 0:
        raise argparse.ArgumentTypeError(f"a duration cannot be negative: {text!r}")
    return seconds


def seconds_at(text: str) -> float:
    """`instant` as a number, for a JSON body."""
    return float(instant(text))


def instant(text: str) -> str:
    """A moment as unix seconds: `now`, an age (`7d`: seven days ago), unix seconds, or
    ISO 8601 (`2026-11-01`, `2026-11-01T12:00:00+02:00`; UTC unless it names an offset)."""
    value = text.strip()
    found = _AGE.fullmatch(value)
    if value == "now":
        return f"{time.time():.3f}"
    if found is not None:
        return f"{time.time() - float(found[1]) * _UNITS[found[2]]:.3f}"
    try:
        return str(float(value))
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an ISO 8601 date (2026-11-01), unix seconds, or an age like 7d, 12h, "
            f"30m, not {text!r}"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return f"{moment.timestamp():.3f}"


def price(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a price of 0 or more, not {text!r}")
    return value


# -- policies --------------------------------------------------------------------------------

NONE = "; none: unlimited"
POLICY_OPTIONS: dict[str, tuple[Any, str]] = {
    "rpm": (limit, "requests per minute, a bucket refilled continuously" + NONE),
    "tpm": (
        limit,
        "tokens per minute (prompt + max_tokens charged at admission, the unused part "
        "credited back)" + NONE,
    ),
    "max_concurrent": (limit, "requests in flight at once" + NONE),
    "max_tokens": (limit, "the most tokens one request may generate (its max_tokens)" + NONE),
    "max_context_tokens": (limit, "the longest prompt, in tokens" + NONE),
    "kv_budget_tokens": (
        limit,
        "KV-cache tokens held at once by the tenant's requests in flight" + NONE,
    ),
    "kv_host_tokens": (
        tokens_cap,
        "KV-cache tokens of the tenant's prefix cache kept in host RAM (0: none there)" + NONE,
    ),
    "kv_disk_tokens": (
        tokens_cap,
        "KV-cache tokens of the tenant's prefix cache kept on disk (0: none there)" + NONE,
    ),
    "kv_remote_tokens": (
        tokens_cap,
        "KV-cache tokens of the tenant's prefix cache kept in the fleet's remote tier "
        "(0: none there)" + NONE,
    ),
    "allowed_models": (names, "comma-separated model names the tenant may call; none: all"),
    "allowed_adapters": (names, "comma-separated adapters the tenant may call; none: all"),
    "priority": (int, "-1000 to 1000, lower runs first in the engine (default 0)"),
    "weight": (
        float,
        "share of the engine against tenants of the same priority, (0, 1000] (default 1)",
    ),
    "on_store_unavailable": (
        ["fail_closed", "fail_open"],
        "when the store is out of reach: fail_closed answers 503, fail_open admits without "
        "limits (default fail_closed)",
    ),
    "shared_cache_namespace": (
        optional_name,
        "tenants naming the same namespace share prefix-cache blocks; none: a cache of its own",
    ),
}


_METAVARS: dict[Any, str] = {
    limit: "N",
    tokens_cap: "TOKENS",
    names: "NAME,...",
    int: "N",
    float: "W",
    optional_name: "NAME",
}


def policy_options(prefix: str = "") -> tuple[Arg, ...]:
    """One option per policy field, bound for `<prefix><field>` in the body."""
    out = []
    for name, (kind, text) in POLICY_OPTIONS.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(kind, list):
            typed: dict[str, Any] = {"choices": kind}
        else:
            typed = {"type": kind, "metavar": _METAVARS[kind]}
        out.append(opt(flag, help=text, field=prefix + name, **typed))
    return tuple(out)

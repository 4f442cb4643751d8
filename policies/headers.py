"""OpenAI-style rate-limit headers for an admission Decision (pure functions)."""

from __future__ import annotations

import math

from policies.admission import BucketState, Decision


def format_reset(seconds: float) -> str:
    """A duration the way OpenAI's reset headers write it: `20ms`, `1s`, `1.5s`, `6m0s`,
    `1h2m3s`. Rounded up to whole milliseconds; anything positive is at least `1ms`."""
    total_ms = math.ceil(round(max(seconds, 0.0) * 1000.0, 6))
    if total_ms == 0:
        return "0s"
    if total_ms < 1000:
        return f"{total_ms}ms"
    hours, rest_ms = divmod(total_ms, 3_600_000)
    minutes, rest_ms = divmod(rest_ms, 60_000)
    secs = f"{rest_ms // 1000}.{rest_ms % 1000:03d}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{secs}"
    if minutes:
        return f"{minutes}m{secs}"
    return secs


def _dimension(name: str, state: BucketState | None) -> dict[str, str]:
    if state is None:
        return {}
    return {
        f"x-ratelimit-limit-{name}": str(state.limit),
        f"x-ratelimit-remaining-{name}": str(state.remaining),
        f"x-ratelimit-reset-{name}": format_reset(state.reset_s),
    }


def rate_limit_headers(decision: Decision) -> dict[str, str]:
    """The response headers for `decision`: limit/remaining/reset per limited dimension
    (requests, tokens), `retry-after` (whole seconds, rounded up) on a retryable denial and
    `x-should-retry: false` on a hard one."""
    headers = _dimension("requests", decision.requests) | _dimension("tokens", decision.tokens)
    if decision.allowed:
        return headers
    if decision.hard:
        headers["x-should-retry"] = "false"
    elif decision.retry_after_s is not None:
        headers["retry-after"] = str(max(1, math.ceil(round(decision.retry_after_s, 3))))
    return headers

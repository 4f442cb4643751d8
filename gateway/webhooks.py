"""One webhook delivery attempt: the JSON body, the signature headers, the POST with short
timeouts, and the backoff between attempts (`AlertConfig`). The signature is
`t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>" keyed by the webhook's secret>`; a
receiver checks it as docs/operators-guide.md shows."""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass

import httpx
import msgspec

from tenants.alerts import AlertEvent


@dataclass(frozen=True)
class AlertConfig:
    """How a gateway replica delivers alerts."""

    backoff_s: float = 1.0  # the wait after the first failed attempt; doubled after each
    max_backoff_s: float = 300.0
    max_attempts: int = 15  # then the delivery is given up (logged as failed)
    max_age_s: float = 3600.0  # nor is an event retried once it is older than this
    timeout_s: float = 5.0  # one attempt, connecting included
    connect_timeout_s: float = 2.0
    store_outage_s: float = 5.0  # the store out of reach this long: store_unreachable
    store_check_s: float = 1.0
    lost_check_delay_s: float = 0.5  # let a worker's own leave land before judging it lost
    claim_idle_s: float = 30.0  # an event untouched this long was dropped by its replica
    num_in_flight: int = 16  # events one replica delivers at once

    def __post_init__(self) -> None:
        if not 0 < self.backoff_s <= self.max_backoff_s:
            raise ValueError("alerts: backoff_s must be positive and at most max_backoff_s")
        if self.max_attempts < 1 or self.num_in_flight < 1:
            raise ValueError("alerts: max_attempts and num_in_flight must be at least 1")
        if min(self.timeout_s, self.connect_timeout_s, self.store_check_s) <= 0:
            raise ValueError("alerts: timeouts and the store check interval must be positive")
        if self.claim_idle_s <= 0 or self.lost_check_delay_s < 0 or self.store_outage_s < 0:
            raise ValueError("alerts: claim_idle_s must be positive, the delays not negative")

    def backoff(self, attempt: int) -> float:
        """The wait after failed attempt number `attempt` (from 1)."""
        return float(min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)))


def body_of(event: AlertEvent) -> bytes:
    """What a receiver gets: id (the idempotency id), type, created, subject, data."""
    return msgspec.json.encode(
        {
            "id": event.id,
            "type": event.type,
            "created": event.created,
            "subject": event.subject,
            "data": event.data,
        }
    )


def signature(secret: str, body: bytes, timestamp: int) -> str:
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"t={timestamp},v1={mac.hexdigest()}"


def new_client(config: AlertConfig) -> httpx.AsyncClient:
    """The delivery client: its own connections, short timeouts, no redirects followed."""
    timeout = httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=8)
    return httpx.AsyncClient(timeout=timeout, limits=limits, follow_redirects=False)


@dataclass(frozen=True)
class Outcome:
    ok: bool
    status_code: int | None = None
    error: str | None = None


async def post(client: httpx.AsyncClient, url: str, secret: str, event: AlertEvent) -> Outcome:
    """POST `event` to `url` once; any 2xx answer is a delivery."""
    body = body_of(event)
    headers = {
        "content-type": "application/json",
        "user-agent": "Strata-Webhooks/1",
        "x-strata-event": event.type,
        "x-strata-delivery": event.id,
        "x-strata-signature": signature(secret, body, int(time.time())),
    }
    try:
        response = await client.post(url, content=body, headers=headers)
    except httpx.TimeoutException:
        return Outcome(False, error="timed out")
    except httpx.HTTPError as exc:
        return Outcome(False, error=f"{type(exc).__name__}: {exc}"[:200])
    return Outcome(200 <= response.status_code < 300, status_code=response.status_code)

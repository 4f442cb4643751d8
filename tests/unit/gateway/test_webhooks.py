"""Webhook signing, bodies and the retry schedule."""

from __future__ import annotations

import hashlib
import hmac
import json

import pytest

from gateway.webhooks import AlertConfig, body_of, signature
from tenants.alerts import WebhookCreate, WebhookFieldError, new_event


def test_the_signature_is_an_hmac_of_the_timestamp_and_the_body() -> None:
    body = b'{"id":"evt_1"}'
    sig = signature("whsec_abc", body, 1700000000)
    expected = hmac.new(b"whsec_abc", b"1700000000." + body, hashlib.sha256).hexdigest()
    assert sig == f"t=1700000000,v1={expected}"
    assert signature("whsec_abd", body, 1700000000) != sig
    assert signature("whsec_abc", body, 1700000001) != sig


def test_the_body_carries_the_idempotency_id_type_time_and_data() -> None:
    event = new_event("worker_lost", "w-1", {"worker_id": "w-1", "address": "tcp://h:1"})
    body = json.loads(body_of(event))
    assert body == {
        "id": event.id,
        "type": "worker_lost",
        "created": event.created,
        "subject": "w-1",
        "data": {"worker_id": "w-1", "address": "tcp://h:1"},
    }
    assert event.created.endswith("Z") and event.id.startswith("evt_")
    assert new_event("worker_lost", "w-1", {}).id != event.id


def test_backoff_doubles_up_to_its_cap() -> None:
    config = AlertConfig(backoff_s=1.0, max_backoff_s=10.0)
    assert [config.backoff(n) for n in range(1, 7)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


@pytest.mark.parametrize(
    "bad",
    [
        {"backoff_s": 0.0},
        {"backoff_s": 5.0, "max_backoff_s": 1.0},
        {"max_attempts": 0},
        {"timeout_s": 0.0},
        {"claim_idle_s": 0.0},
        {"store_outage_s": -1.0},
    ],
)
def test_bad_delivery_settings_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="alerts"):
        AlertConfig(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("url", "events", "field"),
    [
        ("file:///etc/passwd", ["*"], "url"),
        ("https://", ["*"], "url"),
        ("example.com/hook", ["*"], "url"),
        ("https://example.com/hook", ["worker_died"], "events"),
        ("https://example.com/hook", ["test"], "events"),
        ("https://example.com/hook", [], "events"),
    ],
)
def test_a_bad_webhook_names_its_field(url: str, events: list[str], field: str) -> None:
    with pytest.raises(WebhookFieldError) as refused:
        WebhookCreate(url=url, events=events).check()
    assert refused.value.field == field and str(refused.value).startswith(field)


def test_good_webhooks_pass() -> None:
    WebhookCreate(url="http://127.0.0.1:9000/x", events=["*"]).check()
    WebhookCreate(url="https://ops.example.com/a?b=c", events=["worker_lost"]).check()

"""AlertStore against a real valkey-server: webhooks, deduplicated alerts, and the consumer
group that hands each event to one replica and an abandoned one to another."""

from __future__ import annotations

import pytest

from tenants.alerts import AlertStore, Delivery, WebhookCreate, WebhookFieldError
from tenants.errors import NotFoundError


@pytest.fixture
async def alerts(redis_client) -> AlertStore:
    store = AlertStore(redis_client)
    await store.join_group()
    return store


async def test_a_webhook_is_listed_without_its_secret_and_deleted(alerts) -> None:
    created = await alerts.create_webhook(
        WebhookCreate(url="https://ops.example.com/a", events=["worker_lost", "worker_lost"])
    )
    assert created.webhook.events == ["worker_lost"]
    assert await alerts.list_webhooks() == [created.webhook]
    (stored,) = await alerts.stored_webhooks()
    assert stored.secret == created.secret
    await alerts.delete_webhook(created.webhook.id)
    assert await alerts.list_webhooks() == []
    with pytest.raises(NotFoundError):
        await alerts.delete_webhook(created.webhook.id)
    with pytest.raises(WebhookFieldError):
        await alerts.create_webhook(WebhookCreate(url="mailto:ops@example.com"))


async def test_a_dedupe_key_raises_one_alert_whoever_raises_it(alerts, redis_client) -> None:
    counted: list[tuple[str, str]] = []
    replicas = [AlertStore(redis_client, on_raised=lambda *c: counted.append(c)) for _ in "ab"]
    first = await replicas[0].raise_alert("worker_lost", "w", {}, dedupe_key="lost:w:1")
    again = await replicas[1].raise_alert("worker_lost", "w", {}, dedupe_key="lost:w:1")
    other = await replicas[1].raise_alert("worker_lost", "w", {}, dedupe_key="lost:w:2")
    assert first is not None and again is None and other not in (None, first)
    assert counted == [
        ("worker_lost", "raised"),
        ("worker_lost", "duplicate"),
        ("worker_lost", "raised"),
    ]
    with pytest.raises(ValueError, match="unknown alert type"):
        await alerts.raise_alert("test", "w", {})


async def test_each_event_goes_to_one_consumer_and_an_abandoned_one_to_another(alerts) -> None:
    event_id = await alerts.raise_alert("budget_threshold", "acme", {"tenant": "acme"})
    taken = await alerts.read_new("replica-a", 10, block_ms=10)
    assert [e.id for _, e in taken] == [event_id]
    assert await alerts.read_new("replica-b", 10, block_ms=10) == []  # not handed out twice

    assert await alerts.claim_stale("replica-b", 60_000, 10) == []  # replica-a's is fresh
    claimed = await alerts.claim_stale("replica-b", 0, 10)  # replica-a died
    assert [(i, e.id) for i, e in claimed] == [(taken[0][0], event_id)]

    await alerts.mark_delivered(event_id, "wh_1")
    assert await alerts.delivered_to(event_id) == {"wh_1"}  # skipped when claimed again
    await alerts.ack([taken[0][0]])
    assert await alerts.claim_stale("replica-c", 0, 10) == []


async def test_the_delivery_log_keeps_the_latest_attempts_first(alerts) -> None:
    hook = (await alerts.create_webhook(WebhookCreate(url="http://h/x"))).webhook
    for attempt in range(1, 4):
        delivery = Delivery(
            event_id="evt_1", type="test", attempt=attempt, attempted_at=float(attempt)
        )
        await alerts.log_attempt(hook.id, delivery)
    assert [d.attempt for d in await alerts.deliveries(hook.id, 2)] == [3, 2]
    with pytest.raises(NotFoundError):
        await alerts.deliveries("wh_missing")

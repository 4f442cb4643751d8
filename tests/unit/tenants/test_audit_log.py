"""The audit log's stream against a real valkey-server: time windows, target filters,
pages that join up, and a bounded length."""

from __future__ import annotations

import time

from tenants import keyspace
from tenants.audit_log import AuditEntry, AuditLog


def entry(n: int, target: str, tenant_id: str | None = None) -> AuditEntry:
    return AuditEntry(
        at=time.time(),
        actor="bootstrap",
        role="admin",
        action=f"tenants.step{n}",
        method="POST",
        path=f"/admin/tenants/{target}",
        status=200,
        target=target,
        tenant_id=tenant_id,
    )


async def test_pages_join_up_and_filter_by_target(redis_client):
    log = AuditLog(redis_client)
    for n in range(7):
        await log.append(entry(n, "t_a" if n % 2 == 0 else "key_b", tenant_id="t_a"))
    await log.append(entry(7, "t_other"))
    end = time.time() + 1
    everything, cursor = await log.page(0, end, limit=100)
    assert [e.action for e in everything] == [f"tenants.step{n}" for n in range(8)]
    assert cursor is None
    seen, cursor = [], None
    while True:
        page, cursor = await log.page(0, end, target="t_a", limit=3, after=cursor)
        seen += page
        if cursor is None:
            break
    assert [e.action for e in seen] == [f"tenants.step{n}" for n in range(7)]
    only_key = [e.action async for e in log.scan(0, end, target="key_b")]
    assert only_key == ["tenants.step1", "tenants.step3", "tenants.step5"]


async def test_the_window_is_start_inclusive_end_exclusive(redis_client):
    log = AuditLog(redis_client)
    await log.append(entry(0, "t_a"))
    (first,), _ = await log.page(0, time.time() + 1)
    at_ms = int(first.id.split("-")[0])
    assert [e.id async for e in log.scan(at_ms / 1000, at_ms / 1000 + 0.001)] == [first.id]
    assert [e.id async for e in log.scan(0, at_ms / 1000)] == []


async def test_the_stream_is_trimmed_to_about_its_bound(redis_client):
    log = AuditLog(redis_client, max_entries=10)
    for n in range(500):
        await log.append(entry(n, "t_a"))
    length = await redis_client.xlen(keyspace.AUDIT_STREAM)
    assert length < 500  # approximate trimming keeps whole nodes, but never all
    newest = [e async for e in log.scan(0, time.time() + 1)]
    assert newest[-1].action == "tenants.step499"

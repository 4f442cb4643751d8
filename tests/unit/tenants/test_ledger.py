"""The usage ledger against a real valkey-server: idempotency, range queries, the writer."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time

import msgspec
import pytest

from tenants.ledger import Ledger, LedgerError, LedgerWriter, index_key, record_key
from tenants.records import UsageRecord
from tenants.store import connect

T0 = 1_700_000_000.0


def make_record(request_id: str, tenant_id: str = "tenant-a", **fields: object) -> UsageRecord:
    defaults: dict[str, object] = {
        "key_id": "key-1",
        "model": "smollm2",
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "started_at": T0 - 1,
        "finished_at": T0,
    }
    defaults.update(fields)
    return msgspec.convert(
        {"request_id": request_id, "tenant_id": tenant_id, **defaults}, UsageRecord
    )


async def collect(ledger: Ledger, tenant_id: str | None, start: float, end: float, batch: int):
    return [r async for r in ledger.iter_records(tenant_id, start, end, batch=batch)]


# -- Ledger --------------------------------------------------------------------------------


async def test_first_write_wins(redis_client):
    ledger = Ledger(redis_client)
    first = make_record("req-1", completion_tokens=7, finished_at=T0)
    again = make_record("req-1", completion_tokens=99, finished_at=T0 + 50)
    assert await ledger.record(first)
    assert not await ledger.record(again)
    assert await ledger.get("req-1") == first
    assert await ledger.get("req-missing") is None
    assert await redis_client.zrange(index_key("tenant-a"), 0, -1, withscores=True) == [
        (b"req-1", T0)
    ]
    assert await redis_client.zcard(index_key(None)) == 1


async def test_concurrent_writes_of_one_request_id_store_one_record(redis_client):
    ledger = Ledger(redis_client)
    versions = [
        make_record("req-x", tenant_id=f"tenant-{i % 3}", completion_tokens=i, finished_at=T0 + i)
        for i in range(50)
    ]
    won = await asyncio.gather(*(ledger.record(v) for v in versions))
    assert sum(won) == 1
    winner = versions[won.index(True)]
    assert await ledger.get("req-x") == winner
    assert await redis_client.zrange(index_key(None), 0, -1, withscores=True) == [
        (b"req-x", winner.finished_at)
    ]
    for tenant in ("tenant-0", "tenant-1", "tenant-2"):
        expected = 1 if tenant == winner.tenant_id else 0
        assert await redis_client.zcard(index_key(tenant)) == expected


async def test_record_many_reports_new_and_duplicate(redis_client):
    ledger = Ledger(redis_client)
    assert await ledger.record(make_record("a"))
    flags = await ledger.record_many(
        [make_record("a"), make_record("b"), make_record("b", prompt_tokens=1)]
    )
    assert flags == [False, True, False]
    stored = await ledger.get("b")
    assert stored is not None and stored.prompt_tokens == 10
    assert await ledger.count(None, -math.inf, math.inf) == 2


@pytest.mark.parametrize(
    "bad",
    [
        make_record("", finished_at=T0),
        make_record("r", tenant_id=""),
        make_record("r", finished_at=math.nan),
        make_record("r", finished_at=math.inf),
    ],
)
async def test_unstorable_records_are_refused(redis_client, bad):
    with pytest.raises(LedgerError):
        await Ledger(redis_client).record(bad)
    assert await redis_client.dbsize() == 0


async def test_pagination_returns_every_record_once_in_time_order(redis_client, monkeypatch):
    ledger = Ledger(redis_client)
    rng = random.Random(7)
    # coarse times: many ties, some tie groups straddle page boundaries
    recs = [
        make_record(
            f"req-{i:05d}",
            tenant_id=rng.choice(["tenant-a", "tenant-b"]),
            finished_at=T0 + rng.randrange(400),
        )
        for i in range(1234)
    ]
    rng.shuffle(recs)
    assert all(await ledger.record_many(recs))

    page_sizes: list[int] = []
    zrangebyscore = redis_client.zrangebyscore

    async def spy(*args, **kwargs):
        page = await zrangebyscore(*args, **kwargs)
        page_sizes.append(len(page))
        return page

    monkeypatch.setattr(redis_client, "zrangebyscore", spy)

    def in_order(rs):
        return sorted(rs, key=lambda r: (r.finished_at, r.request_id))

    got_all = await collect(ledger, None, T0, T0 + 400, batch=100)
    assert got_all == in_order(recs)
    assert page_sizes == [100] * 12 + [34]
    for tenant in ("tenant-a", "tenant-b"):
        got = await collect(ledger, tenant, T0, T0 + 400, batch=100)
        assert got == in_order(r for r in recs if r.tenant_id == tenant)
        assert await ledger.count(tenant, T0, T0 + 400) == len(got)


async def test_ties_longer_than_a_page(redis_client):
    ledger = Ledger(redis_client)
    recs = [make_record(f"r{i:03d}", finished_at=T0) for i in range(250)]
    recs += [make_record(f"s{i:03d}", finished_at=T0 + 1) for i in range(5)]
    await ledger.record_many(recs)
    for batch in (1, 7, 100, 250, 1000):
        got = await collect(ledger, "tenant-a", T0, T0 + 2, batch=batch)
        assert [r.request_id for r in got] == [r.request_id for r in recs]


async def test_range_is_start_inclusive_end_exclusive(redis_client):
    ledger = Ledger(redis_client)
    for i, t in enumerate([T0, T0 + 0.5, T0 + 1, T0 + 2]):
        await ledger.record(make_record(f"r{i}", finished_at=t))

    async def ids(start: float, end: float) -> list[str]:
        return [r.request_id for r in await collect(ledger, "tenant-a", start, end, batch=2)]

    assert await ids(T0, T0 + 1) == ["r0", "r1"]
    assert await ids(T0 + 0.5, T0 + 2) == ["r1", "r2"]
    assert await ids(T0 + 2, T0 + 3) == ["r3"]
    assert await ids(T0, T0) == []
    assert await ledger.count("tenant-a", T0, T0 + 1) == 2
    assert await ledger.count("tenant-a", T0 + 2, T0 + 2) == 0


async def test_tenants_are_isolated(redis_client):
    ledger = Ledger(redis_client)
    await ledger.record_many(
        [make_record(f"a{i}", "tenant-a", finished_at=T0 + i) for i in range(30)]
    )
    await ledger.record_many(
        [make_record(f"b{i}", "tenant-b", finished_at=T0 + i) for i in range(20)]
    )
    got_a = await collect(ledger, "tenant-a", 0, math.inf, batch=7)
    assert {r.tenant_id for r in got_a} == {"tenant-a"} and len(got_a) == 30
    assert await collect(ledger, "tenant-c", 0, math.inf, batch=7) == []
    assert await ledger.count("tenant-b", 0, math.inf) == 20
    assert await ledger.count(None, 0, math.inf) == 50


# -- LedgerWriter --------------------------------------------------------------------------


async def test_writer_writes_in_the_background_and_drains(redis_client):
    ledger = Ledger(redis_client)
    writer = LedgerWriter(ledger, batch_size=64)
    writer.start()
    for i in range(300):
        writer.submit(make_record(f"req-{i}", finished_at=T0 + i))
    assert writer.pending == 300  # submit only queues
    for _ in range(200):
        if writer.pending == 0:
            break
        await asyncio.sleep(0.01)
    assert writer.pending == 0
    assert await ledger.count("tenant-a", T0, T0 + 300) == 300
    writer.submit(make_record("late", finished_at=T0))
    assert await writer.drain(timeout=5.0) == 0
    assert writer.num_written == 301 and writer.num_duplicates == 0
    with pytest.raises(LedgerError):
        writer.submit(make_record("bad", finished_at=math.nan))
    assert writer.pending == 0


async def test_drain_ends_and_writes_everything_when_it_stops_the_writer_mid_write(
    redis_client,
):
    """The drain's cancellation of the background writer can land just as the writer sends a
    batch, which Python 3.11 loses (redis-py's `asyncio.wait_for`): the writer then finished
    the queue and waited for more forever, and so did the drain (a gateway's stop hung with
    it, before the usage it was to write)."""
    ledger = Ledger(redis_client)
    num_rounds, num_records = 20, 200
    for r in range(num_rounds):
        writer = LedgerWriter(ledger, batch_size=4)
        writer.start()
        for i in range(num_records):
            writer.submit(make_record(f"req-{r}-{i}", finished_at=T0 + i))
        await asyncio.sleep(r % 5 * 0.002)  # the drain comes at another point of the writes
        drain = asyncio.create_task(writer.drain(timeout=10.0))
        await asyncio.wait([drain], timeout=30.0)
        assert drain.done(), f"round {r}: the drain did not end"
        assert drain.result() == 0
    assert await ledger.count("tenant-a", T0, T0 + num_records) == num_rounds * num_records


async def test_writer_keeps_records_through_an_outage(private_store, caplog):
    client = connect(private_store.url, timeout=0.5)
    ledger = Ledger(client)
    writer = LedgerWriter(ledger, batch_size=16, retry_initial_s=0.01, retry_max_s=0.1)
    writer.start()
    private_store.kill()
    recs = [make_record(f"req-{i}", finished_at=T0 + i) for i in range(40)]
    with caplog.at_level(logging.WARNING, logger="tenants.ledger"):
        for rec in recs:
            writer.submit(rec)
        writer.submit(make_record("req-0", prompt_tokens=12345))  # a retried submission
        await asyncio.sleep(0.5)
        assert writer.pending == 41  # nothing dropped while the store is down
    assert any("41 records pending" in m for m in caplog.messages)

    private_store.start()  # same data dir; the client reconnects on its own
    assert await writer.drain(timeout=10.0) == 0
    assert await ledger.count("tenant-a", T0, T0 + 40) == 40
    assert await client.zcard(index_key(None)) == 40
    assert await ledger.get("req-0") == recs[0]  # queue order: the first submission wins
    assert writer.num_written == 40 and writer.num_duplicates == 1
    await client.aclose()


async def test_drain_reports_what_it_could_not_write(private_store):
    client = connect(private_store.url, timeout=0.5)
    ledger = Ledger(client)
    writer = LedgerWriter(ledger, retry_initial_s=0.01, retry_max_s=0.05)
    writer.start()
    private_store.kill()
    for i in range(5):
        writer.submit(make_record(f"req-{i}", finished_at=T0 + i))
    began = time.monotonic()
    assert await writer.drain(timeout=0.5) == 5
    assert time.monotonic() - began < 2.0
    assert writer.pending == 5

    private_store.start()
    assert await writer.drain(timeout=10.0) == 0
    assert await ledger.count(None, T0, T0 + 5) == 5
    assert await client.exists(record_key("req-4")) == 1
    await client.aclose()

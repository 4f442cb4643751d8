"""Billing exports: round trips in every format and granularity, exact costs, streaming."""

from __future__ import annotations

import csv
import io
import json
import math
from collections import defaultdict
from collections.abc import AsyncIterator, Iterable
from datetime import UTC, datetime
from decimal import Decimal
from fractions import Fraction
from typing import Any

import msgspec
import pytest

from tenants.export import (
    COST_COLUMNS,
    PERIOD_COLUMNS,
    REQUEST_COLUMNS,
    ExportError,
    ExportOrderError,
    ModelNames,
    PriceBook,
    export_usage,
    media_type,
)
from tenants.ledger import Ledger
from tenants.records import Price, UsageRecord

FORMATS = ("csv", "ndjson", "json")
GRANULARITIES = ("request", "hour", "day")
# 2024-03-01 22:00 UTC: the sample crosses midnight into March 2nd
T0 = datetime(2024, 3, 1, 22, 0, tzinfo=UTC).timestamp()
PRICES = {
    "smollm2": Price(model="smollm2", prompt_per_m=0.15, cached_per_m=0.075, completion_per_m=0.6),
    "lora-x": Price(model="lora-x", prompt_per_m=1.0, cached_per_m=0.5, completion_per_m=2.0),
}


def sample_records(n: int = 120) -> list[UsageRecord]:
    """Time-ordered records over ~4.5 hours, two tenants, priced and unpriced models/adapters."""
    recs = []
    for i in range(n):
        model = "unpriced" if i % 11 == 0 else "smollm2"
        recs.append(
            UsageRecord(
                request_id=f"chatcmpl-{i:04d}",
                tenant_id=("tenant-a", "tenant-b")[i % 2],
                key_id="key-1",
                model=model,
                adapter=(None, "lora-x", "lora-free")[i % 3],
                user=("alice", None, 'bob, "the" builder\n')[i % 3],
                prompt_tokens=1000 + 37 * i,
                cached_tokens=(i % 4) * 100,
                completion_tokens=50 + i,
                status="stop",
                ttft_ms=None if i % 5 == 0 else 12.5 + i,
                e2e_ms=100.25 + i,
                started_at=T0 + 137 * i - 1.5,
                finished_at=T0 + 137 * i,
            )
        )
    return recs


async def aiter_of(recs: Iterable[UsageRecord]) -> AsyncIterator[UsageRecord]:
    for rec in recs:
        yield rec


async def export_bytes(recs: Iterable[UsageRecord], fmt: Any, granularity: Any, **kw) -> bytes:
    chunks = [
        c
        async for c in export_usage(
            aiter_of(recs), fmt=fmt, granularity=granularity, prices=PRICES, **kw
        )
    ]
    return b"".join(chunks)


def parse_rows(fmt: str, data: bytes) -> list[dict[str, Any]]:
    """Rows as dicts; CSV empty cells become None, JSON non-integers become Decimal."""
    text = data.decode()
    if fmt == "csv":
        return [
            {k: (v if v != "" else None) for k, v in row.items()}
            for row in csv.DictReader(io.StringIO(text, newline=""))
        ]
    if fmt == "ndjson":
        assert text == "" or text.endswith("\n")
        return [json.loads(line, parse_float=Decimal) for line in text.splitlines()]
    rows = json.loads(text, parse_float=Decimal)
    assert isinstance(rows, list)
    return rows


def as_record(row: dict[str, Any]) -> UsageRecord:
    fields = {k: row[k] for k in UsageRecord.__struct_fields__}
    fields = {k: float(v) if isinstance(v, Decimal) else v for k, v in fields.items()}
    return msgspec.convert(fields, UsageRecord, strict=False)


def expected_costs(model: str, adapter: str | None, prompt: int, cached: int, completion: int):
    """(prompt, cached, completion, total) as exact fractions: adapter price, else model's."""
    price = PRICES.get(adapter or "") or PRICES.get(model)
    if price is None:
        return (Fraction(0),) * 4
    rates = [
        Fraction(repr(p)) for p in (price.prompt_per_m, price.cached_per_m, price.completion_per_m)
    ]
    costs = [(prompt - cached) * rates[0], cached * rates[1], completion * rates[2]]
    costs = [c / 1_000_000 for c in costs]
    return (*costs, sum(costs))


def row_costs(row: dict[str, Any]) -> tuple[Fraction, ...]:
    return tuple(Fraction(Decimal(str(row[c]))) for c in COST_COLUMNS)


def bucket(ts: float, granularity: str) -> str:
    dt = datetime.fromtimestamp(ts, UTC).replace(minute=0, second=0, microsecond=0)
    if granularity == "day":
        dt = dt.replace(hour=0)
    return dt.isoformat().replace("+00:00", "Z")


# -- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
async def test_request_rows_round_trip(fmt):
    recs = sample_records()
    rows = parse_rows(fmt, await export_bytes(recs, fmt, "request"))
    assert [list(r) for r in rows] == [list(REQUEST_COLUMNS)] * len(recs)
    assert [as_record(r) for r in rows] == recs
    for row, rec in zip(rows, recs, strict=True):
        assert row_costs(row) == expected_costs(
            rec.model, rec.adapter, rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens
        )


@pytest.mark.parametrize("granularity", ["hour", "day"])
@pytest.mark.parametrize("fmt", FORMATS)
async def test_period_rows_aggregate_per_utc_bucket(redis_client, fmt, granularity):
    ledger = Ledger(redis_client)
    recs = sample_records()
    await ledger.record_many(recs)
    stored = ledger.iter_records(None, -math.inf, math.inf, batch=17)
    chunks = export_usage(stored, fmt=fmt, granularity=granularity, prices=PRICES)
    rows = parse_rows(fmt, b"".join([c async for c in chunks]))

    expected: dict[tuple, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for rec in recs:
        acc = expected[
            (bucket(rec.finished_at, granularity), rec.tenant_id, rec.model, rec.adapter)
        ]
        for j, n in enumerate((1, rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens)):
            acc[j] += n
    got = {}
    for row in rows:
        assert list(row) == list(PERIOD_COLUMNS)
        key = (row["period_start"], row["tenant_id"], row["model"], row["adapter"])
        assert key not in got  # one row per (period, tenant, model, adapter)
        got[key] = [int(row[c]) for c in PERIOD_COLUMNS[4:8]]
        assert row_costs(row) == expected_costs(*key[2:], *got[key][1:])
    assert got == dict(expected)
    periods = [row["period_start"] for row in rows]
    assert periods == sorted(periods)
    if granularity == "day":
        assert set(periods) == {"2024-03-01T00:00:00Z", "2024-03-02T00:00:00Z"}
    else:
        assert {"2024-03-01T23:00:00Z", "2024-03-02T00:00:00Z"} <= set(periods)
        assert len(set(periods)) == 5

    # totals of the export equal totals over the ledger, costs exactly
    total_cost = sum(row_costs(row)[3] for row in rows)
    assert total_cost == sum(
        expected_costs(r.model, r.adapter, r.prompt_tokens, r.cached_tokens, r.completion_tokens)[3]
        for r in recs
    )
    assert total_cost > 0
    assert sum(int(row["prompt_tokens"]) for row in rows) == sum(r.prompt_tokens for r in recs)
    assert sum(int(row["requests"]) for row in rows) == await ledger.count(None, 0, math.inf)


async def test_request_and_day_costs_reconcile_exactly():
    recs = sample_records(300)
    by_request = parse_rows("json", await export_bytes(recs, "json", "request"))
    by_day = parse_rows("json", await export_bytes(recs, "json", "day"))
    for j in range(4):
        assert sum(row_costs(r)[j] for r in by_request) == sum(row_costs(r)[j] for r in by_day)


async def test_price_lookup_adapter_then_model_then_zero():
    base: dict[str, Any] = {
        "tenant_id": "t",
        "key_id": "k",
        "prompt_tokens": 1_000_000,
        "cached_tokens": 200_000,
        "completion_tokens": 500_000,
    }
    recs = [
        UsageRecord(request_id="adapter-priced", model="smollm2", adapter="lora-x", **base),
        UsageRecord(request_id="adapter-unpriced", model="smollm2", adapter="lora-free", **base),
        UsageRecord(request_id="model-unpriced", model="other", **base),
    ]
    book = PriceBook(PRICES)
    data = b"".join(
        [
            c
            async for c in export_usage(
                aiter_of(recs), fmt="csv", granularity="request", prices=book
            )
        ]
    )
    rows = parse_rows("csv", data)
    assert [tuple(row[c] for c in COST_COLUMNS) for row in rows] == [
        ("0.8", "0.1", "1", "1.9"),
        ("0.12", "0.015", "0.3", "0.435"),
        ("0", "0", "0", "0"),
    ]
    assert [row["priced"] for row in rows] == ["true", "true", "false"]
    assert book.unpriced == {"other": 1}  # never silently zero: counted for the caller


async def test_an_adapter_versions_price_comes_before_its_names():
    prices = {**PRICES, "lora-x@2": Price(model="lora-x@2", prompt_per_m=10.0)}
    base: dict[str, Any] = {
        "tenant_id": "t",
        "key_id": "k",
        "model": "smollm2",
        "adapter": "lora-x",
        "prompt_tokens": 1_000_000,
    }
    recs = [
        UsageRecord(request_id="v2", adapter_version=2, **base),
        UsageRecord(request_id="v3", adapter_version=3, **base),
    ]
    data = b"".join(
        [
            c
            async for c in export_usage(
                aiter_of(recs), fmt="json", granularity="request", prices=prices
            )
        ]
    )
    assert [row["cost_prompt"] for row in parse_rows("json", data)] == [10, 1]


async def test_period_rows_count_unpriced_requests():
    recs = [
        UsageRecord(
            request_id=f"r{i}", tenant_id="t", key_id="k", model="other", finished_at=T0 + i
        )
        for i in range(3)
    ]
    book = PriceBook(PRICES)
    data = b"".join(
        [c async for c in export_usage(aiter_of(recs), fmt="json", granularity="day", prices=book)]
    )
    (row,) = parse_rows("json", data)
    assert row["priced"] is False and row["requests"] == 3
    assert book.unpriced == {"other": 3}


async def test_records_written_under_an_alias_or_an_adapters_name_read_as_the_base_model():
    names = ModelNames({"default": "smollm2"}, {"lora-x": "smollm2"}, default_base="smollm2")
    base: dict[str, Any] = {"tenant_id": "t", "key_id": "k", "prompt_tokens": 1_000_000}
    recs = [
        UsageRecord(request_id="alias", model="default", **base),
        UsageRecord(request_id="old-adapter", model="lora-x", adapter="lora-x", **base),
        UsageRecord(request_id="old-version", model="lora-x@4", adapter="lora-x", **base),
        UsageRecord(request_id="deleted", model="gone", adapter="gone", **base),
        UsageRecord(
            request_id="canonical", model="smollm2", adapter="lora-x", adapter_version=4, **base
        ),
    ]
    data = b"".join(
        [
            c
            async for c in export_usage(
                aiter_of(recs), fmt="json", granularity="request", prices=PRICES, names=names
            )
        ]
    )
    rows = parse_rows("json", data)
    assert [row["model"] for row in rows] == ["smollm2"] * 5
    assert [row["cost_prompt"] for row in rows] == [Decimal("0.15"), 1, 1, Decimal("0.15"), 1]
    day = b"".join(
        [
            c
            async for c in export_usage(
                aiter_of(recs), fmt="json", granularity="day", prices=PRICES, names=names
            )
        ]
    )
    assert {(r["model"], r["adapter"]) for r in parse_rows("json", day)} == {
        ("smollm2", None),
        ("smollm2", "lora-x"),
        ("smollm2", "gone"),
    }  # one model row, not one per name it was asked by


# -- documents and streaming ---------------------------------------------------------------


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("fmt", FORMATS)
async def test_no_records_is_a_valid_empty_document(fmt, granularity):
    data = await export_bytes([], fmt, granularity)
    assert parse_rows(fmt, data) == []
    if fmt == "csv":
        columns = REQUEST_COLUMNS if granularity == "request" else PERIOD_COLUMNS
        assert next(csv.reader(io.StringIO(data.decode()))) == list(columns)
    elif fmt == "json":
        assert json.loads(data) == []
    else:
        assert data == b""


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("fmt", FORMATS)
async def test_chunks_arrive_before_the_input_is_consumed(fmt, granularity):
    recs = sample_records(3000)  # ~114 hours: many hour buckets
    consumed = 0

    async def source() -> AsyncIterator[UsageRecord]:
        nonlocal consumed
        for rec in recs:
            consumed += 1
            yield rec

    consumed_at_chunk = []
    chunks = []
    async for chunk in export_usage(
        source(), fmt=fmt, granularity=granularity, prices=PRICES, chunk_bytes=2048
    ):
        consumed_at_chunk.append(consumed)
        chunks.append(chunk)
    assert len(chunks) > 3
    assert consumed_at_chunk[0] < len(recs) / 2
    assert max(len(c) for c in chunks[:-1]) < 2048 + 1024  # a chunk is about chunk_bytes
    rows = parse_rows(fmt, b"".join(chunks))
    requests = [1] * len(rows) if granularity == "request" else [int(r["requests"]) for r in rows]
    assert sum(requests) == len(recs)


async def test_periods_need_time_ordered_input():
    recs = sample_records(60)
    with pytest.raises(ExportOrderError):
        await export_bytes([*recs[30:], *recs[:30]], "csv", "hour")
    await export_bytes([*recs[30:], *recs[:30]], "csv", "request")  # order-free


def test_bad_arguments_fail_before_streaming():
    with pytest.raises(ExportError, match="format"):
        export_usage(aiter_of([]), fmt="xml", granularity="day", prices={})  # type: ignore[arg-type]
    with pytest.raises(ExportError, match="granularity"):
        export_usage(aiter_of([]), fmt="csv", granularity="week", prices={})  # type: ignore[arg-type]
    assert media_type("ndjson") == "application/x-ndjson"


async def test_csv_neutralises_formulas_json_keeps_text():
    formula = '=HYPERLINK("http://evil")'
    rec = UsageRecord(request_id="r", tenant_id="t", key_id="k", model="m", user=formula)
    csv_row = parse_rows("csv", await export_bytes([rec], "csv", "request"))[0]
    assert csv_row["user"] == "'" + formula
    json_row = parse_rows("json", await export_bytes([rec], "json", "request"))[0]
    assert json_row["user"] == formula

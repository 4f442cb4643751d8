"""Billing exports: usage records streamed out as CSV, NDJSON or a JSON array, one row per
request or aggregated into UTC hour/day buckets, with cost columns from a price table.

Costs are exact decimals: a price per 1M tokens (as the operator wrote it, e.g. 0.15) times a
token count, shifted by six decimal places. Per-request costs therefore add up exactly to the
costs of the hour/day rows they fall in. CSV and JSON write them as plain decimal numbers
(`0.000025`, never `2.5E-5`). A row no price applies to costs 0 and says so (`priced: false`).
"""

from __future__ import annotations

import collections
import csv
import io
from collections.abc import AsyncIterator, Mapping, Sequence
from datetime import UTC, datetime
from decimal import Context, Decimal
from typing import Literal, Protocol, get_args

import msgspec

from tenants.records import Price, UsageRecord

ExportFormat = Literal["csv", "ndjson", "json"]
Granularity = Literal["request", "hour", "day"]

COST_COLUMNS = ("cost_prompt", "cost_cached", "cost_completion", "cost_total")
REQUEST_COLUMNS = (*UsageRecord.__struct_fields__, *COST_COLUMNS, "priced")
PERIOD_COLUMNS = (
    "period_start",
    "tenant_id",
    "model",
    "adapter",
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    *COST_COLUMNS,
    "priced",
)

_PERIOD_SECONDS = {"hour": 3600, "day": 86400}
_CSV_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


class ExportError(ValueError):
    """A bad export request (unknown format or granularity)."""


class ExportOrderError(ExportError):
    """Hour/day export fed records out of `finished_at` order (a bucket already emitted)."""


def media_type(fmt: ExportFormat) -> str:
    """The HTTP Content-Type of an export in `fmt`."""
    types = {"csv": "text/csv; charset=utf-8", "ndjson": "application/x-ndjson"}
    return types.get(fmt, "application/json")


def _exact(price_per_m: float) -> Decimal:
    # the shortest repr is the number the operator wrote (0.15, not 0.1499999999999999944…)
    return Decimal(repr(float(price_per_m)))


Costs = tuple[Decimal, Decimal, Decimal, Decimal]


class PriceBook:
    """Prices by model or adapter name, as exact decimals. Caches conversions and counts the
    rows no price applied to (`unpriced`, by model or adapter name); one per export."""

    def __init__(self, prices: Mapping[str, Price]) -> None:
        self._prices = prices
        self._ctx = Context(prec=60)
        self._cache: dict[str, tuple[Decimal, Decimal, Decimal] | None] = {}
        self.unpriced: collections.Counter[str] = collections.Counter()

    def _rates(self, name: str) -> tuple[Decimal, Decimal, Decimal] | None:
        if name not in self._cache:
            price = self._prices.get(name)
            self._cache[name] = (
                None
                if price is None
                else (
                    _exact(price.prompt_per_m),
                    _exact(price.cached_per_m),
                    _exact(price.completion_per_m),
                )
            )
        return self._cache[name]

    def rates_for(
        self, model: str, adapter: str | None, adapter_version: int | None = None
    ) -> tuple[Decimal, Decimal, Decimal] | None:
        """The first price of: the adapter's version (`name@version`), the adapter, its base
        model. None when none of them is priced."""
        names = []
        if adapter:
            if adapter_version is not None:
                names.append(f"{adapter}@{adapter_version}")
            names.append(adapter)
        names.append(model)
        for name in names:
            if (rates := self._rates(name)) is not None:
                return rates
        return None

    def costs(
        self,
        model: str,
        adapter: str | None,
        prompt_tokens: int,
        cached_tokens: int,
        completion_tokens: int,
        adapter_version: int | None = None,
        num_requests: int = 1,
    ) -> tuple[Costs, bool]:
        """((prompt, cached, completion, total) cost, whether a price applied). Prices are
        looked up as `rates_for` says; with none, every cost is zero, the `num_requests`
        the row stands for are counted in `unpriced` and the flag is False. Cached tokens
        are part of the prompt: `prompt` bills prompt - cached tokens (never below zero)."""
        rates = self.rates_for(model, adapter, adapter_version)
        if rates is None:
            self.unpriced[adapter or model] += num_requests
            zero = Decimal(0)
            return (zero, zero, zero, zero), False
        ctx = self._ctx

        def cost(num_tokens: int, rate_per_m: Decimal) -> Decimal:
            return ctx.multiply(Decimal(num_tokens), rate_per_m).scaleb(-6, ctx)

        prompt = cost(max(prompt_tokens - cached_tokens, 0), rates[0])
        cached = cost(cached_tokens, rates[1])
        completion = cost(completion_tokens, rates[2])
        return (prompt, cached, completion, ctx.add(ctx.add(prompt, cached), completion)), True


class ModelNames:
    """How records name models, made canonical on read: `aliases` maps an alias (`default`,
    an operator's name) to the canonical model id; `adapter_bases` maps an adapter to the
    base model it belongs to. Records written before names were canonical carry an alias,
    or an adapter request's own name, in `model`."""

    def __init__(
        self,
        aliases: Mapping[str, str] | None = None,
        adapter_bases: Mapping[str, str] | None = None,
        *,
        default_base: str | None = None,
    ) -> None:
        self.aliases = dict(aliases or {})
        self.adapter_bases = dict(adapter_bases or {})
        self.default_base = default_base  # for adapters no longer registered

    def canonical(self, rec: UsageRecord) -> UsageRecord:
        model = self.aliases.get(rec.model, rec.model)
        adapter = rec.adapter
        if adapter is not None and model.partition("@")[0] == adapter:
            model = self.adapter_bases.get(adapter) or self.default_base or model
        if model == rec.model:
            return rec
        return msgspec.structs.replace(rec, model=model)


def format_decimal(value: Decimal) -> str:
    """Plain notation without trailing zeros: 0.000025, 12, 0."""
    return format(value.normalize(Context(prec=60)), "f")


# -- rows ----------------------------------------------------------------------------------


async def _canonical(
    records: AsyncIterator[UsageRecord], names: ModelNames
) -> AsyncIterator[UsageRecord]:
    async for rec in records:
        yield names.canonical(rec)


async def _request_rows(
    records: AsyncIterator[UsageRecord], book: PriceBook
) -> AsyncIterator[Sequence[object]]:
    async for rec in records:
        costs, priced = book.costs(
            rec.model,
            rec.adapter,
            rec.prompt_tokens,
            rec.cached_tokens,
            rec.completion_tokens,
            rec.adapter_version,
        )
        yield (*msgspec.structs.astuple(rec), *costs, priced)


_GroupKey = tuple[str, str, str | None]  # tenant, model, adapter


def _bucket_rows(
    bucket_start: int, groups: dict[_GroupKey, list[int]], book: PriceBook
) -> list[Sequence[object]]:
    period = datetime.fromtimestamp(bucket_start, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    rows: list[Sequence[object]] = []
    for key in sorted(groups, key=lambda k: (k[0], k[1], k[2] is not None, k[2] or "")):
        tenant_id, model, adapter = key
        num_requests, prompt, cached, completion = groups[key]
        costs, priced = book.costs(
            model, adapter, prompt, cached, completion, num_requests=num_requests
        )
        rows.append(
            (
                period,
                tenant_id,
                model,
                adapter,
                num_requests,
                prompt,
                cached,
                completion,
                *costs,
                priced,
            )
        )
    return rows


async def _period_rows(
    records: AsyncIterator[UsageRecord], book: PriceBook, period_s: int
) -> AsyncIterator[Sequence[object]]:
    # records arrive in finished_at order: a bucket is complete once a later one starts
    current: int | None = None
    groups: dict[_GroupKey, list[int]] = {}
    async for rec in records:
        bucket = int(rec.finished_at // period_s) * period_s
        if bucket != current:
            if current is not None:
                if bucket < current:
                    raise ExportOrderError(
                        f"record {rec.request_id} finished before an already exported period"
                    )
                for row in _bucket_rows(current, groups, book):
                    yield row
            current, groups = bucket, {}
        acc = groups.setdefault((rec.tenant_id, rec.model, rec.adapter), [0, 0, 0, 0])
        acc[0] += 1
        acc[1] += rec.prompt_tokens
        acc[2] += rec.cached_tokens
        acc[3] += rec.completion_tokens
    if current is not None:
        for row in _bucket_rows(current, groups, book):
            yield row


# -- encodings -----------------------------------------------------------------------------


class _RowEncoder(Protocol):
    def begin(self) -> bytes: ...
    def row(self, values: Sequence[object]) -> bytes: ...
    def end(self) -> bytes: ...


def _csv_cell(value: object) -> object:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Decimal):
        return format_decimal(value)
    if isinstance(value, str) and value.startswith(_CSV_FORMULA_START):
        return "'" + value  # keep spreadsheets from evaluating client-supplied text
    return value


class _CsvEncoder:
    def __init__(self, columns: Sequence[str]) -> None:
        self._columns = columns
        self._buf = io.StringIO()
        self._writer = csv.writer(self._buf)

    def _take(self) -> bytes:
        text = self._buf.getvalue()
        self._buf.seek(0)
        self._buf.truncate()
        return text.encode()

    def begin(self) -> bytes:
        self._writer.writerow(self._columns)
        return self._take()

    def row(self, values: Sequence[object]) -> bytes:
        self._writer.writerow([_csv_cell(v) for v in values])
        return self._take()

    def end(self) -> bytes:
        return b""


def _json_value(value: object) -> object:
    return msgspec.Raw(format_decimal(value).encode()) if isinstance(value, Decimal) else value


class _NdjsonEncoder:
    def __init__(self, columns: Sequence[str]) -> None:
        self._columns = columns
        self._encoder = msgspec.json.Encoder()

    def _object(self, values: Sequence[object]) -> bytes:
        return self._encoder.encode(
            {c: _json_value(v) for c, v in zip(self._columns, values, strict=True)}
        )

    def begin(self) -> bytes:
        return b""

    def row(self, values: Sequence[object]) -> bytes:
        return self._object(values) + b"\n"

    def end(self) -> bytes:
        return b""


class _JsonArrayEncoder(_NdjsonEncoder):
    def __init__(self, columns: Sequence[str]) -> None:
        super().__init__(columns)
        self._num_rows = 0

    def begin(self) -> bytes:
        return b"["

    def row(self, values: Sequence[object]) -> bytes:
        self._num_rows += 1
        return (b",\n" if self._num_rows > 1 else b"") + self._object(values)

    def end(self) -> bytes:
        return b"]\n"


def export_usage(
    records: AsyncIterator[UsageRecord],
    *,
    fmt: ExportFormat,
    granularity: Granularity,
    prices: Mapping[str, Price] | PriceBook,
    names: ModelNames | None = None,
    chunk_bytes: int = 64 * 1024,
) -> AsyncIterator[bytes]:
    """Stream `records` as an export document in chunks of about `chunk_bytes`.

    `request` rows hold every UsageRecord field plus the cost columns, in input order.
    `hour`/`day` rows sum requests and tokens per (UTC period, tenant, model, adapter); the
    input must be in `finished_at` order (as `Ledger.iter_records` yields it), so each period
    is written once the next begins and only one period is held in memory (ExportOrderError
    otherwise). Records are read through `names` (aliases and adapter requests become the
    canonical base model id). Costs use the adapter's price, else its base model's; a row
    with neither costs zero, has `priced` false and is counted, by requests, in the
    PriceBook's `unpriced` (pass a PriceBook to read it afterwards). Any number of rows,
    zero included, makes a valid document: CSV with a header row, NDJSON, or one JSON
    array.
    Raises ExportError at once for an unknown `fmt` or `granularity`.
    """
    if fmt not in get_args(ExportFormat):
        raise ExportError(f"unknown export format {fmt!r}")
    if granularity not in get_args(Granularity):
        raise ExportError(f"unknown granularity {granularity!r}")
    if chunk_bytes < 1:
        raise ExportError("chunk_bytes must be positive")
    book = prices if isinstance(prices, PriceBook) else PriceBook(prices)
    if names is not None:
        records = _canonical(records, names)
    if granularity == "request":
        rows, columns = _request_rows(records, book), REQUEST_COLUMNS
    else:
        rows, columns = _period_rows(records, book, _PERIOD_SECONDS[granularity]), PERIOD_COLUMNS
    return _stream(rows, _encoder(fmt, columns), chunk_bytes)


def encode_rows(
    rows: AsyncIterator[Sequence[object]],
    columns: Sequence[str],
    fmt: ExportFormat,
    chunk_bytes: int = 64 * 1024,
) -> AsyncIterator[bytes]:
    """Any rows of `columns` as an export document in `fmt`, the encodings usage exports
    use. Raises ExportError for an unknown `fmt`."""
    if fmt not in get_args(ExportFormat):
        raise ExportError(f"unknown export format {fmt!r}")
    return _stream(rows, _encoder(fmt, columns), chunk_bytes)


def _encoder(fmt: ExportFormat, columns: Sequence[str]) -> _RowEncoder:
    if fmt == "csv":
        return _CsvEncoder(columns)
    if fmt == "ndjson":
        return _NdjsonEncoder(columns)
    return _JsonArrayEncoder(columns)


async def _stream(
    rows: AsyncIterator[Sequence[object]], encoder: _RowEncoder, chunk_bytes: int
) -> AsyncIterator[bytes]:
    parts = [encoder.begin()]
    size = len(parts[0])
    async for values in rows:
        part = encoder.row(values)
        parts.append(part)
        size += len(part)
        if size >= chunk_bytes:
            yield b"".join(parts)
            parts.clear()
            size = 0
    parts.append(encoder.end())
    yield b"".join(parts)
